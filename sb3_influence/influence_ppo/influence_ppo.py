import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.base_class import maybe_make_env
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy, BasePolicy, MultiInputActorCriticPolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from stable_baselines3.common.vec_env import VecEnv
from torch.nn import functional as F

from sb3_influence.common import sb3_compat
from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer, InfluenceRolloutBufferMixin
from sb3_influence.common.round import CHECKPOINTS, InfluenceRound, RoundParticipant, ScoreRequest, StepHook, StepInfo
from sb3_influence.common.scoring import ENGINE_MODES, InfluenceEngine, LayerScorer
from sb3_influence.common.scoring.multi import MultiCheckpointScorer
from sb3_influence.common.state import TrainingState, training_state
from sb3_influence.common.targets import Target, as_target

SelfInfluencePPO = TypeVar("SelfInfluencePPO", bound="InfluencePPO")

_SUPPORTED_ACTION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_SUPPORTED_OBSERVATION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class InfluencePPO(PPO):
    """
    PPO whose rollout records can be scored by their influence on a target and dropped before the update
    (Hu et al., "A Snapshot of Influence", NeurIPS 2025, arXiv 2505.19281).

    A drop-in replacement for ``PPO``: with no record dropped it trains bit-identically to ``PPO`` with the
    same seed. It owns its update loop (:meth:`update`, a line-by-line twin of ``PPO.train`` that walks only the
    kept records and calls per-optimiser-step hooks) and makes each round explicit
    (:class:`~sb3_influence.common.round.InfluenceRound`): after every rollout, the scores the round's
    participants (``IIFCallback``, ``AttributionCallback``...) request are computed once at θ(k), filters clear
    records from ``rollout_buffer.keep`` in the order given, observers read the result, then the update runs.

    All of ``PPO``'s parameters are accepted unchanged (see ``stable_baselines3.PPO``), plus:

    :param influence_batch_size: Records per chunk when scoring. Memory grows linearly with it; scores do not
        depend on it.
    :param influence_method: ``"ghost"``: ghost dot products for Linear/Conv2d layers and forward-mode
        differentiation for every other parameter (``log_std``...); ``"jvp"``: forward-mode for all parameters.
        Both are exact; ``"ghost"`` is usually faster.
    :param influence_layer_scorers: Per-layer ghost scorers
        (:class:`~sb3_influence.common.scoring.layers.LayerScorer`), tried in order; ``None``: Linear and
        convolutions. Parameters of other layers are scored exactly by forward mode.
    :ivar n_rounds: Rounds opened so far; the next round's index. Saved with the model and never reset, so
        snapshots of a resumed run continue the numbering whatever ``reset_num_timesteps`` is.
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpPolicy": ActorCriticPolicy,
        "CnnPolicy": ActorCriticCnnPolicy,
        "MultiInputPolicy": MultiInputActorCriticPolicy,
    }
    rollout_buffer: InfluenceRolloutBuffer | InfluenceDictRolloutBuffer  # type: ignore[assignment]

    def __init__(
        self,
        policy: str | type[ActorCriticPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule = 3e-4,
        n_steps: int = 2048,
        batch_size: int = 64,
        n_epochs: int = 10,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        clip_range: float | Schedule = 0.2,
        clip_range_vf: float | Schedule | None = None,
        normalize_advantage: bool = True,
        ent_coef: float = 0.0,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
        use_sde: bool = False,
        sde_sample_freq: int = -1,
        rollout_buffer_class: type[RolloutBuffer] | None = None,
        rollout_buffer_kwargs: dict[str, Any] | None = None,
        target_kl: float | None = None,
        stats_window_size: int = 100,
        tensorboard_log: str | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        verbose: int = 0,
        seed: int | None = None,
        device: th.device | str = "auto",
        influence_batch_size: int = 4096,
        influence_method: str = "ghost",
        influence_layer_scorers: Sequence[LayerScorer] | None = None,
        _init_setup_model: bool = True,
    ):
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
        if env is not None:
            # Make the env here (as BaseAlgorithm would) to reject unsupported spaces with a clear error
            env = maybe_make_env(env, verbose)
            _check_action_space(env.action_space)
            _check_observation_space(env.observation_space)
        super().__init__(
            policy,
            env,
            learning_rate=learning_rate,
            n_steps=n_steps,
            batch_size=batch_size,
            n_epochs=n_epochs,
            gamma=gamma,
            gae_lambda=gae_lambda,
            clip_range=clip_range,
            clip_range_vf=clip_range_vf,
            normalize_advantage=normalize_advantage,
            ent_coef=ent_coef,
            vf_coef=vf_coef,
            max_grad_norm=max_grad_norm,
            use_sde=use_sde,
            sde_sample_freq=sde_sample_freq,
            rollout_buffer_class=rollout_buffer_class,
            rollout_buffer_kwargs=rollout_buffer_kwargs,
            target_kl=target_kl,
            stats_window_size=stats_window_size,
            tensorboard_log=tensorboard_log,
            policy_kwargs=policy_kwargs,
            verbose=verbose,
            seed=seed,
            device=device,
            _init_setup_model=False,
        )
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        _check_observation_space(self.observation_space)
        if self.rollout_buffer_class is None:
            if isinstance(self.observation_space, spaces.Dict):
                self.rollout_buffer_class = InfluenceDictRolloutBuffer
            else:
                self.rollout_buffer_class = InfluenceRolloutBuffer
        super()._setup_model()
        self._influence_engine = InfluenceEngine(
            self.policy, self.rollout_buffer, method=self.influence_method, layer_scorers=self.influence_layer_scorers
        )
        self.last_round: InfluenceRound | None = None
        self._participants: tuple[RoundParticipant, ...] = ()

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_influence_engine", "last_round", "_participants"]

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
        total_timesteps, callback = super()._setup_learn(
            total_timesteps, callback, reset_num_timesteps, tb_log_name, progress_bar
        )
        # This learn() call's round participants: the influence callbacks of its callback list, in the order given
        self._participants = tuple(_round_participants(callback))
        return total_timesteps, callback

    def learn(
        self: SelfInfluencePPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "InfluencePPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfInfluencePPO:
        try:
            return super().learn(
                total_timesteps=total_timesteps,
                callback=callback,
                log_interval=log_interval,
                tb_log_name=tb_log_name,
                reset_num_timesteps=reset_num_timesteps,
                progress_bar=progress_bar,
            )
        finally:
            # Participants belong to one learn() call, even one that raised
            self._participants = ()

    def collect_rollouts(
        self, env: VecEnv, callback: BaseCallback, rollout_buffer: RolloutBuffer, n_rollout_steps: int
    ) -> bool:
        """Collect a rollout as ``PPO`` does, then run the round (scores, filters, observers) before the update."""
        if not super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps):
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
            for start in range(0, len(order), self.batch_size):
                ids = th.as_tensor(order[start : start + self.batch_size])
                advantages = raw[ids]
                # Same expression and guard as the update
                if len(advantages) > 1:
                    normalized[ids] = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                else:
                    normalized[ids] = advantages
        return normalized.numpy().astype(np.float64)

    def compute_influence(
        self,
        target: str | Target = "return",
        batch_size: int | None = None,
        cache: bool = False,
        checkpoints: str = "single",
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
            afterwards. About as costly as ``train()`` plus one target gradient per optimiser step.
        :return: Float64 array of shape ``(n_steps, n_envs)``; ``[step, env]`` is the record at that position.
        """
        if self.rollout_buffer is None or not self.rollout_buffer.full:
            raise RuntimeError(
                "compute_influence() needs a full rollout buffer: call it from a callback's _on_rollout_end, "
                "or after learn() has collected at least one rollout."
            )
        if batch_size is None:
            batch_size = self.influence_batch_size
        elif isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (records per scoring chunk), got {batch_size!r}")
        if checkpoints not in CHECKPOINTS:
            raise ValueError(f"checkpoints must be one of {CHECKPOINTS}, got {checkpoints!r}")
        request = ScoreRequest(as_target(target), checkpoints)
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

    def _compute(self, request: ScoreRequest, round_: InfluenceRound, batch_size: int) -> np.ndarray:
        moved = sb3_compat.n_updates(self) != round_.start_state.n_updates
        if request.checkpoints == "single" and not moved:
            flat = self._influence_engine.influence(request.target, self._flat_training_advantages(round_), batch_size)
            return self.rollout_buffer.to_records(flat)
        with training_state(self):
            # From θ(k), whatever happened since; everything is put back afterwards
            round_.start_state.restore(self, keep=False)
            sb3_compat.set_model_logger(self, Logger(folder=None, output_formats=[]))
            if request.checkpoints == "single":
                flat = self._influence_engine.influence(request.target, self._flat_training_advantages(round_), batch_size)
            else:
                scorer = MultiCheckpointScorer(self._influence_engine, request.target, batch_size)
                self.update(step_hooks=[scorer])
                flat = scorer.scores
        return self.rollout_buffer.to_records(flat)

    # ------------------------------------------------------------------ training
    def train(self) -> None:
        """
        The round's update: run the round if nothing ran it yet (scores, filters, observers), then
        :meth:`update` on the kept records. With every record dropped the update is skipped with a warning.
        """
        self.run_round()
        n_kept = int(self.rollout_buffer.flat_keep.sum())
        self.logger.record("train/n_kept_records", n_kept)
        if n_kept == 0:
            warnings.warn(
                "Every record of this rollout was dropped (rollout_buffer.keep is all False): skipping this PPO "
                "update. Drop fewer records (e.g. a smaller IIFCallback fraction) to keep learning.",
                UserWarning,
            )
            return
        self.update()

    def update(self, step_hooks: Sequence[StepHook] = ()) -> None:
        """
        One PPO update on the kept records of the current round, exactly as ``PPO.train`` computes it.

        The first epoch walks the round's first permutation, later epochs draw theirs from numpy's global RNG,
        as ``RolloutBuffer.get`` does; dropped records are skipped. After ``backward()`` and gradient clipping,
        before ``optimizer.step()``, every hook is called with a :class:`~sb3_influence.common.round.StepInfo`.

        :param step_hooks: Per-optimiser-step subscribers (they must not change parameters or gradients).
        """
        round_ = self.current_round()
        buffer = self.rollout_buffer
        optimizer = self.policy.optimizer
        # Switch to train mode (this affects batch norm / dropout)
        self.policy.set_training_mode(True)
        sb3_compat.update_learning_rate(self, optimizer)
        progress = sb3_compat.progress_remaining(self)
        clip_range = self.clip_range(progress)  # type: ignore[operator]
        clip_range_vf = None if self.clip_range_vf is None else self.clip_range_vf(progress)  # type: ignore[operator]

        entropy_losses, pg_losses, value_losses, clip_fractions = [], [], [], []
        approx_kl_divs: list[np.ndarray] = []
        loss: th.Tensor | None = None
        continue_training = True
        step = 0
        for epoch in range(self.n_epochs):
            approx_kl_divs = []
            order = round_.first_permutation if epoch == 0 else np.random.permutation(buffer.n_records)
            for record_ids in buffer.kept_minibatches(order, self.batch_size):
                rollout_data = buffer.samples(record_ids)
                actions = rollout_data.actions
                if isinstance(self.action_space, spaces.Discrete):
                    # Convert discrete action from float to long
                    actions = rollout_data.actions.long().flatten()

                values, log_prob, entropy = self.policy.evaluate_actions(rollout_data.observations, actions)
                values = values.flatten()
                advantages = rollout_data.advantages
                # Normalization does not make sense if mini batchsize == 1, see SB3 GH issue #325
                if self.normalize_advantage and len(advantages) > 1:
                    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

                # Ratio between old and new policy, one at the first step
                ratio = th.exp(log_prob - rollout_data.old_log_prob)
                # Clipped surrogate loss
                policy_loss_1 = advantages * ratio
                policy_loss_2 = advantages * th.clamp(ratio, 1 - clip_range, 1 + clip_range)
                policy_loss = -th.min(policy_loss_1, policy_loss_2).mean()

                pg_losses.append(policy_loss.item())
                clip_fraction = th.mean((th.abs(ratio - 1) > clip_range).float()).item()
                clip_fractions.append(clip_fraction)

                if clip_range_vf is None:
                    values_pred = values
                else:
                    # Clip the difference between old and new value (depends on the reward scaling)
                    values_pred = rollout_data.old_values + th.clamp(
                        values - rollout_data.old_values, -clip_range_vf, clip_range_vf
                    )
                # Value loss using the TD(gae_lambda) target
                value_loss = F.mse_loss(rollout_data.returns, values_pred)
                value_losses.append(value_loss.item())

                # Entropy loss favours exploration (approximated when there is no analytical form)
                entropy_loss = -th.mean(-log_prob) if entropy is None else -th.mean(entropy)
                entropy_losses.append(entropy_loss.item())

                loss = policy_loss + self.ent_coef * entropy_loss + self.vf_coef * value_loss

                # Approximate reverse KL divergence for early stopping (SB3 issue #417, PR #419)
                with th.no_grad():
                    log_ratio = log_prob - rollout_data.old_log_prob
                    approx_kl_div = th.mean((th.exp(log_ratio) - 1) - log_ratio).cpu().numpy()
                    approx_kl_divs.append(approx_kl_div)

                if self.target_kl is not None and approx_kl_div > 1.5 * self.target_kl:
                    continue_training = False
                    if self.verbose >= 1:
                        print(f"Early stopping at step {epoch} due to reaching max kl: {approx_kl_div:.2f}")
                    break

                optimizer.zero_grad()
                loss.backward()
                total_norm = th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                if step_hooks:
                    info = _step_info(
                        epoch,
                        step,
                        record_ids,
                        rollout_data,
                        advantages,
                        ratio,
                        clip_range,
                        total_norm,
                        self.max_grad_norm,
                        optimizer,
                    )
                    for hook in step_hooks:
                        hook(info)
                optimizer.step()
                step += 1

            sb3_compat.set_n_updates(self, sb3_compat.n_updates(self) + 1)
            if not continue_training:
                break

        explained_var = explained_variance(buffer.values.flatten(), buffer.returns.flatten())
        self.logger.record("train/entropy_loss", np.mean(entropy_losses))
        self.logger.record("train/policy_gradient_loss", np.mean(pg_losses))
        self.logger.record("train/value_loss", np.mean(value_losses))
        self.logger.record("train/approx_kl", np.mean(approx_kl_divs))
        self.logger.record("train/clip_fraction", np.mean(clip_fractions))
        if loss is not None:
            self.logger.record("train/loss", loss.item())
        self.logger.record("train/explained_variance", explained_var)
        if hasattr(self.policy, "log_std"):
            self.logger.record("train/std", th.exp(self.policy.log_std).mean().item())
        self.logger.record("train/n_updates", sb3_compat.n_updates(self), exclude="tensorboard")
        self.logger.record("train/clip_range", clip_range)
        if clip_range_vf is not None:
            self.logger.record("train/clip_range_vf", clip_range_vf)


