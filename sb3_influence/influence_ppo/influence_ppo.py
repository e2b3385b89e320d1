import copy
import warnings
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.base_class import maybe_make_env
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy, BasePolicy, MultiInputActorCriticPolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule

from sb3_influence.common.buffers import InfluenceDictRolloutBuffer, InfluenceRolloutBuffer, InfluenceRolloutBufferMixin
from sb3_influence.common.influence import INFLUENCE_METHODS, InfluenceEngine
from sb3_influence.common.targets import Target, as_target

SelfInfluencePPO = TypeVar("SelfInfluencePPO", bound="InfluencePPO")

_SUPPORTED_ACTION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_SUPPORTED_OBSERVATION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class InfluencePPO(PPO):
    """
    PPO whose rollout records can be scored by their influence on a target and dropped before the update
    (Hu et al., "A Snapshot of Influence", NeurIPS 2025, arXiv 2505.19281).

    A drop-in replacement for ``PPO``: with no record dropped it trains bit-identically to ``PPO`` with the
    same seed. Its rollout buffer carries a keep mask ``rollout_buffer.keep`` of shape ``(n_steps, n_envs)``;
    ``train()`` only sees the kept records (fewer records, fewer optimiser steps). ``compute_influence`` scores
    every record of the current buffer at the current parameters (METHOD §2); ``IIFCallback`` and
    ``AttributionCallback`` build on both.

    All of ``PPO``'s parameters are accepted unchanged (see ``stable_baselines3.PPO``), plus:

    :param influence_batch_size: Records per chunk when scoring. Memory grows linearly with it; scores do not
        depend on it.
    :param influence_method: ``"ghost"``: ghost dot products for Linear/Conv2d layers and forward-mode
        differentiation for every other parameter (``log_std``...); ``"jvp"``: forward-mode for all parameters.
        Both are exact; ``"ghost"`` is usually faster.
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
        _init_setup_model: bool = True,
    ):
        if isinstance(influence_batch_size, bool) or not isinstance(influence_batch_size, (int, np.integer)):
            raise TypeError(f"influence_batch_size must be a positive int, got {influence_batch_size!r}")
        if influence_batch_size < 1:
            raise ValueError(
                f"influence_batch_size must be a positive int (records per scoring chunk), got {influence_batch_size}"
            )
        if influence_method not in INFLUENCE_METHODS:
            raise ValueError(f"influence_method must be one of {INFLUENCE_METHODS}, got {influence_method!r}")
        if rollout_buffer_class is not None and not issubclass(rollout_buffer_class, InfluenceRolloutBufferMixin):
            raise TypeError(
                f"rollout_buffer_class must be InfluenceRolloutBuffer, InfluenceDictRolloutBuffer or a subclass, "
                f"got {rollout_buffer_class.__name__}. Leave it as None to pick the right one automatically."
            )
        self.influence_batch_size = int(influence_batch_size)
        self.influence_method = influence_method
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
        self._influence_engine = InfluenceEngine(self.policy, self.rollout_buffer, method=self.influence_method)
        self._influence_cache: dict[Any, np.ndarray] = {}

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_influence_engine", "_influence_cache"]

    # ------------------------------------------------------------------ influence
    @property
    def influence_engine(self) -> InfluenceEngine:
        """The engine that scores this model's rollout buffer (rebuilt by ``_setup_model``)."""
        return self._influence_engine

    def training_advantages(self) -> np.ndarray:
        """
        The advantages ``Â_i`` as the coming PPO update will see them (METHOD §2): normalised with the mean and
        std of the record's minibatch in the first epoch when ``normalize_advantage=True``, raw otherwise.

        :return: Array of shape ``(n_steps, n_envs)``.
        """
        return self.rollout_buffer.to_records(self._flat_training_advantages())

    def _flat_training_advantages(self) -> np.ndarray:
        buffer = self.rollout_buffer
        if not buffer.full:
            raise RuntimeError("No rollout to score: the rollout buffer is empty. Collect a rollout first (learn()).")
        dtype = self._influence_engine.dtype
        raw = th.as_tensor(buffer.flat_field("advantages")).to(dtype)
        if not self.normalize_advantage:
            return raw.numpy().astype(np.float64)
        permutation = buffer.first_epoch_permutation()
        keep = buffer.flat_keep
        normalized = raw.clone()
        # Unfiltered layout for every record, then the layout of the kept records (what the update will see)
        for order in (permutation, permutation[keep[permutation]]) if not keep.all() else (permutation,):
            for start in range(0, len(order), self.batch_size):
                ids = th.as_tensor(order[start : start + self.batch_size])
                advantages = raw[ids]
                # Same expression and guard as PPO.train
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
        Influence of every record of the current rollout buffer on ``target``, at the current parameters:
        ``I_i = −⟨∇θ ℓ_i, ∇θ f⟩`` with ``ℓ_i = −Â_i log π(a_i|s_i)`` (METHOD §2). Positive: the record's
        update moves f up (helpful); negative: harmful.

        :param target: ``"return"``, :class:`~sb3_influence.ReturnTarget`, :class:`~sb3_influence.ActionTarget`
            or any object implementing the :class:`~sb3_influence.Target` protocol.
        :param batch_size: Records per chunk (default: ``influence_batch_size``); scores do not depend on it.
        :param cache: Reuse the scores already computed for this target in this round (callbacks use this to
            share one computation). Only targets that compare equal (such as ``"return"``) or the same target
            object hit the cache.
        :param checkpoints: ``"single"``: at θ(k), the parameters before this round's update (METHOD §2, what IIF
            uses). ``"multi"``: the paper's formal definition (§3.1, TracIn-style): the sum over every optimiser
            step j of the coming update whose minibatch holds record i of ``−⟨∇ℓ_i(θ_j), ∇f(θ_j)⟩``, with Â_i
            normalised in that minibatch. It replays the update (same minibatches, same RNG) and then restores the
            parameters, the optimizer and the RNG, so the real update that follows is unchanged. About as costly as
            ``train()`` plus one target gradient per optimiser step.
        :return: Float64 array of shape ``(n_steps, n_envs)``; ``[step, env]`` is the record at that position.
        """
        if self.rollout_buffer is None or not self.rollout_buffer.full:
            raise RuntimeError(
                "compute_influence() needs a full rollout buffer: call it from a callback's _on_rollout_end, "
                "or after learn() has collected at least one rollout."
            )
        target = as_target(target)
        if batch_size is None:
            batch_size = self.influence_batch_size
        elif isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (records per scoring chunk), got {batch_size!r}")
        if checkpoints not in ("single", "multi"):
            raise ValueError(f"checkpoints must be 'single' or 'multi', got {checkpoints!r}")
        key = (self.rollout_buffer.rollout_index, self._n_updates, checkpoints, _cache_key(target))
        if cache and key in self._influence_cache:
            return self._influence_cache[key].copy()
        if checkpoints == "multi":
            scores = self._multi_checkpoint_influence(target, int(batch_size))
        else:
            scores = self._influence_engine.influence(target, self._flat_training_advantages(), int(batch_size))
        scores = self.rollout_buffer.to_records(scores)
        if cache:
            self._influence_cache = {k: v for k, v in self._influence_cache.items() if k[:2] == key[:2]}
            self._influence_cache[key] = scores.copy()
        return scores

    def _multi_checkpoint_influence(self, target: Target, batch_size: int) -> np.ndarray:
        engine, buffer = self._influence_engine, self.rollout_buffer
        raw = buffer.flat_field("advantages").astype(np.float64)
        scores = np.zeros(buffer.n_records)
        optimizer = self.policy.optimizer

        def score_then_step(*args: Any, **kwargs: Any) -> Any:
            # Called by train() after backward(), before the parameters move: we are at θ_j
            ids = buffer.current_minibatch
            assert ids is not None
            advantages = raw[ids]
            if self.normalize_advantage and len(ids) > 1:
                advantages = (advantages - advantages.mean()) / (advantages.std(ddof=1) + 1e-8)
            with engine.eval_mode():
                v = engine.target_gradient(target, batch_size)
                if v:
                    scores[ids] += advantages * engine.alignment(v, batch_size, ids)[ids]
            return original_step(*args, **kwargs)

        # Everything the replay changes, restored afterwards
        policy_state = copy.deepcopy(self.policy.state_dict())
        optimizer_state = copy.deepcopy(optimizer.state_dict())
        buffer.first_epoch_permutation()  # the replay and the real update share the first epoch
        saved = (np.random.get_state(), th.get_rng_state(), buffer._first_permutation, self._n_updates, self.policy.training)
        distribution_state = dict(vars(self.policy.action_dist))
        original_step = optimizer.step
        patched_before = optimizer.__dict__.get("step")
        optimizer.step = score_then_step  # type: ignore[method-assign]
        try:
            super().train()
        finally:
            if patched_before is None:
                del optimizer.step
            else:
                optimizer.step = patched_before  # type: ignore[method-assign]
            self.policy.load_state_dict(policy_state)
            optimizer.load_state_dict(optimizer_state)
            np.random.set_state(saved[0])
            th.set_rng_state(saved[1])
            buffer._first_permutation, self._n_updates = saved[2], saved[3]
            self.policy.set_training_mode(saved[4])
            vars(self.policy.action_dist).update(distribution_state)
        return scores

    # ------------------------------------------------------------------ training
    def train(self) -> None:
        """Update the policy on the kept records of the rollout buffer (every record unless some were dropped)."""
        n_kept = int(self.rollout_buffer.flat_keep.sum())
        if n_kept == 0:
            warnings.warn(
                "Every record of this rollout was dropped (rollout_buffer.keep is all False): skipping this PPO "
                "update. Drop fewer records (e.g. a smaller IIFCallback fraction) to keep learning.",
                UserWarning,
            )
            self.logger.record("train/n_kept_records", 0)
            return
        super().train()
        self.logger.record("train/n_kept_records", n_kept)

    def learn(
        self: SelfInfluencePPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "InfluencePPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfInfluencePPO:
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
        )


def _cache_key(target: Target) -> Any:
    try:
        hash(target)
    except TypeError:
        return ("id", id(target))
    return ("target", target)


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
