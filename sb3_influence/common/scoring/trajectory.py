"""
Trajectory-level quantities of the round's training loss, built on the engine (no per-record gradient).

For the records' policy losses ``ℓ_i = −Â_i log π(a_i|s_i)`` (``Â_i`` as the update normalises them), a
trajectory t has the loss gradient ``g_t = Σ_{i∈t} ∇ℓ_i`` and the round's total gradient is ``G = Σ_t g_t``.

- ``⟨∇ℓ_i, G⟩`` is the engine's influence on :class:`LossTarget` (``f = Σ_j Â_j log π_j``, so ``∇f = −G``); summed
  over a trajectory's records it is ``⟨g_t, G⟩``.
- ``‖g_t‖²`` (:func:`trajectory_sq_norms`): one backward pass per trajectory (in chunks of records), accumulating
  ``g_t`` in one parameter-sized buffer: exact, and memory ``O(chunk + parameters)``.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th

from sb3_influence.common.scoring.engine import InfluenceEngine


@dataclass(eq=False)
class LossTarget:
    """
    ``f(θ) = Σ_j w_j log π_θ(a_j|s_j)`` over the buffer's own records (with their action masks). With ``w = Â``
    (the training advantages, flat by record id) ``∇f`` is minus the gradient of the round's total policy loss,
    and the influence of record i on f is ``⟨∇ℓ_i, G⟩``: its alignment with the round's consensus direction.

    :param weights: ``w_j``, flat by record id.
    :param name: Name used in logs.
    """

    weights: np.ndarray
    name: str = "loss"

    def terms(self, engine: Any, batch_size: int) -> Any:
        weights = np.asarray(self.weights, dtype=np.float64)
        for record_ids, observations, actions, _ in engine.buffer_batches(batch_size):
            log_prob = engine.log_prob(observations, actions, engine.action_masks(record_ids))
            yield (th.as_tensor(weights[record_ids], device=log_prob.device).to(log_prob.dtype) * log_prob).sum()

    def buffer_weights(self, engine: Any) -> np.ndarray:
        """``w``: f is a weighted sum of the buffer's log-probabilities (lets the engine fuse passes)."""
        return np.asarray(self.weights, dtype=np.float64)


def trajectory_sq_norms(
    engine: InfluenceEngine, advantages: np.ndarray, trajectory_ids: np.ndarray, batch_size: int
) -> np.ndarray:
    """
    ``‖g_t‖²`` for every trajectory, ``g_t = −Σ_{i∈t} Â_i ∇θ log π(a_i|s_i)``, at the current parameters, in
    eval mode (records do not interact), over every parameter that requires a gradient.

    :param engine: The model's scoring engine.
    :param advantages: ``Â_i``, flat by record id.
    :param trajectory_ids: The trajectory of every record (``rollout_buffer.trajectory_ids()``), non-decreasing.
    :param batch_size: Records per forward pass.
    :return: Float64 array indexed by trajectory id.
    """
    trajectory_ids = np.asarray(trajectory_ids)
    if np.any(np.diff(trajectory_ids) < 0):
        raise ValueError("trajectory_ids must be non-decreasing in record-id order (rollout_buffer.trajectory_ids())")
    n_trajectories = int(trajectory_ids.max(initial=-1)) + 1
    bounds = np.searchsorted(trajectory_ids, np.arange(n_trajectories + 1))
    advantages = np.asarray(advantages, dtype=np.float64)
    params = [param for param in engine.policy.parameters() if param.requires_grad]
    norms = np.zeros(n_trajectories, dtype=np.float64)
    with engine.eval_mode():
        for trajectory in range(n_trajectories):
            records = np.arange(bounds[trajectory], bounds[trajectory + 1])
            total = [th.zeros_like(param) for param in params]
            for chunk_ids, obs, actions, _ in engine.buffer_batches(batch_size, records):
                log_prob = engine.log_prob(obs, actions, engine.action_masks(chunk_ids))
                weights = th.as_tensor(advantages[chunk_ids], device=log_prob.device).to(log_prob.dtype)
                grads = th.autograd.grad(-(weights * log_prob).sum(), params, allow_unused=True)
                total = [acc if grad is None else acc + grad for acc, grad in zip(total, grads, strict=True)]
            norms[trajectory] = float(sum(float((grad.double() ** 2).sum()) for grad in total))
    return norms
