"""Multi-checkpoint influence (the paper's formal definition, Sec. 3.1): a step hook summing over the update."""

import numpy as np

from sb3_influence.common.round import StepInfo
from sb3_influence.common.scoring.engine import InfluenceEngine
from sb3_influence.common.targets import Target


class MultiCheckpointScorer:
    """
    Step hook that accumulates, for every optimiser step j of an update and every record i of its minibatch,
    ``Â_ij · ⟨∇θ log π(a_i|s_i), ∇θ f⟩`` at θ_j, with ``Â_ij`` the advantage as step j's loss used it
    (TracIn-style: the SGD, no-clip reading of each step).

    :param engine: The model's scoring engine.
    :param target: The target f (its gradient is recomputed at every θ_j).
    :param batch_size: Records per scoring chunk.
    :ivar scores: The accumulated scores, flat by record id.
    """

    def __init__(self, engine: InfluenceEngine, target: Target, batch_size: int):
        self.engine = engine
        self.target = target
        self.batch_size = batch_size
        self.scores = np.zeros(engine.buffer.n_records, dtype=np.float64)

    def __call__(self, info: StepInfo) -> None:
        with self.engine.eval_mode():
            v = self.engine.target_gradient(self.target, self.batch_size)
            if not v:
                return
            ids = info.record_ids
            alignment = self.engine.alignment(v, self.batch_size, ids)[ids]
        self.scores[ids] += info.advantages.detach().cpu().double().numpy() * alignment
