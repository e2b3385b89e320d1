"""
Save and restore everything a PPO update changes: the one implementation used by the multi-checkpoint replay,
post-update scoring at θ(k) and counterfactual retraining (``sb3_influence.analysis.intervention``).
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th

from sb3_influence.common import sb3_compat


@dataclass
class TrainingState:
    """
    What ``train()`` (or an evaluation run in between) changes on a model: parameters, optimizer state, the
    numpy and torch RNG states, the epoch counter, the training mode, the action distribution's cached
    parameters, the keep mask of the rollout buffer and the logger.

    Build it with :meth:`capture`; :meth:`restore` may be called any number of times.
    """

    policy: dict[str, th.Tensor]
    optimizer: dict[str, Any]
    training: bool
    n_updates: int
    keep: np.ndarray | None
    numpy_rng: Any
    torch_rng: th.Tensor
    distribution: dict[str, Any]
    logger: Any

    @classmethod
    def capture(cls, model: Any) -> "TrainingState":
        """
        Copy the training state of ``model`` (deep copies: later updates do not change it).

        :param model: An on-policy algorithm of this package.
        :return: The state.
        """
        buffer = getattr(model, "rollout_buffer", None)
        keep = getattr(buffer, "keep", None)
        return cls(
            policy=copy.deepcopy(model.policy.state_dict()),
            optimizer=copy.deepcopy(model.policy.optimizer.state_dict()),
            training=bool(model.policy.training),
            n_updates=sb3_compat.n_updates(model),
            keep=None if keep is None else np.array(keep, dtype=bool, copy=True),
            numpy_rng=np.random.get_state(),
            torch_rng=th.get_rng_state(),
            distribution=dict(vars(model.policy.action_dist)),
            logger=sb3_compat.model_logger(model),
        )

    def restore(self, model: Any, keep: bool = True) -> None:
        """
        Put the state back on ``model``.

        :param model: The model it was captured from.
        :param keep: Also restore the rollout buffer's keep mask.
        """
        model.policy.load_state_dict(self.policy)
        # load_state_dict copies tensors in, but keeps references to non-tensor values: hand it a copy
        model.policy.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        model.policy.set_training_mode(self.training)
        sb3_compat.set_n_updates(model, self.n_updates)
        if keep and self.keep is not None:
            model.rollout_buffer.keep[...] = self.keep
        np.random.set_state(self.numpy_rng)
        th.set_rng_state(self.torch_rng)
        vars(model.policy.action_dist).clear()
        vars(model.policy.action_dist).update(self.distribution)
        sb3_compat.set_model_logger(model, self.logger)


@contextmanager
def training_state(model: Any) -> Iterator[TrainingState]:
    """
    Run a block that may train, evaluate or score ``model``, then put its training state back as it was.

    :param model: The model.
    :return: The captured state (restore it inside the block to start again from it).
    """
    state = TrainingState.capture(model)
    try:
        yield state
    finally:
        state.restore(model)
