import os

from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer
from sb3_influence.common.influence import InfluenceEngine
from sb3_influence.common.targets import ActionTarget, ReturnTarget, Target
from sb3_influence.influence_ppo import InfluencePPO
from sb3_influence.common.callbacks import AttributionCallback, IIFCallback
from sb3_influence.common.extractors import MiniGridCNN
from sb3_influence.common.snapshots import load_snapshot, load_snapshots

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
    "MiniGridCNN",
    "ReturnTarget",
    "Target",
    "__version__",
    "load_snapshot",
    "load_snapshots",
]
