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
   :class:`StepInfo` (multi-checkpoint and optimizer-aware scoring subscribe there; nothing is patched);
   requests marked ``in_run`` are scored there, from the update's own forward and backward passes;
7. participants' ``after_update`` reads the in-run scores.

Participants are the callbacks of the current ``learn()`` call that implement :class:`RoundParticipant`; the
model finds them in the callback list it was given, so two models never share participants and a callback of
a ``learn()`` that raised never acts on a later one.
"""

import numbers
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
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
    :param clip_coef: The gradient-norm clipping factor ``min(1, max_grad_norm / ‖g‖)`` applied to this step.
    :param optimizer: The optimizer about to step.
    :param total_steps: The optimiser steps the round's update plans (``n_epochs`` × minibatches; fewer happen
        when ``target_kl`` stops it early).
    :param clip_range: The ratio clip ε of this update (``inf`` when the loss has none).
    """

    epoch: int
    step: int
    record_ids: np.ndarray
    samples: Any
    advantages: th.Tensor
    ratio: th.Tensor
    clip_coef: float
    optimizer: th.optim.Optimizer
    total_steps: int
    clip_range: float

    @cached_property
    def clipped(self) -> th.Tensor:
        """
        Per record, True where the clipped branch of the surrogate is active, so the record's policy gradient is
        zero at this step (computed when first read).
        """
        # min(A·r, A·clip(r)) takes the clipped branch, whose gradient is zero, above 1+ε for A > 0, below 1−ε for A < 0
        advantages, ratio, clip_range = self.advantages, self.ratio, self.clip_range
        return ((advantages > 0) & (ratio > 1 + clip_range)) | ((advantages < 0) & (ratio < 1 - clip_range))

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
        total_steps: int,
    ) -> "StepInfo":
        """
        The step's info from the quantities of the clipped surrogate loss.

        :param clip_range: The ratio clip ε (``inf`` for an unclipped loss such as A2C's).
        :param total_norm: The gradient norm ``clip_grad_norm_`` returned.
        :param max_grad_norm: Its ``max_norm``.
        :param total_steps: The optimiser steps the round's update plans.
        """
        advantages = advantages.detach()
        ratio = ratio.detach()
        # torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6), capped at 1
        clip_coef = min(1.0, max_grad_norm / (float(total_norm) + 1e-6))
        return cls(
            epoch,
            step,
            np.asarray(record_ids),
            samples,
            advantages,
            ratio,
            clip_coef,
            optimizer,
            total_steps,
            clip_range,
        )


class StepHook(Protocol):
    """A per-optimiser-step subscriber of the update: ``hook(info)``; it must not change parameters or ``.grad``."""

    def __call__(self, info: StepInfo) -> None: ...


@runtime_checkable
class CapturingStepHook(StepHook, Protocol):
    """
    A step hook that also watches the update's own forward and backward passes (in-run scoring): the update
    enters ``hook.capture(policy)`` around its whole loop, so the hook can register module hooks and remove them.
    """

    def capture(self, policy: Any) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class ScoreRequest:
    """
    One score a participant needs this round.

    :param target: The target f.
    :param checkpoints: ``"single"`` (at θ(k)) or ``"multi"`` (summed over the update's optimiser steps).
    :param optimizer_aware: Score through the optimiser that ran: ``True`` (in-run, see
        :mod:`sb3_influence.common.scoring.optimizer_aware`) or ``"unrolled"`` (through the whole update, see
        :mod:`sb3_influence.common.scoring.unrolled`); needs ``checkpoints="multi"``.
    :param in_run: Compute it during the round's real update (no replay), so it is ready only after the update:
        participants read it in ``after_update``. Only for optimizer-aware requests.
    :param n_orders: With ``optimizer_aware="unrolled"``: minibatch orders the derivative is averaged over.
    :param clip_smoothing: With ``optimizer_aware="unrolled"``: width of the softened ratio clip (0: PPO's own).
    """

    target: Target
    checkpoints: str = "single"
    optimizer_aware: bool | str = False
    in_run: bool = False
    n_orders: int = 1
    clip_smoothing: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer_aware", as_optimizer_aware(self.optimizer_aware))
        if self.checkpoints not in CHECKPOINTS:
            raise ValueError(f"checkpoints must be one of {CHECKPOINTS}, got {self.checkpoints!r}")
        if self.optimizer_aware and self.checkpoints != "multi":
            raise ValueError("optimizer_aware=True scores every optimiser step of the update: use checkpoints='multi'")
        if self.in_run and self.optimizer_aware is not True:
            raise ValueError("in_run=True is only for optimizer_aware=True requests (the unrolled score needs a replay)")
        check_unrolled_options(self.optimizer_aware, self.n_orders, self.clip_smoothing)

    @property
    def key(self) -> tuple[Any, ...]:
        """Requests with equal keys are scored once per round (in-run and replayed scores are the same numbers)."""
        options = (self.checkpoints, self.optimizer_aware, self.n_orders, self.clip_smoothing)
        try:
            hash(self.target)
        except TypeError:
            return (("id", id(self.target)), *options)
        return (("target", self.target), *options)


