"""
Attribution snapshots: one ``.npz`` file per scored round, written by ``AttributionCallback``.

File ``<save_dir>/<name_prefix>_<num_timesteps>_steps.npz`` holds, for the round's buffer of
``(n_steps, n_envs)`` records:

- ``influence/<target name>``: float64 scores, one array per target;
- the records: ``obs`` (``obs/<key>`` per key for Dict observations, as the policy sees them), ``action``,
  ``reward``, ``advantage`` (raw GAE), ``training_advantage`` (as normalised for the update), ``return``,
  ``value``, ``log_prob``, ``episode_start``, ``keep`` (after filtering), ``env``, ``step``;
- scalars ``round`` and ``num_timesteps``;
- ``metadata``: a JSON string (hyperparameters, seed, env id, targets, package versions, ``VecNormalize``
  statistics when present).

Files are written atomically (temporary file in the same folder, then ``os.replace``), so a crash never
leaves a corrupt snapshot behind. Loading never unpickles anything.
"""

import glob
import json
import os
import platform
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

if TYPE_CHECKING:
    import pandas as pd

    from sb3_influence.influence_ppo import InfluencePPO

# Record fields of a snapshot -> the rollout buffer field they come from
_BUFFER_FIELDS = {
    "reward": "rewards",
    "advantage": "advantages",
    "return": "returns",
    "value": "values",
    "log_prob": "log_probs",
    "episode_start": "episode_starts",
}
# Scalar columns of ``load_snapshots``, in order (influence, action and obs columns follow)
_COLUMNS = (
    "reward",
    "advantage",
    "training_advantage",
    "return",
    "value",
    "log_prob",
    "episode_start",
    "keep",
)


@dataclass
class Snapshot:
    """
    One loaded snapshot.

    :param arrays: Every array of the file by key (``metadata`` as the raw 0-d JSON string array).
    :param metadata: The decoded ``metadata`` JSON.
    :param path: The file it was read from.
    """

    arrays: dict[str, np.ndarray]
    metadata: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    @property
    def targets(self) -> list[str]:
        """Names of the targets scored in this snapshot."""
        return [key[len("influence/") :] for key in self.arrays if key.startswith("influence/")]

    @property
    def num_timesteps(self) -> int:
        """``model.num_timesteps`` when the round was scored."""
        return int(self.arrays["num_timesteps"])


def snapshot_path(save_dir: str, name_prefix: str, num_timesteps: int) -> str:
    """
    Where the snapshot of the round ending at ``num_timesteps`` goes.

    :param save_dir: The snapshot folder.
    :param name_prefix: The file name prefix.
    :param num_timesteps: ``model.num_timesteps`` at the end of the round's rollout.
    :return: ``<save_dir>/<name_prefix>_<num_timesteps>_steps.npz``
    """
    return os.path.join(save_dir, f"{name_prefix}_{num_timesteps}_steps.npz")


