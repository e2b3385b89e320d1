"""
What every influence algorithm of this package shares: the round, scoring at θ(k), filtering and the engine.

:class:`InfluenceAlgorithm` is a mixin for SB3 on-policy algorithms (``class InfluencePPO(InfluenceAlgorithm,
PPO)``). It owns the round (see :mod:`sb3_influence.common.round`) and ``compute_influence``; the algorithm
class keeps what is its own, as SB3 does: its hyperparameters and its update loop, exposed as
``update(step_hooks)``, which must walk only the kept records (``rollout_buffer.kept_minibatches``), use the
round's first permutation for its first epoch and call the step hooks after ``backward()`` and gradient clipping.
"""

import uuid
import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.base_class import maybe_make_env
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback
from stable_baselines3.common.vec_env import VecEnv

from sb3_influence.common import sb3_compat
from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer, InfluenceRolloutBufferMixin
from sb3_influence.common.round import (
    CHECKPOINTS,
    InfluenceRound,
    RoundParticipant,
    ScoreRequest,
    StepHook,
    as_optimizer_aware,
    check_unrolled_options,
)
from sb3_influence.common.scoring import ENGINE_MODES, InfluenceEngine, LayerScorer
from sb3_influence.common.scoring.multi import MultiCheckpointScorer
from sb3_influence.common.scoring.optimizer_aware import OptimizerAwareScorer
from sb3_influence.common.scoring.unrolled import unrolled_influence
from sb3_influence.common.state import TrainingState, training_state
from sb3_influence.common.targets import Target, as_target
from sb3_influence.common.units import check_unit, trajectory_sums

SelfInfluenceAlgorithm = TypeVar("SelfInfluenceAlgorithm", bound="InfluenceAlgorithm")

