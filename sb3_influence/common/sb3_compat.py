"""
Every private Stable-Baselines3 name this package relies on, in one place.

SB3 does not promise these names. ``tests/test_sb3_compat.py`` checks each one against the installed SB3 and
fails loudly, naming the attribute, when a release renames or removes it. Nothing else in the package, its tests,
benchmarks or scripts touches an underscore name of SB3; SB3's documented extension points (``_setup_model``,
``_excluded_save_params``, ``_init_callback``, ``_on_step``, ``_setup_learn``) are overridden where SB3 expects
subclasses to do so.
"""

from typing import Any

import torch as th
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.policies import ActorCriticPolicy

#: (owner, attribute) pairs used below; the compatibility test walks this list.
PRIVATE_NAMES = (
    (ActorCriticPolicy, "_get_action_dist_from_latent"),
    (MaskableActorCriticPolicy, "_get_action_dist_from_latent"),
    (BaseAlgorithm, "_update_learning_rate"),
    (BaseAlgorithm, "_setup_learn"),
    (BaseAlgorithm, "_update_current_progress_remaining"),
    (RolloutBuffer, "_get_samples"),
    (DictRolloutBuffer, "_get_samples"),
)
#: Instance attributes set by SB3's constructors (not visible on the classes).
PRIVATE_ATTRIBUTES = ("_n_updates", "_current_progress_remaining", "_total_timesteps", "_logger")


def action_distribution(policy: ActorCriticPolicy | MaskableActorCriticPolicy, latent_pi: th.Tensor) -> Distribution:
    """
    The action distribution for the actor's latent features (``ActorCriticPolicy._get_action_dist_from_latent``, or
    sb3-contrib's ``MaskableActorCriticPolicy._get_action_dist_from_latent``, unmasked).
    """
    return policy._get_action_dist_from_latent(latent_pi)


def update_learning_rate(model: Any, optimizer: th.optim.Optimizer) -> None:
    """Set the optimizer's learning rate from the schedule, as SB3's ``train()`` does first."""
    model._update_learning_rate(optimizer)


def progress_remaining(model: Any) -> float:
    """The training progress remaining (1 → 0) that schedules are evaluated at."""
    return model._current_progress_remaining


def n_updates(model: Any) -> int:
    """Number of gradient epochs run so far (``train/n_updates``)."""
    return int(model._n_updates)


def set_n_updates(model: Any, value: int) -> None:
    """Set the epoch counter (used when a replay or a restore puts the training state back)."""
    model._n_updates = int(value)


def buffer_samples(buffer: RolloutBuffer | DictRolloutBuffer, ids: Any) -> Any:
    """The samples tuple of the records ``ids`` of a flattened rollout buffer (``RolloutBuffer._get_samples``)."""
    return buffer._get_samples(ids)


def model_logger(model: Any) -> Logger | None:
    """The model's logger if one was set (``None`` before the first ``learn()``)."""
    return model.__dict__.get("_logger")


def set_model_logger(model: Any, logger: Logger | None) -> None:
    """Set (or with ``None``, remove) the model's logger."""
    if logger is None:
        model.__dict__.pop("_logger", None)
    else:
        model._logger = logger


def update_progress_remaining(model: Any) -> None:
    """Recompute the progress remaining from ``num_timesteps``, as ``learn()`` does after each rollout."""
    model._update_current_progress_remaining(model.num_timesteps, model._total_timesteps)


def setup_learn(model: Any, total_timesteps: int, reset_num_timesteps: bool = True) -> BaseCallback:
    """
    What ``learn()`` does before its first rollout (``BaseAlgorithm._setup_learn``: logger, environment reset,
    timestep counters, the round's bookkeeping of an influence algorithm), without training.

    :param model: An on-policy algorithm.
    :param total_timesteps: The ``learn()`` budget the schedules see.
    :param reset_num_timesteps: As in ``learn()``: ``False`` continues from the model's current step count.
    :return: The callback ``learn()`` would pass to ``collect_rollouts`` (no user callback: an empty list).
    """
    _, callback = model._setup_learn(total_timesteps, callback=None, reset_num_timesteps=reset_num_timesteps)
    return callback


def collect_rollout(model: Any, total_timesteps: int | None = None, reset_num_timesteps: bool = True) -> None:
    """
    Collect one rollout into the model's buffer (with its advantages) without training, as ``learn()`` would next.

    :param model: An on-policy algorithm.
    :param total_timesteps: The ``learn()`` budget the schedules see (default: one rollout).
    :param reset_num_timesteps: As in ``learn()``: ``False`` continues from the model's current step count.
    """
    total = model.n_steps * model.n_envs if total_timesteps is None else total_timesteps
    callback = setup_learn(model, total, reset_num_timesteps)
    callback.on_training_start(locals(), globals())
    if not model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=model.n_steps):
        raise RuntimeError("a callback stopped the rollout early; collect_rollout needs a full rollout")
