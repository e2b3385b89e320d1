"""
Attribution snapshots: one ``.npz`` file per scored round, written by ``AttributionCallback``.

File ``<save_dir>/<name_prefix>_round<round:06d>_<num_timesteps>_steps.npz`` holds, for the round's buffer of
``(n_steps, n_envs)`` records (arrays in the buffer's ``(n_steps, n_envs, ...)`` layout):

- ``influence/<target name>``: float64 scores, one array per target;
- the records: ``obs`` (``obs/<key>`` per key for Dict observations, as the policy sees them), ``action``,
  ``reward``, ``advantage`` (raw GAE), ``training_advantage`` (as normalised for the update), ``return``,
  ``value``, ``log_prob``, ``episode_start``, ``keep`` (after filtering), ``env``, ``step``, ``trajectory_id`` (see
  ``rollout_buffer.trajectory_ids``) and, for masked policies, ``action_mask`` (1 for a valid choice);
- scalars ``round`` (the model's round counter, the same number as in the file name, DataFrames and logs)
  and ``num_timesteps``;
- ``metadata``: a JSON string (hyperparameters, seed, env id, targets, the filters that acted and their
  settings, package versions, ``VecNormalize`` statistics when present).

**Record order.** Every flat view (:meth:`Snapshot.flat`, :func:`load_snapshots` rows, the analysis functions,
the report) lists records by record id, ``env · n_steps + step``: SB3's own flattening of the rollout buffer.

This module is the one reader of snapshots: :func:`load_snapshot`, :func:`load_snapshots`, :func:`snapshot_files`
and :func:`as_snapshot` serve the API, the analysis functions and the report alike. Files are written atomically
(temporary file in the same folder, then ``os.replace``), so a crash never leaves a corrupt snapshot behind.
Loading never unpickles anything. Files named by the older scheme ``<prefix>_<num_timesteps>_steps.npz`` still
load; order always comes from the ``round`` stored inside, never from the name.
"""

import json
import os
import platform
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

if TYPE_CHECKING:
    import pandas as pd

    from sb3_influence.common.round import InfluenceRound

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
    :param path: The file it was read from (empty for a snapshot built from a dict of arrays).
    """

    arrays: dict[str, np.ndarray]
    metadata: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    @property
    def targets(self) -> list[str]:
        """Names of the targets scored in this snapshot, sorted."""
        return sorted(key[len("influence/") :] for key in self.arrays if key.startswith("influence/"))

    @property
    def num_timesteps(self) -> int:
        """``model.num_timesteps`` when the round was scored (-1 if unknown)."""
        return int(np.asarray(self.arrays.get("num_timesteps", -1)).reshape(-1)[0])

    @property
    def round(self) -> int:
        """The round number (-1 if unknown)."""
        return int(np.asarray(self.arrays.get("round", -1)).reshape(-1)[0])

    @property
    def layout(self) -> tuple[int, int]:
        """``(n_steps, n_envs)`` of the round's buffer."""
        for key in ("keep", *(f"influence/{name}" for name in self.targets)):
            if key in self.arrays:
                shape = np.shape(self.arrays[key])
                if len(shape) == 2:
                    return int(shape[0]), int(shape[1])
        raise ValueError(f"snapshot {self.path or '(arrays)'} has no (n_steps, n_envs) array ('keep' or 'influence/<target>')")

    @property
    def n_records(self) -> int:
        """Number of records of the round."""
        n_steps, n_envs = self.layout
        return n_steps * n_envs

    def flat(self, name: str) -> np.ndarray:
        """
        A per-record array in record-id order (``env · n_steps + step``), shape ``(n_records, ...)``.

        :param name: The array's key (``influence/return``, ``advantage``, ``obs``...).
        :return: The flattened array.
        """
        if name not in self.arrays:
            raise KeyError(f"snapshot {self.path or '(arrays)'} has no array {name!r}; it holds {sorted(self.arrays)}")
        values = np.asarray(self.arrays[name])
        n_steps, n_envs = self.layout
        if values.shape[:2] != (n_steps, n_envs):
            raise ValueError(f"array {name!r} has shape {values.shape}, not the round's layout ({n_steps}, {n_envs}, ...)")
        return values.swapaxes(0, 1).reshape(n_steps * n_envs, *values.shape[2:])

    def influence_key(self, target: str | None = None) -> str:
        """
        The ``influence/<target>`` key to read, checking that it exists.

        :param target: Target name; ``None`` picks ``"return"`` when present, else the only target.
        :return: The key.
        """
        names = self.targets
        if not names:
            raise ValueError(
                "snapshot holds no influence scores (no 'influence/<target>' key): was it written by AttributionCallback?"
            )
        if target is None:
            target = "return" if "return" in names else names[0]
        if target not in names:
            raise ValueError(f"target {target!r} is not in this snapshot; it holds {names}. Pass one of these as `target`.")
        return f"influence/{target}"

    def scores(self, target: str | None = None) -> np.ndarray:
        """
        The influence scores on ``target`` in record-id order, float64.

        :param target: Target name (see :meth:`influence_key`).
        :return: Shape ``(n_records,)``.
        """
        return self.flat(self.influence_key(target)).astype(np.float64)

    def observations(self) -> np.ndarray:
        """
        The observations as floats of shape ``(n_records, features)`` in record-id order (Dict observations:
        concatenated in key order).

        :return: 2-D float array.
        """
        if "obs" in self.arrays:
            keys = ["obs"]
        else:
            keys = sorted(key for key in self.arrays if key.startswith("obs/"))
            if not keys:
                raise ValueError("snapshot holds no observations ('obs' or 'obs/<key>')")
        return np.concatenate([self.flat(key).astype(np.float64).reshape(self.n_records, -1) for key in keys], axis=1)