def _step_info(
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
) -> StepInfo:
    advantages = advantages.detach()
    ratio = ratio.detach()
    # min(A·r, A·clip(r)) takes the clipped branch, whose gradient is zero, above 1+ε for A > 0, below 1−ε for A < 0
    clipped = ((advantages > 0) & (ratio > 1 + clip_range)) | ((advantages < 0) & (ratio < 1 - clip_range))
    # torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6), capped at 1
    clip_coef = min(1.0, max_grad_norm / (float(total_norm) + 1e-6))
    return StepInfo(epoch, step, np.asarray(record_ids), samples, advantages, ratio, clipped, clip_coef, optimizer)


def _round_participants(callback: BaseCallback) -> list[RoundParticipant]:
    """The round participants of a callback tree, depth first in the order given (only CallbackList is walked)."""
    if isinstance(callback, CallbackList):
        return [participant for child in callback.callbacks for participant in _round_participants(child)]
    return [callback] if isinstance(callback, RoundParticipant) else []


def _check_action_space(space: spaces.Space) -> None:
    if not isinstance(space, _SUPPORTED_ACTION_SPACES):
        raise ValueError(
            f"InfluencePPO does not support the action space {space}: use Box, Discrete, MultiDiscrete or MultiBinary"
        )


def _check_observation_space(space: spaces.Space) -> None:
    if isinstance(space, spaces.Dict):
        for key, subspace in space.spaces.items():
            if not isinstance(subspace, _SUPPORTED_OBSERVATION_SPACES):
                raise ValueError(
                    f"InfluencePPO does not support the observation space {subspace} under Dict key {key!r}: "
                    f"use one of {[s.__name__ for s in _SUPPORTED_OBSERVATION_SPACES]} (nested Dict/Tuple spaces: flatten "
                    "them with a wrapper first)"
                )
        return
    if not isinstance(space, _SUPPORTED_OBSERVATION_SPACES):
        raise ValueError(
            f"InfluencePPO does not support the observation space {space}: use Box, Discrete, MultiDiscrete, "
            "MultiBinary or Dict (flatten Tuple/Sequence/Graph spaces with a wrapper first)"
        )
