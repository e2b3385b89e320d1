from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, ClassVar, TypeVar

import torch as th
from gymnasium import spaces
from stable_baselines3 import A2C
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy, BasePolicy, MultiInputActorCriticPolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from torch.nn import functional as F

from sb3_influence.common import sb3_compat
from sb3_influence.common.algorithm import InfluenceAlgorithm
from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer
from sb3_influence.common.round import CapturingStepHook, StepHook, StepInfo
from sb3_influence.common.scoring import LayerScorer

SelfInfluenceA2C = TypeVar("SelfInfluenceA2C", bound="InfluenceA2C")


class InfluenceA2C(InfluenceAlgorithm, A2C):
    """
    SB3's ``A2C`` whose rollout records can be scored by their influence on a target and dropped before the
    update (Hu et al., "A Snapshot of Influence", arXiv 2505.19281).

    A2C makes one optimiser step per rollout (RMSprop by default) on the policy-gradient loss
    ``−mean_i Â_i log π(a_i|s_i)`` of all its records, at the parameters that collected them: the ratio is
    exactly 1 and there is no clipping. So the round is one step from θ(k), and the single-checkpoint score
    ``I_i = −⟨∇ℓ_i, ∇f⟩`` is the first-order effect of record i on f through the round's gradient (before the
    optimiser's preconditioning); ``checkpoints="multi"`` gives the same scores.

    A drop-in replacement for ``A2C``: with no record dropped it trains bit-identically to ``A2C`` with the same
    seed. Its update (:meth:`update`) walks all kept records as one minibatch and calls the step hooks once.

    All of ``A2C``'s parameters are accepted unchanged (see ``stable_baselines3.A2C``), plus:

    :param influence_batch_size: Records per chunk when scoring. Memory grows linearly with it; scores do not
        depend on it.
    :param influence_method: ``"ghost"``: ghost dot products for Linear/Conv layers and forward-mode
        differentiation for every other parameter (``log_std``...); ``"jvp"``: forward-mode for all parameters.
        Both are exact.
    :param influence_layer_scorers: Per-layer ghost scorers
        (:class:`~sb3_influence.common.scoring.layers.LayerScorer`), tried in order; ``None``: Linear and
        convolutions.
    :ivar n_rounds: Rounds opened so far; the next round's index (saved with the model, never reset).

    One deviation: with ``normalize_advantage=True`` a rollout of a single record is not normalised (as in SB3's
    ``PPO``), where ``A2C`` would divide by the NaN standard deviation of one value.
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpPolicy": ActorCriticPolicy,
        "CnnPolicy": ActorCriticCnnPolicy,
        "MultiInputPolicy": MultiInputActorCriticPolicy,
    }
    rollout_buffer: InfluenceRolloutBuffer | InfluenceDictRolloutBuffer  # type: ignore[assignment]
    #: A2C has no value clipping (read, as PPO's, by optimizer-aware scoring)
    clip_range_vf = None

    def __init__(
        self,
        policy: str | type[ActorCriticPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule = 7e-4,
        n_steps: int = 5,
        gamma: float = 0.99,
        gae_lambda: float = 1.0,
        ent_coef: float = 0.0,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
        rms_prop_eps: float = 1e-5,
        use_rms_prop: bool = True,
        use_sde: bool = False,
        sde_sample_freq: int = -1,
        rollout_buffer_class: type[RolloutBuffer] | None = None,
        rollout_buffer_kwargs: dict[str, Any] | None = None,
        normalize_advantage: bool = False,
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
        env = self._init_influence(
            env, verbose, influence_batch_size, influence_method, influence_layer_scorers, rollout_buffer_class
        )
        super().__init__(
            policy,
            env,
            learning_rate=learning_rate,
            n_steps=n_steps,
            gamma=gamma,
            gae_lambda=gae_lambda,
            ent_coef=ent_coef,
            vf_coef=vf_coef,
            max_grad_norm=max_grad_norm,
            rms_prop_eps=rms_prop_eps,
            use_rms_prop=use_rms_prop,
            use_sde=use_sde,
            sde_sample_freq=sde_sample_freq,
            rollout_buffer_class=rollout_buffer_class,
            rollout_buffer_kwargs=rollout_buffer_kwargs,
            normalize_advantage=normalize_advantage,
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

    def learn(
        self: SelfInfluenceA2C,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 100,
        tb_log_name: str | None = None,
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
        **kwargs: Any,
    ) -> SelfInfluenceA2C:
        """``A2C.learn`` (logs every 100 rollouts by default, as ``A2C``); every rollout runs the round before its update."""
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
            **kwargs,
        )

    def training_batch_size(self) -> int:
        """A2C's update is one minibatch of every kept record (advantages are normalised over all of them)."""
        return self.rollout_buffer.n_records

    def update(self, step_hooks: Sequence[StepHook] = ()) -> None:
        """
        One ``A2C`` update on the kept records of the current round, exactly as ``A2C.train`` computes it: one
        minibatch (in the order of the round's first permutation, as ``RolloutBuffer.get`` draws it), one
        optimiser step. After ``backward()`` and gradient clipping, before ``optimizer.step()``, every hook is
        called once with a :class:`~sb3_influence.common.round.StepInfo` whose ratio is 1 and whose clip range is
        infinite (A2C's loss has neither).

        :param step_hooks: Per-optimiser-step subscribers (they must not change parameters or gradients).
        """
        round_ = self.current_round()
        buffer = self.rollout_buffer
        optimizer = self.policy.optimizer
        # Switch to train mode (this affects batch norm / dropout)
        self.policy.set_training_mode(True)
        sb3_compat.update_learning_rate(self, optimizer)

        with ExitStack() as captures:
            # In-run scorers watch the update's own forward and backward passes while it runs
            for hook in step_hooks:
                if isinstance(hook, CapturingStepHook):
                    captures.enter_context(hook.capture(self.policy))
            # One minibatch: every kept record (the loop runs once)
            for record_ids in buffer.kept_minibatches(round_.first_permutation, None):
                rollout_data = buffer.samples(record_ids)
                actions = rollout_data.actions
                if isinstance(self.action_space, spaces.Discrete):
                    # Convert discrete action from float to long
                    actions = actions.long().flatten()

                values, log_prob, entropy = self.policy.evaluate_actions(rollout_data.observations, actions)
                values = values.flatten()

                # Normalize advantage (not present in the original implementation); not for a single record
                advantages = rollout_data.advantages
                if self.normalize_advantage and len(advantages) > 1:
                    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

                # Policy gradient loss
                policy_loss = -(advantages * log_prob).mean()
                # Value loss using the TD(gae_lambda) target
                value_loss = F.mse_loss(rollout_data.returns, values)
                # Entropy loss favours exploration (approximated when there is no analytical form)
                entropy_loss = -th.mean(-log_prob) if entropy is None else -th.mean(entropy)

                loss = policy_loss + self.ent_coef * entropy_loss + self.vf_coef * value_loss

                optimizer.zero_grad()
                loss.backward()
                total_norm = th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                if step_hooks:
                    # On-policy, one step from the behaviour parameters: ratio 1, nothing clipped
                    ratio = th.ones_like(advantages)
                    info = StepInfo.from_loss(
                        0,
                        0,
                        record_ids,
                        rollout_data,
                        advantages,
                        ratio,
                        float("inf"),
                        total_norm,
                        self.max_grad_norm,
                        optimizer,
                        1,
                    )
                    for hook in step_hooks:
                        hook(info)
                optimizer.step()

        explained_var = explained_variance(buffer.values.flatten(), buffer.returns.flatten())
        sb3_compat.set_n_updates(self, sb3_compat.n_updates(self) + 1)
        self.logger.record("train/n_updates", sb3_compat.n_updates(self), exclude="tensorboard")
        self.logger.record("train/explained_variance", explained_var)
        self.logger.record("train/entropy_loss", entropy_loss.item())
        self.logger.record("train/policy_loss", policy_loss.item())
        self.logger.record("train/value_loss", value_loss.item())
        if hasattr(self.policy, "log_std"):
            self.logger.record("train/std", th.exp(self.policy.log_std).mean().item())

    def record_losses(self, samples: Any, advantages: th.Tensor, clip_range: float, clip_range_vf: float | None) -> th.Tensor:
        """
        The per-record terms of :meth:`update`'s loss at the current parameters:
        ``−Â·log π + ent_coef · (−entropy) + vf_coef · (R − V)²``, so that the update's loss is their mean (up to
        float rounding). Optimizer-aware scoring differentiates it.

        :param samples: A minibatch, as ``rollout_buffer.samples(ids)`` returns it.
        :param advantages: ``Â`` as the update used them.
        :param clip_range: Ignored (A2C's loss has no ratio clip).
        :param clip_range_vf: Ignored (no value clip).
        :return: Shape ``(len(samples.actions),)``.
        """
        actions = samples.actions
        if isinstance(self.action_space, spaces.Discrete):
            actions = actions.long().flatten()
        values, log_prob, entropy = self.policy.evaluate_actions(samples.observations, actions)
        entropy_term = log_prob if entropy is None else -entropy
        return -advantages * log_prob + self.ent_coef * entropy_term + self.vf_coef * (samples.returns - values.flatten()) ** 2