def snapshot_path(save_dir: str, name_prefix: str, round_index: int, num_timesteps: int) -> str:
    """
    Where the snapshot of a round goes; names sort in round order under ``ls``.

    :param save_dir: The snapshot folder.
    :param name_prefix: The file name prefix.
    :param round_index: The round number.
    :param num_timesteps: ``model.num_timesteps`` at the end of the round's rollout.
    :return: ``<save_dir>/<name_prefix>_round<round:06d>_<num_timesteps>_steps.npz``
    """
    return os.path.join(save_dir, f"{name_prefix}_round{round_index:06d}_{num_timesteps}_steps.npz")


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


def _package_version() -> str:
    try:
        return importlib_metadata.version("sb3_influence")
    except importlib_metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def load_snapshot(path: str | os.PathLike) -> Snapshot:
    """
    Read one snapshot file.

    :param path: A ``.npz`` file written by ``AttributionCallback``.
    :return: A :class:`Snapshot` with ``.arrays`` and ``.metadata``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No snapshot file at {path!r}")
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    if "metadata" not in arrays or "keep" not in arrays:
        raise ValueError(f"{path!r} is not an attribution snapshot (no 'metadata' or 'keep' array)")
    return Snapshot(arrays=arrays, metadata=_decode_metadata(arrays["metadata"]), path=path)


def _decode_metadata(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(str(np.asarray(raw).item()))
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def as_snapshot(snapshot: Any) -> Snapshot:
    """
    What users hand the analysis functions, as a :class:`Snapshot`.

    :param snapshot: A path to a snapshot ``.npz``, a :class:`Snapshot`, or a dict of arrays.
    :return: The snapshot.
    """
    if isinstance(snapshot, Snapshot):
        return snapshot
    if isinstance(snapshot, (str, os.PathLike)):
        if not os.path.isfile(snapshot):
            raise ValueError(f"snapshot: {os.fspath(snapshot)!r} is not a file; pass the path of one snapshot .npz")
        return load_snapshot(snapshot)
    if isinstance(snapshot, dict):
        return Snapshot(arrays=snapshot, metadata=_decode_metadata(snapshot.get("metadata", "{}")))
    raise TypeError(
        f"snapshot must be a path to a snapshot .npz, the result of sb3_influence.load_snapshot or a dict of arrays, "
        f"got {type(snapshot).__name__}"
    )


def _is_snapshot_name(path: Path) -> bool:
    return path.suffix == ".npz" and not path.name.startswith(".tmp_")


def snapshot_files(path: str | os.PathLike) -> list[str]:
    """
    The snapshot files at ``path`` (one file, or every ``.npz`` below a folder, searched recursively), sorted by
    the ``round`` stored in each, then ``num_timesteps``, then path.

    :param path: A snapshot file or a folder of them.
    :return: The file paths.
    """
    root = Path(path)
    if root.is_file():
        return [str(root)]
    if not root.is_dir():
        raise FileNotFoundError(f"No snapshot file or folder at {str(root)!r}")
    files = sorted(file for file in root.rglob("*.npz") if _is_snapshot_name(file))
    if not files:
        raise FileNotFoundError(f"No snapshot (*.npz) in {str(root)!r}: was AttributionCallback given save_dir={str(root)!r}?")

    def order(file: Path) -> tuple[int, int, str]:
        with np.load(file, allow_pickle=False) as data:
            round_ = int(data["round"]) if "round" in data.files else -1
            steps = int(data["num_timesteps"]) if "num_timesteps" in data.files else -1
        return (round_, steps, str(file))

    return [str(file) for file in sorted(files, key=order)]


def load_all(snapshots: Any) -> list[Snapshot]:
    """
    Several snapshots, in round order.

    :param snapshots: A folder, a single file, a snapshot, or an iterable of anything :func:`as_snapshot` takes.
    :return: The snapshots, sorted by ``(round, num_timesteps)``.
    """
    if isinstance(snapshots, (str, os.PathLike)):
        return [load_snapshot(file) for file in snapshot_files(snapshots)]
    if isinstance(snapshots, (dict, Snapshot)):
        return [as_snapshot(snapshots)]
    if not isinstance(snapshots, Iterable):
        raise TypeError(f"snapshots must be a folder, a file or a list of snapshots, got {type(snapshots).__name__}")
    loaded = [as_snapshot(snapshot) for snapshot in snapshots]
    return sorted(loaded, key=lambda snapshot: (snapshot.round, snapshot.num_timesteps))


def _column(values: np.ndarray) -> Any:
    """One scalar per row when a record's value has a single element, else one array per row."""
    if values.ndim == 1:
        return values
    if int(np.prod(values.shape[1:])) == 1:
        return values.reshape(len(values))
    return list(values)


