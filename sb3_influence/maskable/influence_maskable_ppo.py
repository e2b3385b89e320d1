from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib import MaskablePPO
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule

from sb3_influence.common.algorithm import InfluenceAlgorithm
from sb3_influence.common.ppo_update import ClippedSurrogateUpdate
from sb3_influence.common.scoring import LayerScorer
from sb3_influence.maskable.buffers import InfluenceMaskableDictRolloutBuffer, InfluenceMaskableRolloutBuffer
from sb3_influence.maskable.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

SelfInfluenceMaskablePPO = TypeVar("SelfInfluenceMaskablePPO", bound="InfluenceMaskablePPO")


class InfluenceMaskablePPO(ClippedSurrogateUpdate, InfluenceAlgorithm, MaskablePPO):
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

    def _evaluate_actions(self, samples: Any, actions: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor | None]:
        """``evaluate_actions`` with each record's stored action mask, as ``MaskablePPO.train`` calls it."""
        return self.policy.evaluate_actions(samples.observations, actions, action_masks=samples.action_masks)