def as_optimizer_aware(optimizer_aware: Any) -> bool | str:
    """
    ``optimizer_aware`` as a scorer choice: ``False``, ``True`` or ``"unrolled"``, a numpy bool read as a bool.

    Only these: ``1`` or ``0`` would otherwise compare equal to ``True`` or ``False`` and pick a scorer by accident.

    :raises ValueError: naming the accepted values.
    """
    if isinstance(optimizer_aware, (bool, np.bool_)):
        return bool(optimizer_aware)
    if isinstance(optimizer_aware, str) and optimizer_aware == "unrolled":
        return "unrolled"
    raise ValueError(
        "optimizer_aware must be False (the paper's SGD proxy), True (in-run, through the optimiser) or "
        f"'unrolled' (through the whole update), got {optimizer_aware!r}"
    )


def check_unrolled_options(optimizer_aware: bool | str, n_orders: int, clip_smoothing: float) -> None:
    """``n_orders`` and ``clip_smoothing``: valid, and only with the unrolled scorer (``ValueError`` naming the fix)."""
    if isinstance(n_orders, bool) or not isinstance(n_orders, (int, np.integer)) or n_orders < 1:
        raise ValueError(f"n_orders must be an integer of at least 1 (minibatch orders averaged), got {n_orders!r}")
    if isinstance(clip_smoothing, bool) or not isinstance(clip_smoothing, numbers.Real) or not 0 <= clip_smoothing < np.inf:
        raise ValueError(f"clip_smoothing must be a float >= 0 (0: PPO's hard ratio clip), got {clip_smoothing!r}")
    if (n_orders != 1 or clip_smoothing) and optimizer_aware != "unrolled":
        raise ValueError(
            "n_orders and clip_smoothing change the unrolled scorer only: pass optimizer_aware='unrolled' "
            f"(got optimizer_aware={optimizer_aware!r})"
        )


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
    :param in_run: Requests to score during the real update (step 6), in the order first requested.
    :param participants_done: True once steps 3-5 ran.
    """

    index: int
    rollout_id: int
    num_timesteps: int
    first_permutation: np.ndarray
    start_state: TrainingState
    scores: dict[Any, np.ndarray] = field(default_factory=dict)
    drops: list[tuple[Any, np.ndarray]] = field(default_factory=list)
    in_run: list[ScoreRequest] = field(default_factory=list)
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

    def after_update(self, round_: InfluenceRound) -> None:
        """After the round's update (step 7): read in-run scores."""
        ...


@runtime_checkable
class InfluenceModel(Protocol):
    """What callbacks need from a model: an influence algorithm of this package (``InfluencePPO``...)."""

    def compute_influence(self, target: Any = "return", batch_size: Any = None, cache: bool = False) -> np.ndarray: ...

    def current_round(self) -> InfluenceRound: ...

    def check_optimizer_aware(self, optimizer_aware: Any) -> None: ...

    def drop_records(self, drop: np.ndarray, source: Any = None) -> int: ...
