import os

from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer
from sb3_influence.common.round import InfluenceRound, StepInfo
from sb3_influence.common.scoring import InfluenceEngine, LayerScorer
from sb3_influence.common.targets import ActionTarget, ReturnTarget, Target
from sb3_influence.influence_ppo import InfluencePPO
from sb3_influence.common.callbacks import AttributionCallback, IIFCallback
from sb3_influence.common.extractors import MiniGridCNN
from sb3_influence.common.snapshots import Snapshot, SnapshotError, load_snapshot, load_snapshots
from sb3_influence.common.state import TrainingState, training_state

# Read version from file
version_file = os.path.join(os.path.dirname(__file__), "version.txt")
with open(version_file) as file_handler:
    __version__ = file_handler.read().strip()

__all__ = [
    "ActionTarget",
    "AttributionCallback",
    "IIFCallback",
    "InfluenceDictRolloutBuffer",
    "InfluenceEngine",
    "InfluencePPO",
    "InfluenceRolloutBuffer",
    "InfluenceRound",
    "LayerScorer",
    "MiniGridCNN",
    "ReturnTarget",
    "Snapshot",
    "SnapshotError",
    "StepInfo",
    "Target",
    "TrainingState",
    "__version__",
    "load_snapshot",
    "load_snapshots",
    "training_state",
]
