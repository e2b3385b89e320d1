"""
The influence round, made explicit.

Round k of an influence algorithm goes, in this order and once per rollout:

1. the rollout buffer B(k) is full (rollout, then GAE) and the parameters are θ(k);
2. :class:`InfluenceRound` is opened: it takes its index from the model's round counter, draws the first
   epoch's minibatch order (from numpy's global RNG, exactly where PPO would draw it) and captures the
   training state at θ(k);
3. every score the round's participants request is computed once, on the unfiltered buffer at θ(k);
4. the *filters* (``IIFCallback``...) clear records from the keep mask, in the order they were given;
5. the *observers* (``AttributionCallback``, the analysis callbacks) read the scores and the final mask;
6. the update runs on the kept records. At every optimiser step it calls the step hooks it was given with a
   :class:`StepInfo` (multi-checkpoint scoring subscribes there; nothing is patched).

Participants are the callbacks of the current ``learn()`` call that implement :class:`RoundParticipant`; the
model finds them in the callback list it was given, so two models never share participants and a callback of
a ``learn()`` that raised never acts on a later one.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch as th

from sb3_influence.common.state import TrainingState
from sb3_influence.common.targets import Target

CHECKPOINTS = ("single", "multi")


@dataclass(frozen=True)
class StepInfo:
    """
    What the update hands to each step hook, after ``backward()`` and gradient clipping and before
    ``optimizer.step()``: the parameters are still θ_j.

    :param epoch: The epoch (0-based).
    :param step: The optimiser step within the round (0-based).
    :param record_ids: Flat record ids of the minibatch (``env · n_steps + step``), in minibatch order.
    :param samples: The minibatch as SB3's samples tuple (observations, actions, old values, ...).
    :param advantages: ``Â`` as the loss used them (normalised in the minibatch when ``normalize_advantage``).
    :param ratio: ``π_θj(a|s) / π_old(a|s)`` per record (detached).
    :param clipped: Per record, True where the clipped branch of the surrogate is active, so the record's policy
        gradient is zero at this step.
    :param clip_coef: The gradient-norm clipping factor ``min(1, max_grad_norm / ‖g‖)`` applied to this step.
    :param optimizer: The optimizer about to step.
    """

    epoch: int
    step: int
    record_ids: np.ndarray
    samples: Any
    advantages: th.Tensor
    ratio: th.Tensor
    clipped: th.Tensor
    clip_coef: float
    optimizer: th.optim.Optimizer

    @classmethod
    def from_loss(
        cls,
        epoch: int,
        step: int,
        record_ids: np.ndarray,
        samples: Any,
        advantages: th.Tensor,
        ratio: th.Tensor,
        clip_range: float,
        total_norm: th.Tensor,
        max_grad_norm: float,
        optimizer: th.optim.Optimizer,
    ) -> "StepInfo":
        """
        The step's info from the quantities of the clipped surrogate loss.

        :param clip_range: The ratio clip ε (``inf`` for an unclipped loss such as A2C's).
        :param total_norm: The gradient norm ``clip_grad_norm_`` returned.
        :param max_grad_norm: Its ``max_norm``.
        """
        advantages = advantages.detach()
        ratio = ratio.detach()
        # min(A·r, A·clip(r)) takes the clipped branch, whose gradient is zero, above 1+ε for A > 0, below 1−ε for A < 0
        clipped = ((advantages > 0) & (ratio > 1 + clip_range)) | ((advantages < 0) & (ratio < 1 - clip_range))
        # torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6), capped at 1
        clip_coef = min(1.0, max_grad_norm / (float(total_norm) + 1e-6))
        return cls(epoch, step, np.asarray(record_ids), samples, advantages, ratio, clipped, clip_coef, optimizer)


class StepHook(Protocol):
    """A per-optimiser-step subscriber of the update: ``hook(info)``; it must not change parameters or ``.grad``."""

    def __call__(self, info: StepInfo) -> None: ...


@dataclass(frozen=True)
class ScoreRequest:
    """
    One score a participant needs this round.

    :param target: The target f.
    :param checkpoints: ``"single"`` (at θ(k)) or ``"multi"`` (summed over the update's optimiser steps).
    """

    target: Target
    checkpoints: str = "single"

    @property
    def key(self) -> tuple[Any, str]:
        """Requests with equal keys are scored once per round."""
        try:
            hash(self.target)
        except TypeError:
            return (("id", id(self.target)), self.checkpoints)
        return (("target", self.target), self.checkpoints)


@dataclass
class InfluenceRound:
    """
    One round of an influence algorithm: the rollout it belongs to, θ(k) and what the participants did.

    :param index: The round number (0 for the model's first rollout); it never restarts, whatever
        ``reset_num_timesteps`` is, and is the ``round`` of snapshots and DataFrames.
    :param rollout_id: Identity of the rollout buffer's content the round belongs to.
    :param num_timesteps: ``model.num_timesteps`` when the round opened.
    :param first_permutation: The first epoch's record order (flat record ids, dropped records included).
    :param start_state: The training state at θ(k).
    :param scores: Scores computed this round, by :attr:`ScoreRequest.key`, shape ``(n_steps, n_envs)``.
    :param drops: ``(source, drop mask)`` in the order the filters acted (``source`` describes the filter).
    :param participants_done: True once steps 3-5 ran.
    """

    index: int
    rollout_id: int
    num_timesteps: int
    first_permutation: np.ndarray
    start_state: TrainingState
    scores: dict[Any, np.ndarray] = field(default_factory=dict)
    drops: list[tuple[Any, np.ndarray]] = field(default_factory=list)
    participants_done: bool = False

    def score(self, request: ScoreRequest) -> np.ndarray:
        """
        The scores of a request already computed this round.

        :param request: The request.
        :return: Array of shape ``(n_steps, n_envs)``.
        """
        if request.key not in self.scores:
            raise KeyError(f"{request} was not scored in round {self.index}: request it from score_requests()")
        return self.scores[request.key]


@runtime_checkable
class RoundParticipant(Protocol):
    """
    A callback that takes part in the round. ``round_role`` is ``"filter"`` (acts on the keep mask, step 4) or
    ``"observer"`` (reads the scores and the final mask, step 5).
    """

    round_role: Literal["filter", "observer"]

    def score_requests(self, round_: InfluenceRound) -> Sequence[ScoreRequest]:
        """The scores this participant needs in this round (may be empty)."""
        ...

    def on_round(self, round_: InfluenceRound) -> None:
        """Act on the round: filters call ``model.drop_records``; observers log, save or analyse."""
        ...


@runtime_checkable
class InfluenceModel(Protocol):
    """What callbacks need from a model: an influence algorithm of this package (``InfluencePPO``...)."""

    def compute_influence(self, target: Any = "return", batch_size: Any = None, cache: bool = False) -> np.ndarray: ...

    def current_round(self) -> InfluenceRound: ...

    def drop_records(self, drop: np.ndarray, source: Any = None) -> int: ...
