"""
What a snapshot holds: the records of the model's rollout buffer (:func:`record_arrays`) and the run's metadata
(:func:`snapshot_metadata`), made JSON-serialisable by :func:`jsonable`.
"""

import platform
from importlib import metadata as importlib_metadata
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

if TYPE_CHECKING:
    from sb3_influence.common.round import InfluenceRound

# Record fields of a snapshot -> the rollout buffer field they come from
_BUFFER_FIELDS = MappingProxyType(
    {
        "reward": "rewards",
        "advantage": "advantages",
        "return": "returns",
        "value": "values",
        "log_prob": "log_probs",
        "episode_start": "episode_starts",
    }
)


def record_arrays(model: Any, round_: "InfluenceRound") -> dict[str, np.ndarray]:
    """
    The records of the model's current rollout buffer, each of shape ``(n_steps, n_envs, ...)``.

    :param model: An ``InfluencePPO`` with a full rollout buffer.
    :param round_: The round the buffer belongs to.
    :return: ``obs`` (or ``obs/<key>``), ``action``, ``reward``, ``advantage``, ``training_advantage``, ``return``,
        ``value``, ``log_prob``, ``episode_start``, ``keep``, ``env``, ``step``, ``trajectory_id``, ``action_mask``
        (masked policies only), ``round``, ``num_timesteps``.
    """
    buffer = model.rollout_buffer
    arrays: dict[str, np.ndarray] = {}
    observations = buffer.flat_field("observations")
    if isinstance(observations, dict):
        for key, value in observations.items():
            arrays[f"obs/{key}"] = buffer.to_records(np.asarray(value))
    else:
        arrays["obs"] = buffer.to_records(np.asarray(observations))
    actions = buffer.to_records(np.asarray(buffer.flat_field("actions")))
    if isinstance(model.action_space, spaces.Discrete):
        actions = actions.reshape(buffer.buffer_size, buffer.n_envs).astype(np.int64)
    elif isinstance(model.action_space, (spaces.MultiDiscrete, spaces.MultiBinary)):
        actions = actions.astype(np.int64)
    arrays["action"] = actions
    for name, buffer_name in _BUFFER_FIELDS.items():
        arrays[name] = buffer.to_records(np.asarray(buffer.flat_field(buffer_name)).reshape(buffer.n_records))
    arrays["episode_start"] = arrays["episode_start"].astype(bool)
    arrays["training_advantage"] = model.training_advantages()
    arrays["keep"] = np.array(buffer.keep, dtype=bool, copy=True)
    steps, envs = np.indices((buffer.buffer_size, buffer.n_envs))
    arrays["env"] = envs.astype(np.int64)
    arrays["step"] = steps.astype(np.int64)
    arrays["trajectory_id"] = buffer.to_records(buffer.trajectory_ids())
    action_masks = buffer.record_action_masks(np.arange(buffer.n_records))
    if action_masks is not None:
        arrays["action_mask"] = buffer.to_records(np.asarray(action_masks) > 0.5)
    arrays["round"] = np.array(round_.index, dtype=np.int64)
    arrays["num_timesteps"] = np.array(model.num_timesteps, dtype=np.int64)
    return arrays


def jsonable(value: Any) -> Any:
    """
    A value as JSON can store it: numpy scalars and arrays as Python numbers and lists, classes by qualified name,
    anything else by its ``repr``.

    :param value: The value.
    :return: A JSON-serialisable value.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _running_stats(rms: Any) -> Any:
    if rms is None:
        return None
    if isinstance(rms, dict):
        return {key: _running_stats(value) for key, value in rms.items()}
    return {"mean": jsonable(rms.mean), "var": jsonable(rms.var), "count": float(rms.count)}


def vec_normalize_metadata(model: Any) -> dict[str, Any] | None:
    """
    The ``VecNormalize`` statistics of the model's env (``None`` if it is not normalised), enough to map the
    snapshot's normalised observations back to raw ones: ``raw = obs · sqrt(var + epsilon) + mean``.

    :param model: The model.
    :return: A JSON-serialisable dict, or ``None``.
    """
    vec_normalize = model.get_vec_normalize_env()
    if vec_normalize is None:
        return None
    return {
        "norm_obs": bool(vec_normalize.norm_obs),
        "norm_reward": bool(vec_normalize.norm_reward),
        "clip_obs": float(vec_normalize.clip_obs),
        "clip_reward": float(vec_normalize.clip_reward),
        "gamma": float(vec_normalize.gamma),
        "epsilon": float(vec_normalize.epsilon),
        "obs_rms": _running_stats(getattr(vec_normalize, "obs_rms", None)),
        "ret_rms": _running_stats(getattr(vec_normalize, "ret_rms", None)),
    }


def _env_id(model: Any) -> str | None:
    try:
        spec = model.get_env().get_attr("spec", indices=[0])[0]  # type: ignore[union-attr]
    except Exception:  # an env without the attribute, or a closed SubprocVecEnv
        return None
    return getattr(spec, "id", None)


_HYPERPARAMETERS = (
    "learning_rate",
    "n_steps",
    "batch_size",
    "n_epochs",
    "gamma",
    "gae_lambda",
    "clip_range",
    "clip_range_vf",
    "normalize_advantage",
    "ent_coef",
    "vf_coef",
    "max_grad_norm",
    "use_sde",
    "sde_sample_freq",
    "target_kl",
    "n_envs",
    "influence_batch_size",
    "influence_method",
)


def snapshot_metadata(model: Any, targets: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """
    The ``metadata`` of a snapshot.

    :param model: The model being scored.
    :param targets: Names of the scored targets.
    :param extra: Anything else to record (JSON-serialisable, or stored as its ``repr``).
    :return: A JSON-serialisable dict.
    """
    import gymnasium
    import stable_baselines3
    import torch

    config = {name: jsonable(getattr(model, name, None)) for name in _HYPERPARAMETERS}
    config["policy_class"] = jsonable(type(model.policy))
    config["policy_kwargs"] = jsonable(model.policy_kwargs)
    config["algo"] = type(model).__name__
    metadata = {
        "config": config,
        "run_id": getattr(model, "run_id", None),
        "seed": model.seed,
        "env_id": _env_id(model),
        "n_envs": model.n_envs,
        "n_steps": model.n_steps,
        "targets": list(targets),
        "observation_space": repr(model.observation_space),
        "action_space": repr(model.action_space),
        "versions": {
            "sb3_influence": _package_version(),
            "stable_baselines3": stable_baselines3.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "gymnasium": gymnasium.__version__,
            "python": platform.python_version(),
        },
        "vec_normalize": vec_normalize_metadata(model),
    }
    if extra:
        metadata.update(jsonable(extra))
    return metadata


def _package_version() -> str:
    try:
        return importlib_metadata.version("sb3_influence")
    except importlib_metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"
