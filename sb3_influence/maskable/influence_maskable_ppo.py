from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib import MaskablePPO
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from torch.nn import functional as F

from sb3_influence.common import sb3_compat
from sb3_influence.common.algorithm import InfluenceAlgorithm
from sb3_influence.common.round import CapturingStepHook, StepHook, StepInfo
from sb3_influence.common.scoring import LayerScorer
from sb3_influence.maskable.buffers import InfluenceMaskableDictRolloutBuffer, InfluenceMaskableRolloutBuffer
from sb3_influence.maskable.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

SelfInfluenceMaskablePPO = TypeVar("SelfInfluenceMaskablePPO", bound="InfluenceMaskablePPO")


class InfluenceMaskablePPO(InfluenceAlgorithm, MaskablePPO):
    """
    sb3-contrib's ``MaskablePPO`` (PPO with invalid action masking) whose rollout records can be scored by their
    influence on a target and dropped before the update (Hu et al., "A Snapshot of Influence", arXiv 2505.19281).

    A drop-in replacement for ``MaskablePPO``: with no record dropped it trains bit-identically to ``MaskablePPO``
    with the same seed. The action masks are stored with the records (the buffer's samples carry
    ``action_masks``, as ``MaskableRolloutBuffer``'s do) and enter ``log π`` everywhere exactly as the loss uses
    them: scores, targets over the buffer's records (``"return"``) and the update. The round, the callbacks
    (``IIFCallback``, ``AttributionCallback``: snapshots then hold ``action_mask``) and the report work as with
    ``InfluencePPO``.

    All of ``MaskablePPO``'s parameters are accepted unchanged (see ``sb3_contrib.MaskablePPO``), plus:

    :param influence_batch_size: Records per chunk when scoring. Memory grows linearly with it; scores do not
        depend on it.
    :param influence_method: ``"ghost"``: ghost dot products for Linear/Conv layers and forward-mode
        differentiation for every other parameter; ``"jvp"``: forward-mode for all parameters. Both are exact.
    :param influence_layer_scorers: Per-layer ghost scorers
        (:class:`~sb3_influence.common.scoring.layers.LayerScorer`), tried in order; ``None``: Linear and
        convolutions.
    :ivar n_rounds: Rounds opened so far; the next round's index (saved with the model, never reset).

    One deviation: a minibatch of a single record is not advantage-normalised (as in SB3's ``PPO``), where
    ``MaskablePPO`` would divide by the NaN standard deviation of one value.
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpPolicy": MlpPolicy,
        "CnnPolicy": CnnPolicy,
        "MultiInputPolicy": MultiInputPolicy,
    }
    policy: MaskableActorCriticPolicy  # type: ignore[assignment]
    rollout_buffer: InfluenceMaskableRolloutBuffer | InfluenceMaskableDictRolloutBuffer  # type: ignore[assignment]

    def __init__(
        self,
        policy: str | type[MaskableActorCriticPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule = 3e-4,
        n_steps: int = 2048,
        batch_size: int | None = 64,
        n_epochs: int = 10,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        clip_range: float | Schedule = 0.2,
        clip_range_vf: float | Schedule | None = None,
        normalize_advantage: bool = True,
        ent_coef: float = 0.0,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
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
        if rollout_buffer_class is not None and not issubclass(
            rollout_buffer_class, (InfluenceMaskableRolloutBuffer, InfluenceMaskableDictRolloutBuffer)
        ):
            raise TypeError(
                f"rollout_buffer_class must be InfluenceMaskableRolloutBuffer, InfluenceMaskableDictRolloutBuffer or a "
                f"subclass (the records must carry their action masks), got {rollout_buffer_class.__name__}. Leave it "
                "as None to pick the right one automatically."
            )
        env = self._init_influence(
            env, verbose, influence_batch_size, influence_method, influence_layer_scorers, rollout_buffer_class
        )
        action_space = getattr(env, "action_space", None)
        if env is not None and not isinstance(action_space, (spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
            raise ValueError(
                f"InfluenceMaskablePPO does not support the action space {action_space}: action masking needs "
                "Discrete, MultiDiscrete or MultiBinary actions (use InfluencePPO for Box actions)"
            )
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))):
            raise TypeError(f"batch_size must be a positive int or None (one minibatch), got {batch_size!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be a positive int or None (one minibatch), got {batch_size}")
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
        if self.rollout_buffer_class is None:
            if isinstance(self.observation_space, spaces.Dict):
                self.rollout_buffer_class = InfluenceMaskableDictRolloutBuffer
            else:
                self.rollout_buffer_class = InfluenceMaskableRolloutBuffer
        super()._setup_model()

    def learn(  # type: ignore[override]
        self: SelfInfluenceMaskablePPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str | None = None,
        reset_num_timesteps: bool = True,
        use_masking: bool = True,
        progress_bar: bool = False,
    ) -> SelfInfluenceMaskablePPO:
        """
        ``MaskablePPO.learn``; every rollout runs the round before its update.

        :param use_masking: Collect the rollouts with the env's action masks (``False``: the stored masks are all
            ones, and the update and the scores use them as ``MaskablePPO`` does).
        """
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
            use_masking=use_masking,
        )

    def training_batch_size(self) -> int:
        """Records per minibatch of the update (``batch_size=None``: the whole buffer)."""
        return self.rollout_buffer.n_records if self.batch_size is None else int(self.batch_size)

    def update(self, step_hooks: Sequence[StepHook] = ()) -> None:
        """
        One ``MaskablePPO`` update on the kept records of the current round, exactly as ``MaskablePPO.train``
        computes it, with each minibatch's stored action masks.

        The first epoch walks the round's first permutation, later epochs draw theirs from numpy's global RNG,
        as ``MaskableRolloutBuffer.get`` does; dropped records are skipped. After ``backward()`` and gradient
        clipping, before ``optimizer.step()``, every hook is called with a
        :class:`~sb3_influence.common.round.StepInfo` (its ``samples`` carry ``action_masks``).

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
        total_steps = self.n_epochs * len(buffer.kept_minibatches(round_.first_permutation, self.batch_size))
        with ExitStack() as captures:
            # In-run scorers watch the update's own forward and backward passes while it runs
            for hook in step_hooks:
                if isinstance(hook, CapturingStepHook):
                    captures.enter_context(hook.capture(self.policy))
            for epoch in range(self.n_epochs):
                approx_kl_divs = []
                order = round_.first_permutation if epoch == 0 else np.random.permutation(buffer.n_records)
                for record_ids in buffer.kept_minibatches(order, self.batch_size):
                    rollout_data = buffer.samples(record_ids)
                    actions = rollout_data.actions
                    if isinstance(self.action_space, spaces.Discrete):
                        # Convert discrete action from float to long
                        actions = rollout_data.actions.long().flatten()

                    values, log_prob, entropy = self.policy.evaluate_actions(
                        rollout_data.observations, actions, action_masks=rollout_data.action_masks
                    )
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
                        info = StepInfo.from_loss(
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
                            total_steps,
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
        self.logger.record("train/n_updates", sb3_compat.n_updates(self), exclude="tensorboard")
        self.logger.record("train/clip_range", clip_range)
        if clip_range_vf is not None:
            self.logger.record("train/clip_range_vf", clip_range_vf)

    def record_losses(self, samples: Any, advantages: th.Tensor, clip_range: float, clip_range_vf: float | None) -> th.Tensor:
        """
        The per-record terms of :meth:`update`'s loss at the current parameters, with each record's action mask:
        ``−min(Â·r, Â·clip(r)) + ent_coef · (−entropy) + vf_coef · (R − V_pred)²``, so that the update's loss is
        their mean (up to float rounding). Optimizer-aware scoring differentiates it.

        :param samples: A minibatch, as ``rollout_buffer.samples(ids)`` returns it (with ``action_masks``).
        :param advantages: ``Â`` as the update used them (normalised in the minibatch).
        :param clip_range: The ratio clip ε.
        :param clip_range_vf: The value clip, or ``None``.
        :return: Shape ``(len(samples.actions),)``.
        """
        actions = samples.actions
        if isinstance(self.action_space, spaces.Discrete):
            actions = actions.long().flatten()
        values, log_prob, entropy = self.policy.evaluate_actions(
            samples.observations, actions, action_masks=samples.action_masks
        )
        values = values.flatten()
        ratio = th.exp(log_prob - samples.old_log_prob)
        policy_term = -th.min(advantages * ratio, advantages * th.clamp(ratio, 1 - clip_range, 1 + clip_range))
        if clip_range_vf is None:
            values_pred = values
        else:
            values_pred = samples.old_values + th.clamp(values - samples.old_values, -clip_range_vf, clip_range_vf)
        entropy_term = log_prob if entropy is None else -entropy
        return policy_term + self.ent_coef * entropy_term + self.vf_coef * (samples.returns - values_pred) ** 2