def round_index(model: "InfluencePPO") -> int:
    """
    0-based index of the round whose rollout the model's buffer holds (``num_timesteps`` counts every round's
    ``n_steps · n_envs`` transitions, so it survives ``learn(reset_num_timesteps=False)``).

    :param model: The model.
    :return: The round index.
    """
    return max(0, model.num_timesteps // (model.n_steps * model.n_envs) - 1)


def record_arrays(model: "InfluencePPO") -> dict[str, np.ndarray]:
    """
    The records of the model's current rollout buffer, each of shape ``(n_steps, n_envs, ...)``.

    :param model: An ``InfluencePPO`` with a full rollout buffer.
    :return: ``obs`` (or ``obs/<key>``), ``action``, ``reward``, ``advantage``, ``training_advantage``, ``return``,
        ``value``, ``log_prob``, ``episode_start``, ``keep``, ``env``, ``step``, ``round``, ``num_timesteps``.
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
    arrays["round"] = np.array(round_index(model), dtype=np.int64)
    arrays["num_timesteps"] = np.array(model.num_timesteps, dtype=np.int64)
    return arrays


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _running_stats(rms: Any) -> Any:
    if rms is None:
        return None
    if isinstance(rms, dict):
        return {key: _running_stats(value) for key, value in rms.items()}
    return {"mean": _jsonable(rms.mean), "var": _jsonable(rms.var), "count": float(rms.count)}


def vec_normalize_metadata(model: "InfluencePPO") -> dict[str, Any] | None:
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


def _env_id(model: "InfluencePPO") -> str | None:
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


def snapshot_metadata(model: "InfluencePPO", targets: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
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

    import sb3_influence

    config = {name: _jsonable(getattr(model, name, None)) for name in _HYPERPARAMETERS}
    config["policy_class"] = _jsonable(type(model.policy))
    config["policy_kwargs"] = _jsonable(model.policy_kwargs)
    config["algo"] = type(model).__name__
    metadata = {
        "config": config,
        "seed": model.seed,
        "env_id": _env_id(model),
        "n_envs": model.n_envs,
        "n_steps": model.n_steps,
        "targets": list(targets),
        "observation_space": repr(model.observation_space),
        "action_space": repr(model.action_space),
        "versions": {
            "sb3_influence": sb3_influence.__version__,
            "stable_baselines3": stable_baselines3.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "gymnasium": gymnasium.__version__,
            "python": platform.python_version(),
        },
        "vec_normalize": vec_normalize_metadata(model),
    }
    if extra:
        metadata.update(_jsonable(extra))
    return metadata


def save_snapshot(path: str, arrays: dict[str, np.ndarray], metadata: dict[str, Any]) -> str:
    """
    Write a snapshot atomically: to a temporary file in the same folder, then ``os.replace`` onto ``path``.

    :param path: The destination (should end with ``.npz``).
    :param arrays: The arrays to store; keys may contain ``/``.
    :param metadata: JSON-serialisable metadata.
    :return: ``path``
    """
    if "metadata" in arrays:
        raise ValueError("`arrays` must not contain the key 'metadata': pass it as `metadata`")
    folder = os.path.dirname(os.path.abspath(path))
    payload = {key: np.asarray(value) for key, value in arrays.items()}
    payload["metadata"] = np.array(json.dumps(_jsonable(metadata)))
    fd, tmp_path = tempfile.mkstemp(prefix=".tmp_", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            np.savez_compressed(file, **payload)  # type: ignore[arg-type]
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    return path


def load_snapshot(path: str) -> Snapshot:
    """
    Read one snapshot file.

    :param path: A ``.npz`` file written by ``AttributionCallback``.
    :return: A :class:`Snapshot` with ``.arrays`` and ``.metadata``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No snapshot file at {path!r}")
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    if "metadata" not in arrays or "keep" not in arrays:
        raise ValueError(f"{path!r} is not an attribution snapshot (no 'metadata' or 'keep' array)")
    # The raw JSON stays in ``arrays`` too, for readers that take a dict of arrays (sb3_influence.analysis)
    metadata = json.loads(str(arrays["metadata"]))
    return Snapshot(arrays=arrays, metadata=metadata, path=path)


def snapshot_files(path: str) -> list[str]:
    """
    The snapshot files at ``path`` (one file, or every ``.npz`` of a folder), sorted by ``num_timesteps``.

    :param path: A snapshot file or a folder of them.
    :return: The file paths.
    """
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No snapshot file or folder at {path!r}")
    files = [file for file in glob.glob(os.path.join(path, "*.npz")) if not os.path.basename(file).startswith(".tmp_")]
    if not files:
        raise FileNotFoundError(f"No snapshot (*.npz) in {path!r}: was AttributionCallback given save_dir={path!r}?")

    def num_timesteps(file: str) -> int:
        with np.load(file, allow_pickle=False) as data:
            return int(data["num_timesteps"])

    return sorted(files, key=lambda file: (num_timesteps(file), file))


def _column(values: np.ndarray, n_records: int) -> Any:
    """Flatten ``(n_steps, n_envs, ...)`` to record-id order; one scalar per row if the trailing size is 1."""
    flat = values.swapaxes(0, 1).reshape(n_records, -1)
    if flat.shape[1] == 1:
        return flat[:, 0]
    trailing = values.shape[2:]
    return [row.reshape(trailing) for row in flat]


def snapshot_frame(snapshot: Snapshot) -> "pd.DataFrame":
    """
    One snapshot as a DataFrame, one row per record in record-id order (``env · n_steps + step``).

    :param snapshot: A loaded snapshot.
    :return: The DataFrame (columns as in :func:`load_snapshots`).
    """
    import pandas as pd

    arrays = snapshot.arrays
    n_steps, n_envs = arrays["keep"].shape
    n_records = n_steps * n_envs
    columns: dict[str, Any] = {
        "round": np.full(n_records, int(arrays["round"]), dtype=np.int64),
        "num_timesteps": np.full(n_records, int(arrays["num_timesteps"]), dtype=np.int64),
        "env": _column(arrays["env"], n_records),
        "step": _column(arrays["step"], n_records),
    }
    columns["record_id"] = columns["env"] * n_steps + columns["step"]
    for name in _COLUMNS:
        columns[name] = _column(arrays[name], n_records)
    for target in snapshot.targets:
        columns[f"influence_{target}"] = _column(arrays[f"influence/{target}"], n_records)
    columns["action"] = _column(arrays["action"], n_records)
    for key in arrays:
        if key == "obs" or key.startswith("obs/"):
            columns[key] = _column(arrays[key], n_records)
    return pd.DataFrame(columns)


def load_snapshots(path: str) -> "pd.DataFrame":
    """
    Load attribution snapshots into one pandas DataFrame, one row per record.

    Columns: ``round, num_timesteps, env, step, record_id, reward, advantage, training_advantage, return, value,
    log_prob, episode_start, keep, influence_<target>...``, then ``action`` and ``obs`` (``obs/<key>`` for Dict
    observations): scalars when a record's value has a single element, else object columns holding arrays.
    ``df.attrs["metadata"]`` lists each file's metadata, in file order.

    :param path: A snapshot file or a folder of them (sorted by ``num_timesteps``).
    :return: The DataFrame.
    """
    import pandas as pd

    snapshots = [load_snapshot(file) for file in snapshot_files(path)]
    frame = pd.concat([snapshot_frame(snapshot) for snapshot in snapshots], ignore_index=True)
    frame.attrs["metadata"] = [snapshot.metadata for snapshot in snapshots]
    return frame
