"""
PPO's clipped-surrogate update, owned: the one update loop of ``InfluencePPO`` and ``InfluenceMaskablePPO``.

:class:`ClippedSurrogateUpdate` is a mixin placed before :class:`~sb3_influence.common.algorithm.InfluenceAlgorithm`.
It walks the kept minibatches of the round, computes PPO's loss with PPO's own expressions (bit-identity) and calls
the step hooks after ``backward()`` and clipping. An algorithm whose policy needs more than ``(observations,
actions)`` to evaluate them (MaskablePPO's action masks) overrides :meth:`~ClippedSurrogateUpdate._evaluate_actions`.
"""

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.utils import explained_variance
from torch.nn import functional as F

from sb3_influence.common import sb3_compat
from sb3_influence.common.round import CapturingStepHook, StepHook, StepInfo


class ClippedSurrogateUpdate:
    """PPO's update loop and its per-record loss (see the module docstring)."""

    unrolled_update = True  # the unrolled (hypergradient) score replays exactly this loop

    # Provided by the PPO-like SB3 algorithm the mixin is combined with
    policy: Any
    rollout_buffer: Any
    action_space: Any
    n_epochs: int
    batch_size: Any
    clip_range: Any
    clip_range_vf: Any
    normalize_advantage: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    target_kl: float | None
    verbose: int
    logger: Any
    current_round: Any  # InfluenceAlgorithm.current_round (an annotation only: nothing here shadows it)

    def _evaluate_actions(self, samples: Any, actions: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor | None]:
        """``policy.evaluate_actions`` for a minibatch (values, log-probabilities, entropy)."""
        return self.policy.evaluate_actions(samples.observations, actions)

    def update(self, step_hooks: Sequence[StepHook] = ()) -> None:
        """
        One PPO update on the kept records of the current round, exactly as ``PPO.train`` (and ``MaskablePPO.train``,
        through :meth:`_evaluate_actions`) computes it.

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

                    values, log_prob, entropy = self._evaluate_actions(rollout_data, actions)
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

        self._record_update_logs(
            entropy_losses, pg_losses, value_losses, approx_kl_divs, clip_fractions, loss, clip_range, clip_range_vf
        )

    def _record_update_logs(
        self,
        entropy_losses: list[float],
        pg_losses: list[float],
        value_losses: list[float],
        approx_kl_divs: list[np.ndarray],
        clip_fractions: list[float],
        loss: th.Tensor | None,
        clip_range: float,
        clip_range_vf: float | None,
    ) -> None:
        """The ``train/`` logs ``PPO.train`` records, for one update."""
        buffer = self.rollout_buffer
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

    def record_losses(
        self,
        samples: Any,
        advantages: th.Tensor,
        clip_range: float,
        clip_range_vf: float | None,
        clip_smoothing: float = 0.0,
    ) -> th.Tensor:
        """
        The per-record terms of :meth:`update`'s loss at the current parameters: for each record of ``samples``,
        ``−min(Â·r, Â·clip(r)) + ent_coef · (−entropy) + vf_coef · (R − V_pred)²``, so that the update's loss is
        their mean (up to float rounding: the update keeps PPO's own expression, for bit-identity). Optimizer-aware
        scoring differentiates it for the parameters no layer scorer handles.

        :param samples: A minibatch, as ``rollout_buffer.samples(ids)`` returns it.
        :param advantages: ``Â`` as the update used them (normalised in the minibatch).
        :param clip_range: The ratio clip ε.
        :param clip_range_vf: The value clip, or ``None``.
        :param clip_smoothing: ``τ > 0`` replaces the ratio clip's kink by a softplus of width τ:
            ``min(r, 1+ε) ≈ 1+ε − τ·softplus((1+ε−r)/τ)`` for ``Â > 0`` and ``max(r, 1−ε) ≈ 1−ε + τ·softplus((r−(1−ε))/τ)``
            for ``Â < 0`` (values within ``τ·log 2`` of the clipped ones). Only the unrolled scorer uses it; 0 is PPO's
            loss.
        :return: Shape ``(len(samples.actions),)``.
        """
        actions = samples.actions
        if isinstance(self.action_space, spaces.Discrete):
            actions = actions.long().flatten()
        values, log_prob, entropy = self._evaluate_actions(samples, actions)
        values = values.flatten()
        ratio = th.exp(log_prob - samples.old_log_prob)
        if clip_smoothing > 0:
            softplus = th.nn.functional.softplus
            upper = (1 + clip_range) - clip_smoothing * softplus((1 + clip_range - ratio) / clip_smoothing)
            lower = (1 - clip_range) + clip_smoothing * softplus((ratio - (1 - clip_range)) / clip_smoothing)
            # −min(Â·r, Â·clip(r)) is −Â·min(r, 1+ε) for Â > 0 and −Â·max(r, 1−ε) for Â < 0
            policy_term = -advantages * th.where(advantages > 0, upper, lower)
        else:
            policy_term = -th.min(advantages * ratio, advantages * th.clamp(ratio, 1 - clip_range, 1 + clip_range))
        if clip_range_vf is None:
            values_pred = values
        else:
            values_pred = samples.old_values + th.clamp(values - samples.old_values, -clip_range_vf, clip_range_vf)
        entropy_term = log_prob if entropy is None else -entropy
        return policy_term + self.ent_coef * entropy_term + self.vf_coef * (samples.returns - values_pred) ** 2