_SUPPORTED_ACTION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_SUPPORTED_OBSERVATION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class InfluenceAlgorithm:
    """
    The round machinery shared by ``InfluencePPO`` and the other influence algorithms (a mixin placed before
    the SB3 algorithm class). Subclasses call :meth:`_init_influence` at the start of ``__init__`` and implement
    :meth:`update`.
    """

    # Whether ``optimizer_aware="unrolled"`` can replay this algorithm's update (PPO's clipped-surrogate loop can)
    unrolled_update: bool = False

    # Provided by the SB3 algorithm the mixin is combined with
    policy: Any
    rollout_buffer: InfluenceRolloutBuffer | InfluenceDictRolloutBuffer
    rollout_buffer_class: Any
    observation_space: spaces.Space
    num_timesteps: int
    normalize_advantage: bool
    logger: Any
    _influence_engine: InfluenceEngine
    n_rounds: int
    last_round: InfluenceRound | None
    _participants: tuple[RoundParticipant, ...]

    def _init_influence(
        self,
        env: GymEnv | str | None,
        verbose: int,
        influence_batch_size: int,
        influence_method: str,
        influence_layer_scorers: Sequence[LayerScorer] | None,
        rollout_buffer_class: type[RolloutBuffer] | None,
    ) -> Any:
        """
        Validate and store the influence arguments; make the env to check its spaces.

        :return: The env, made (as ``BaseAlgorithm`` would make it) when given as a string.
        """
        if isinstance(influence_batch_size, bool) or not isinstance(influence_batch_size, (int, np.integer)):
            raise TypeError(f"influence_batch_size must be a positive int, got {influence_batch_size!r}")
        if influence_batch_size < 1:
            raise ValueError(
                f"influence_batch_size must be a positive int (records per scoring chunk), got {influence_batch_size}"
            )
        if influence_method not in ENGINE_MODES:
            raise ValueError(f"influence_method must be one of {ENGINE_MODES}, got {influence_method!r}")
        if rollout_buffer_class is not None and not issubclass(rollout_buffer_class, InfluenceRolloutBufferMixin):
            raise TypeError(
                f"rollout_buffer_class must be InfluenceRolloutBuffer, InfluenceDictRolloutBuffer or a subclass, "
                f"got {rollout_buffer_class.__name__}. Leave it as None to pick the right one automatically."
            )
        self.influence_batch_size = int(influence_batch_size)
        self.influence_method = influence_method
        self.influence_layer_scorers = None if influence_layer_scorers is None else tuple(influence_layer_scorers)
        self.n_rounds = 0
        # The run's identity, saved with the model: its snapshots carry it, so runs are never mixed up
        self.run_id = uuid.uuid4().hex
        if env is not None:
            # Make the env here (as BaseAlgorithm would) to reject unsupported spaces with a clear error
            env = maybe_make_env(env, verbose)
            _check_action_space(env.action_space, type(self).__name__)
            _check_observation_space(env.observation_space, type(self).__name__)
        return env

    def _setup_model(self) -> None:
        _check_observation_space(self.observation_space, type(self).__name__)
        if self.rollout_buffer_class is None:
            if isinstance(self.observation_space, spaces.Dict):
                self.rollout_buffer_class = InfluenceDictRolloutBuffer
            else:
                self.rollout_buffer_class = InfluenceRolloutBuffer
        super()._setup_model()  # type: ignore[misc]
        self._influence_engine = InfluenceEngine(
            self.policy, self.rollout_buffer, method=self.influence_method, layer_scorers=self.influence_layer_scorers
        )
        self.last_round: InfluenceRound | None = None
        self._participants: tuple[RoundParticipant, ...] = ()

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_influence_engine", "last_round", "_participants"]  # type: ignore[misc]

    @property
    def influence_engine(self) -> InfluenceEngine:
        """The engine that scores this model's rollout buffer (rebuilt by ``_setup_model``)."""
        return self._influence_engine

    # ------------------------------------------------------------------ the round
    def _setup_learn(
        self,
        total_timesteps: int,
        callback: MaybeCallback = None,
        reset_num_timesteps: bool = True,
        tb_log_name: str = "run",
        progress_bar: bool = False,
    ) -> tuple[int, BaseCallback]:
        total_timesteps, callback_list = super()._setup_learn(  # type: ignore[misc]
            total_timesteps, callback, reset_num_timesteps, tb_log_name, progress_bar
        )
        # This learn() call's round participants: the influence callbacks of its callback list, in the order given
        self._participants = tuple(_round_participants(callback_list))
        return total_timesteps, callback_list

    def learn(
        self: SelfInfluenceAlgorithm,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str | None = None,
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
        **kwargs: Any,
    ) -> SelfInfluenceAlgorithm:
        try:
            return super().learn(  # type: ignore[misc]
                total_timesteps=total_timesteps,
                callback=callback,
                log_interval=log_interval,
                tb_log_name=tb_log_name or type(self).__name__,
                reset_num_timesteps=reset_num_timesteps,
                progress_bar=progress_bar,
                # The SB3 algorithm's own learn() arguments (MaskablePPO's use_masking)
                **kwargs,
            )
        finally:
            # Participants belong to one learn() call, even one that raised
            self._participants = ()

    def collect_rollouts(
        self, env: VecEnv, callback: BaseCallback, rollout_buffer: RolloutBuffer, n_rollout_steps: int, *args: Any
    ) -> bool:
        """
        Collect a rollout as the SB3 algorithm does (``args``: its own extra arguments, such as MaskablePPO's
        ``use_masking``), then run the round (scores, filters, observers) before the update.
        """
        try:
            collected = super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps, *args)  # type: ignore[misc]
        except ValueError as error:
            self._explain_invalid_values(error, f"during the rollout of round {self.n_rounds}")
            raise
        if not collected:
            return False
        # learn() does this right after the rollout: schedules evaluated in the round see the right progress
        sb3_compat.update_progress_remaining(self)
        self.run_round()
        return True

    def current_round(self) -> InfluenceRound:
        """
        The round of the rollout the buffer holds, opened on first use: it takes the next round index, draws
        the first epoch's minibatch order and captures the training state at θ(k).

        :return: The round.
        """
        buffer = self.rollout_buffer
        if buffer is None or not buffer.full:
            raise RuntimeError(
                "No round: the rollout buffer is not full. Collect a rollout first (learn(), or call this from a "
                "callback's _on_rollout_end)."
            )
        if self.last_round is None or self.last_round.rollout_id != buffer.rollout_id:
            # Every consumer of the round (scores, filters, snapshots, the update) passes here once per rollout
            self._check_finite_round(self.n_rounds)
            permutation = buffer.first_epoch_permutation()
            self.last_round = InfluenceRound(
                index=self.n_rounds,
                rollout_id=buffer.rollout_id,
                num_timesteps=self.num_timesteps,
                first_permutation=permutation,
                start_state=TrainingState.capture(self),
            )
            self.n_rounds += 1
        return self.last_round

    def run_round(self) -> InfluenceRound:
        """
        Steps 3 to 5 of the round, once per rollout: score every request of the participants once, let the
        filters drop records in the order given, then notify the observers.

        :return: The round.
        """
        round_ = self.current_round()
        if round_.participants_done:
            return round_
        round_.participants_done = True
        for participant in self._participants:
            for request in participant.score_requests(round_):
                if request.in_run:
                    if all(request.key != other.key for other in round_.in_run):
                        round_.in_run.append(request)
                else:
                    self._score_request(request, round_)
        for participant in self._participants:
            if participant.round_role == "filter":
                participant.on_round(round_)
        for participant in self._participants:
            if participant.round_role == "observer":
                participant.on_round(round_)
        return round_

    def drop_records(self, drop: np.ndarray, source: Any = None) -> int:
        """
        Clear records from this round's keep mask (what filters call).

        :param drop: Boolean array of shape ``(n_steps, n_envs)``, True for the records to drop.
        :param source: Who drops them and how (JSON-serialisable; recorded in ``current_round().drops`` and in
            snapshot metadata).
        :return: How many records this call dropped that were still kept.
        """
        round_ = self.current_round()
        keep = self.rollout_buffer.keep
        drop = np.asarray(drop)
        if drop.dtype != bool or drop.shape != keep.shape:
            raise ValueError(
                f"drop must be a boolean array of shape (n_steps, n_envs) = {keep.shape}, got {drop.dtype} {drop.shape}"
            )
        newly = int(np.count_nonzero(keep & drop))
        keep &= ~drop
        round_.drops.append((source, drop.copy()))
        return newly

    # ------------------------------------------------------------------ influence
    def training_batch_size(self) -> int:
        """Records per minibatch of the update (advantages are normalised per minibatch)."""
        return int(self.batch_size)  # type: ignore[attr-defined]

    def training_advantages(self) -> np.ndarray:
        """
        The advantages ``Â_i`` as the update's first epoch sees them: normalised with the mean and std of the
        record's minibatch when ``normalize_advantage=True`` (the kept records' minibatches once records were
        dropped), raw otherwise.

        :return: Array of shape ``(n_steps, n_envs)``.
        """
        return self.rollout_buffer.to_records(self._flat_training_advantages(self.current_round()))

    def _flat_training_advantages(self, round_: InfluenceRound) -> np.ndarray:
        buffer = self.rollout_buffer
        dtype = self._influence_engine.dtype
        raw = th.as_tensor(buffer.flat_field("advantages")).to(dtype)
        if not self.normalize_advantage:
            return raw.numpy().astype(np.float64)
        normalized = raw.clone()
        # Unfiltered layout for every record, then the layout of the kept records (what the update will see)
        layouts = [np.ones(buffer.n_records, dtype=bool)]
        if not buffer.flat_keep.all():
            layouts.append(buffer.flat_keep)
        for keep in layouts:
            order = round_.first_permutation[keep[round_.first_permutation]]
            batch_size = self.training_batch_size()
            for start in range(0, len(order), batch_size):
                ids = th.as_tensor(order[start : start + batch_size])
                advantages = raw[ids]
                # Same expression and guard as the update
                if len(advantages) > 1:
                    normalized[ids] = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                else:
                    normalized[ids] = advantages
        return normalized.numpy().astype(np.float64)

    def check_optimizer_aware(self, optimizer_aware: Any) -> None:
        """
        Raise ``ValueError`` when this algorithm cannot compute the asked optimizer-aware score.

        :param optimizer_aware: ``False``, ``True`` or ``"unrolled"``.
        """
        if optimizer_aware == "unrolled" and not self.unrolled_update:
            raise ValueError(
                f"optimizer_aware='unrolled' replays PPO's clipped-surrogate update, which {type(self).__name__} does not "
                "run; use optimizer_aware=True (the in-run optimizer-aware score) instead"
            )

    def compute_influence(
        self,
        target: str | Target = "return",
        batch_size: int | None = None,
        cache: bool = False,
        checkpoints: str | None = None,
        optimizer_aware: bool | str = False,
        target_gradient: str = "fixed",
        unit: str = "record",
        n_orders: int = 1,
        clip_smoothing: float = 0.0,
    ) -> np.ndarray:
        """
        Influence of every record of the round the buffer holds on ``target``:
        ``I_i = −⟨∇θ ℓ_i, ∇θ f⟩`` with ``ℓ_i = −Â_i log π(a_i|s_i)`` (the paper's Sec. 3). Positive: the
        record's update moves f up (helpful); negative: harmful.

        Always at θ(k), the parameters the round started from: called after ``learn()`` (the update already
        ran) it scores the last round at its θ(k), which the round keeps, and draws nothing from any RNG.

        :param target: ``"return"``, :class:`~sb3_influence.ReturnTarget`, :class:`~sb3_influence.ActionTarget`
            or any object implementing the :class:`~sb3_influence.Target` protocol.
        :param batch_size: Records per chunk (default: ``influence_batch_size``); scores do not depend on it.
        :param cache: Reuse the scores already computed for this target in this round (shared with the
            round's participants). Only targets that compare equal (such as ``"return"``) or the same target
            object hit the cache.
        :param checkpoints: ``"single"``: at θ(k) (what IIF uses). ``"multi"``: the paper's formal definition
            (Sec. 3.1, TracIn-style): the sum over every optimiser step j of the round's update whose minibatch
            holds record i of ``−⟨∇ℓ_i(θ_j), ∇f(θ_j)⟩``, with Â_i normalised in that minibatch. It replays the
            update from θ(k) with the kept records (same minibatches, same RNG) and restores the training state
            afterwards. About as costly as ``train()`` plus one target gradient per optimiser step. Default:
            ``"multi"`` when ``optimizer_aware``, else ``"single"``.
        :param optimizer_aware: Score each record through the optimiser that actually ran: its actual PPO loss
            gradient at every step (ratio, clip mask, value and entropy terms), the gradient-norm clip and the
            optimizer's update map (Adam/AdamW with bias correction and momentum, SGD with momentum, RMSprop); see
            :mod:`sb3_influence.common.scoring.optimizer_aware`. Replays the update like ``"multi"``.
            ``"unrolled"``: differentiate the whole update instead (a hypergradient: curvature between steps
            included, the most faithful under Adam, about 5x the update's cost; see
            :mod:`sb3_influence.common.scoring.unrolled`).
        :param target_gradient: With ``optimizer_aware``: ``"fixed"`` (∇f at θ(k), one target gradient) or
            ``"step"`` (∇f at every θ_j).
        :param unit: ``"record"``: one score per record. ``"trajectory"``: one score per trajectory of the buffer
            (see :mod:`sb3_influence.common.units`), the sum of its records' scores; map them back to the records
            with ``rollout_buffer.trajectory_ids()`` (``scores[model.rollout_buffer.trajectory_ids()]`` is flat by
            record id).
        :param n_orders: With ``optimizer_aware="unrolled"``: average the derivative over this many minibatch orders,
            the real update's first (see :func:`~sb3_influence.common.scoring.unrolled.unrolled_influence`); costs
            ``n_orders`` replays.
        :param clip_smoothing: With ``optimizer_aware="unrolled"``: soften PPO's ratio clip in the replay to a softplus
            of this width (3e-2 with ``n_orders=4`` predicted removals best under SB3's Adam, see
            ``docs/faithfulness.md``); 0: the exact derivative.
        :return: Float64 array of shape ``(n_steps, n_envs)``; ``[step, env]`` is the record at that position. With
            ``unit="trajectory"``: shape ``(n_trajectories,)``, indexed by trajectory id.
        """
        check_unit(unit, "compute_influence")
        optimizer_aware = as_optimizer_aware(optimizer_aware)
        check_unrolled_options(optimizer_aware, n_orders, clip_smoothing)
        if unit == "trajectory":
            records = self.compute_influence(
                target, batch_size, cache, checkpoints, optimizer_aware, target_gradient, "record", n_orders, clip_smoothing
            )
            return trajectory_sums(self.rollout_buffer.to_flat(records), self.rollout_buffer.trajectory_ids())
        if self.rollout_buffer is None or not self.rollout_buffer.full:
            raise RuntimeError(
                "compute_influence() needs a full rollout buffer: call it from a callback's _on_rollout_end, "
                "or after learn() has collected at least one rollout."
            )
        if batch_size is None:
            batch_size = self.influence_batch_size
        elif isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (records per scoring chunk), got {batch_size!r}")
        if checkpoints is None:
            checkpoints = "multi" if optimizer_aware else "single"
        if checkpoints not in CHECKPOINTS:
            raise ValueError(f"checkpoints must be one of {CHECKPOINTS}, got {checkpoints!r}")
        if target_gradient not in ("fixed", "step"):
            raise ValueError(f"target_gradient must be 'fixed' or 'step', got {target_gradient!r}")
        self.check_optimizer_aware(optimizer_aware)
        request = ScoreRequest(
            as_target(target), checkpoints, optimizer_aware, n_orders=int(n_orders), clip_smoothing=float(clip_smoothing)
        )
        if target_gradient == "step":
            # Not cached with the fixed-gradient scores: a different quantity
            return self._compute(request, self.current_round(), int(batch_size), target_gradient)
        round_ = self.current_round()
        if cache and request.key in round_.scores:
            return round_.scores[request.key].copy()
        scores = self._compute(request, round_, int(batch_size))
        if cache:
            round_.scores[request.key] = scores.copy()
        return scores

    def _score_request(self, request: ScoreRequest, round_: InfluenceRound) -> np.ndarray:
        """A participant's request, computed once per round."""
        if request.key not in round_.scores:
            round_.scores[request.key] = self._compute(request, round_, self.influence_batch_size)
        return round_.scores[request.key]

    def _compute(
        self, request: ScoreRequest, round_: InfluenceRound, batch_size: int, target_gradient: str = "fixed"
    ) -> np.ndarray:
        moved = sb3_compat.n_updates(self) != round_.start_state.n_updates
        if request.checkpoints == "single" and not moved:
            flat = self._influence_engine.influence(request.target, self._flat_training_advantages(round_), batch_size)
            return self.rollout_buffer.to_records(flat)
        if request.checkpoints == "single":
            with training_state(self):
                # From θ(k), whatever happened since; everything is put back afterwards
                round_.start_state.restore(self, keep=False)
                flat = self._influence_engine.influence(request.target, self._flat_training_advantages(round_), batch_size)
            return self.rollout_buffer.to_records(flat)
        if request.optimizer_aware == "unrolled":
            flat = unrolled_influence(self, request.target, batch_size, request.n_orders, request.clip_smoothing)
            return self.rollout_buffer.to_records(flat)
        scorer = self._multi_step_scorer(request, batch_size, target_gradient)
        self.replay_update([scorer])
        return self.rollout_buffer.to_records(scorer.scores)

    def replay_update(self, step_hooks: Sequence[StepHook]) -> None:
        """
        Run the current round's update again from θ(k) (the round's captured training state: parameters,
        optimizer, RNG) on the kept records, with ``step_hooks``; then put the model's training state back as it
        was. Multi-checkpoint and optimizer-aware scores use it when they are needed before (or without) the update.

        :param step_hooks: Per-optimiser-step subscribers.
        """
        round_ = self.current_round()
        with training_state(self):
            round_.start_state.restore(self, keep=False)
            sb3_compat.set_model_logger(self, Logger(folder=None, output_formats=[]))
            if self.rollout_buffer.flat_keep.any():
                self.update(step_hooks=step_hooks)

    def _multi_step_scorer(
        self, request: ScoreRequest, batch_size: int, target_gradient: str = "fixed"
    ) -> MultiCheckpointScorer | OptimizerAwareScorer:
        if request.optimizer_aware:
            return OptimizerAwareScorer(self, request.target, batch_size, target_gradient=target_gradient)
        return MultiCheckpointScorer(self._influence_engine, request.target, batch_size)

    # ------------------------------------------------------------------ training
    def train(self) -> None:
        """
        The round's update: run the round if nothing ran it yet (scores, filters, observers), then
        :meth:`update` on the kept records, scoring the round's in-run requests on the way, then the
        participants' ``after_update``. With every record dropped the update is skipped with a warning.
        """
        round_ = self.run_round()
        n_kept = int(self.rollout_buffer.flat_keep.sum())
        self.logger.record("train/n_kept_records", n_kept)
        scorers = [self._multi_step_scorer(request, self.influence_batch_size) for request in round_.in_run]
        if n_kept == 0:
            warnings.warn(
                "Every record of this rollout was dropped (rollout_buffer.keep is all False): skipping this PPO "
                "update. Drop fewer records (e.g. a smaller IIFCallback fraction) to keep learning.",
                UserWarning,
            )
        else:
            index = round_.index
            try:
                self.update(step_hooks=scorers)
            except ValueError as error:
                self._explain_invalid_values(error, f"during the update of round {index}: it made them so")
                raise
            self._check_finite_parameters(f"after the update of round {index}: it made them so")
        for request, scorer in zip(round_.in_run, scorers, strict=True):
            round_.scores.setdefault(request.key, self.rollout_buffer.to_records(scorer.scores))
        for participant in self._participants:
            participant.after_update(round_)

    def _check_finite_round(self, index: int) -> None:
        """
        Refuse a round whose data or parameters θ(k) are not finite (NaN or inf), before anything uses them.

        :param index: The round about to open.
        """
        buffer = self.rollout_buffer
        bad: dict[str, np.ndarray] = {}
        for name in ("rewards", "advantages", "returns", "observations"):
            value = getattr(buffer, name)
            # Checked in place (no copy of the observations): SB3 flattens every field but these two in get()
            flat = buffer.generator_ready and name not in ("rewards", "episode_starts")
            for key, array in value.items() if isinstance(value, dict) else [(None, value)]:
                if not np.issubdtype(array.dtype, np.floating):  # integer observations (images) are finite
                    continue
                if flat:
                    mask = ~np.isfinite(array).reshape(buffer.n_records, -1).all(axis=1)
                else:
                    mask = buffer.to_flat(~np.isfinite(array).reshape(buffer.buffer_size, buffer.n_envs, -1).all(axis=2))
                bad[name if key is None else f"{name}[{key!r}]"] = mask
        counts = {name: int(np.count_nonzero(mask)) for name, mask in bad.items() if mask.any()}
        if counts:
            n_bad = int(np.count_nonzero(np.any(list(bad.values()), axis=0)))
            details = ", ".join(f"{name}: {count}" for name, count in counts.items())
            raise ValueError(
                f"Round {index}: {n_bad} of {buffer.n_records} records hold NaN or inf values ({details}); they cannot "
                "be scored nor trained on. Likely cause: the env returned NaN/inf rewards or observations (wrap it in "
                "stable_baselines3.common.vec_env.VecCheckNan(env, raise_exception=True) to find the step), or rewards "
                "so large that the returns overflow (scale them, e.g. VecNormalize)."
            )
        self._check_finite_parameters(f"at the start of round {index} (θ(k), as loaded or set)")

    def _explain_invalid_values(self, error: ValueError, when: str) -> None:
        """
        Turn torch's "found invalid values" (a NaN action distribution) into an error that says where the NaN came
        from; other errors are left alone.
        """
        if "found invalid values" not in str(error):
            return
        self._check_finite_parameters(when)
        raise ValueError(
            f"Round {self.n_rounds}: the policy's action distribution is NaN or inf {when}, with finite parameters: the "
            "env returned a NaN or inf observation. Wrap it in stable_baselines3.common.vec_env.VecCheckNan(env, "
            "raise_exception=True) to find the step, or fix the observation (e.g. VecNormalize's clip_obs)."
        ) from error

    def _check_finite_parameters(self, when: str) -> None:
        """
        Raise when the policy's parameters are not finite.

        :param when: When they were found so (named in the message).
        """
        bad = [name for name, parameter in self.policy.named_parameters() if not bool(th.isfinite(parameter).all())]
        if not bad:
            return
        raise ValueError(
            f"The policy's parameters are NaN or inf {when} ({len(bad)} tensor(s): {', '.join(bad[:5])}). The update "
            "diverged: lower the learning rate or max_grad_norm, check the rewards' scale (VecNormalize) and the "
            "observations (VecCheckNan), or resume from an earlier checkpoint."
        )

    def update(self, step_hooks: Sequence[StepHook] = ()) -> None:
        """
        The algorithm's update on the kept records of the current round (see the module docstring).

        :param step_hooks: Per-optimiser-step subscribers.
        """
        raise NotImplementedError


