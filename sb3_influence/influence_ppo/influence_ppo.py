from collections.abc import Sequence
from typing import Any, ClassVar

import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy, BasePolicy, MultiInputActorCriticPolicy
from stable_baselines3.common.type_aliases import GymEnv, Schedule

from sb3_influence.common.algorithm import InfluenceAlgorithm
from sb3_influence.common.ppo_update import ClippedSurrogateUpdate
from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer
from sb3_influence.common.scoring import LayerScorer


class InfluencePPO(ClippedSurrogateUpdate, InfluenceAlgorithm, PPO):
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
        env = self._init_influence(
            env, verbose, influence_batch_size, influence_method, influence_layer_scorers, rollout_buffer_class
        )
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