def snapshot_frame(snapshot: Snapshot) -> "pd.DataFrame":
    """
    One snapshot as a DataFrame, one row per record in record-id order (``env · n_steps + step``).

    :param snapshot: A loaded snapshot.
    :return: The DataFrame (columns as in :func:`load_snapshots`).
    """
    import pandas as pd

    n_steps, _ = snapshot.layout
    n_records = snapshot.n_records
    columns: dict[str, Any] = {
        "round": np.full(n_records, snapshot.round, dtype=np.int64),
        "num_timesteps": np.full(n_records, snapshot.num_timesteps, dtype=np.int64),
        "env": snapshot.flat("env"),
        "step": snapshot.flat("step"),
    }
    columns["record_id"] = columns["env"] * n_steps + columns["step"]
    if "trajectory_id" in snapshot.arrays:  # snapshots written before trajectories existed have none
        columns["trajectory_id"] = snapshot.flat("trajectory_id")
    for name in _COLUMNS:
        columns[name] = _column(snapshot.flat(name))
    for target in snapshot.targets:
        columns[f"influence_{target}"] = snapshot.flat(f"influence/{target}")
    columns["action"] = _column(snapshot.flat("action"))
    if "action_mask" in snapshot.arrays:
        columns["action_mask"] = _column(snapshot.flat("action_mask"))
    for key in snapshot.arrays:
        if key == "obs" or key.startswith("obs/"):
            columns[key] = _column(snapshot.flat(key))
    return pd.DataFrame(columns)


def load_snapshots(path: str) -> "pd.DataFrame":
    """
    Load attribution snapshots into one pandas DataFrame, one row per record.

    Columns: ``round, num_timesteps, env, step, record_id, trajectory_id, reward, advantage, training_advantage,
    return, value, log_prob, episode_start, keep, influence_<target>...``, then ``action``, ``action_mask`` (masked
    policies) and ``obs`` (``obs/<key>`` for Dict observations): scalars when a record's value has a single element,
    else object columns holding arrays. ``trajectory_id`` (absent from older snapshots) numbers the round's
    trajectories; :func:`sb3_influence.analysis.trajectory_frame` gives one row per ``(round, trajectory_id)``.
    ``df.attrs["metadata"]`` lists each file's metadata, in file order.

    :param path: A snapshot file or a folder of them (in round order).
    :return: The DataFrame.
    """
    import pandas as pd

    snapshots = load_all(path)
    frame = pd.concat([snapshot_frame(snapshot) for snapshot in snapshots], ignore_index=True)
    frame.attrs["metadata"] = [snapshot.metadata for snapshot in snapshots]
    return frame