def _round_participants(callback: BaseCallback) -> list[RoundParticipant]:
    """The round participants of a callback tree, depth first in the order given (only CallbackList is walked)."""
    if isinstance(callback, CallbackList):
        return [participant for child in callback.callbacks for participant in _round_participants(child)]
    return [callback] if isinstance(callback, RoundParticipant) else []


def _check_action_space(space: spaces.Space, algo: str) -> None:
    if not isinstance(space, _SUPPORTED_ACTION_SPACES):
        raise ValueError(f"{algo} does not support the action space {space}: use Box, Discrete, MultiDiscrete or MultiBinary")


def _check_observation_space(space: spaces.Space, algo: str) -> None:
    if isinstance(space, spaces.Dict):
        for key, subspace in space.spaces.items():
            if not isinstance(subspace, _SUPPORTED_OBSERVATION_SPACES):
                raise ValueError(
                    f"{algo} does not support the observation space {subspace} under Dict key {key!r}: "
                    f"use one of {[s.__name__ for s in _SUPPORTED_OBSERVATION_SPACES]} (nested Dict/Tuple spaces: flatten "
                    "them with a wrapper first)"
                )
        return
    if not isinstance(space, _SUPPORTED_OBSERVATION_SPACES):
        raise ValueError(
            f"{algo} does not support the observation space {space}: use Box, Discrete, MultiDiscrete, "
            "MultiBinary or Dict (flatten Tuple/Sequence/Graph spaces with a wrapper first)"
        )
