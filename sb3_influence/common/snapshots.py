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

**Runs.** Every snapshot's metadata carries the ``run_id`` of the model that wrote it (``model.run_id``, saved with
the model) and the run's layout (``seed``, ``n_envs``, ``n_steps``, ``name_prefix``). The folder readers load one
run: a folder holding several runs, or one round twice within a run, is refused with a :class:`SnapshotError`
that lists the runs (pick one with ``run_id=``, or pass ``allow_mixed=True``).

**Damaged files.** A file that cannot be read (empty, truncated, not a zip, failed CRC, missing arrays) raises a
:class:`SnapshotError` naming the file and the problem; ``on_error="skip"`` skips such files with a warning naming
each. Readable ``.npz`` files that are not snapshots (``evaluations.npz`` of an ``EvalCallback``...) found in a
folder are skipped with a warning.
"""

import errno
import json
import os
import platform
import tempfile
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

if TYPE_CHECKING:
    import pandas as pd

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


ON_ERROR = ("raise", "skip")
#: Temporary files of unfinished writes older than this (seconds) are orphans: their writer is gone
ORPHAN_AGE = 300.0


class SnapshotError(ValueError):
    """
    A snapshot file (or folder) that cannot be used as it is: the message names the file and what is wrong.

    :param path: The file or folder.
    :param problem: What is wrong with it, and how to fix it.
    :param foreign: True for a readable ``.npz`` that is simply not an attribution snapshot.
    """

    def __init__(self, path: str | os.PathLike, problem: str, foreign: bool = False):
        self.path = os.fspath(path)
        self.problem = problem
        self.foreign = foreign
        super().__init__(f"{self.path}: {problem}")


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
        metadata.update(_jsonable(extra))
    return metadata


def save_snapshot(path: str, arrays: dict[str, np.ndarray], metadata: dict[str, Any]) -> str:
    """
    Write a snapshot atomically: to a temporary file in the same folder, then ``os.replace`` onto ``path``.
    The file gets the mode a plain ``open()`` would give it (``0o666`` minus the umask). When the disk is full
    an ``OSError`` (``ENOSPC``) says so; nothing partial is left behind and earlier snapshots are untouched.

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
        # mkstemp creates 0600 files: give the snapshot the user's usual permissions
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
    except BaseException as error:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(
                error.errno,
                f"No space left on the device (or quota exceeded) while writing the snapshot {path}: it was not "
                f"written and no partial file is left; the snapshots already in {folder} are complete. Free some "
                "space or give AttributionCallback a save_dir on another disk",
            ) from error
        raise
    _fsync_folder(folder)
    return path


def _umask() -> int:
    """
    The process umask, read without changing it (``/proc/self/status`` on Linux). Elsewhere it falls back to
    ``os.umask`` set-and-restore, which changes the umask for an instant (racy only against threads that create
    files at that very moment).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: str) -> None:
    """Make the rename durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_orphaned_temp_files(folder: str | os.PathLike, min_age: float = ORPHAN_AGE) -> list[str]:
    """
    Remove the temporary files (``.tmp_*.npz``) that writes killed before their ``os.replace`` left in ``folder``.
    Only files untouched for ``min_age`` seconds are removed: a younger one may belong to a writer still running.

    :param folder: A snapshot folder (not searched recursively).
    :param min_age: Minimum age in seconds (by modification time).
    :return: The removed paths.
    """
    removed = []
    now = time.time()
    for file in sorted(Path(folder).glob(".tmp_*.npz")):
        try:
            if now - file.stat().st_mtime >= min_age:
                file.unlink()
                removed.append(str(file))
        except FileNotFoundError:  # its writer finished (or another cleaner removed it) meanwhile
            continue
    return removed


def _package_version() -> str:
    try:
        return importlib_metadata.version("sb3_influence")
    except importlib_metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def _read_npz(path: str, keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """
    The arrays of an ``.npz`` file (only ``keys`` when given, those present), every failure a :class:`SnapshotError`.
    """
    try:
        size = os.path.getsize(path)
    except OSError as error:
        raise SnapshotError(path, f"cannot be read ({error.strerror or error})") from error
    if size == 0:
        raise SnapshotError(path, "the file is empty (0 bytes): a copy or a write that never finished. Delete it")
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise SnapshotError(path, "is a single .npy array, not an .npz archive of attribution arrays", foreign=True)
        with data:
            names = data.files if keys is None else [key for key in keys if key in data.files]
            return {key: data[key] for key in names}
    except SnapshotError:
        raise
    except (zipfile.BadZipFile, EOFError, zlib.error, OSError, KeyError, ValueError, UnicodeDecodeError) as error:
        raise SnapshotError(
            path,
            f"is damaged: {_error_name(error)}: {error} (truncated, bit-flipped or not an .npz file). Delete it, "
            "or load the folder with on_error='skip' (sb3-influence report --skip-damaged)",
        ) from error


def _error_name(error: BaseException) -> str:
    name = type(error).__name__
    return f"{type(error).__module__}.{name}" if name == "error" else name  # zlib.error


def _decode_file_metadata(path: str, raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(str(np.asarray(raw).item()))
    except (ValueError, TypeError) as error:
        raise SnapshotError(path, f"its 'metadata' array is not valid JSON ({error}): the file is damaged") from error
    if not isinstance(value, dict):
        raise SnapshotError(path, f"its 'metadata' is a JSON {type(value).__name__}, not an object: the file is damaged")
    return value


def _check_snapshot_arrays(path: str, arrays: dict[str, np.ndarray]) -> None:
    if "metadata" not in arrays and "keep" not in arrays:
        raise SnapshotError(
            path,
            f"is not an attribution snapshot (no 'metadata' or 'keep' array; it holds {sorted(arrays)[:8]})",
            foreign=True,
        )
    missing = [key for key in ("metadata", "keep") if key not in arrays]
    if missing:
        raise SnapshotError(path, f"is incomplete: the array(s) {missing} are missing. Delete it")
    keep = arrays["keep"]
    if keep.ndim != 2 or keep.dtype != bool:
        raise SnapshotError(
            path, f"its 'keep' array must be boolean of shape (n_steps, n_envs), got {keep.dtype} {keep.shape}"
        )
    for key, value in arrays.items():
        if (key.startswith("influence/") or key in _COLUMNS) and value.shape[:2] != keep.shape:
            raise SnapshotError(path, f"its array {key!r} has shape {value.shape}, not the round's layout {keep.shape}")


def load_snapshot(path: str | os.PathLike) -> Snapshot:
    """
    Read one snapshot file.

    :param path: A ``.npz`` file written by ``AttributionCallback``.
    :return: A :class:`Snapshot` with ``.arrays`` and ``.metadata``.
    :raises SnapshotError: The file is empty, truncated, damaged or not an attribution snapshot (the message
        names the file and the problem).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No snapshot file at {path!r}")
    arrays = _read_npz(path)
    _check_snapshot_arrays(path, arrays)
    return Snapshot(arrays=arrays, metadata=_decode_file_metadata(path, arrays["metadata"]), path=path)


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


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(
            f"on_error must be one of {ON_ERROR} (skip: leave unreadable files out with a warning), got {on_error!r}"
        )


def _candidate_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"No snapshot file or folder at {str(root)!r}")
    files = sorted(file for file in root.rglob("*.npz") if _is_snapshot_name(file))
    if not files:
        raise FileNotFoundError(f"No snapshot (*.npz) in {str(root)!r}: was AttributionCallback given save_dir={str(root)!r}?")
    return files


def _scan(path: str | os.PathLike, on_error: str, read: Any, on_file: Callable[[int, int], None] | None = None) -> list[Any]:
    """``read(file)`` for each snapshot file at ``path``; foreign files skipped, damaged ones per ``on_error``;
    ``on_file(files looked at, files)`` after each."""
    _check_on_error(on_error)
    root = Path(path)
    files = _candidate_files(root)
    results = []
    for index, file in enumerate(files, 1):
        try:
            results.append(read(str(file)))
        except SnapshotError as error:
            if root.is_file():
                raise
            if error.foreign:
                warnings.warn(f"Skipping {error.path}: {error.problem}", UserWarning)
            elif on_error == "skip":
                warnings.warn(f"Skipping an unreadable snapshot: {error}", UserWarning)
            else:
                raise
        if on_file is not None:
            on_file(index, len(files))
    if not results:
        raise SnapshotError(root, "holds no readable attribution snapshot (see the warnings for the files skipped)")
    return results


def run_key(snapshot: Snapshot) -> str:
    """The ``run_id`` of the run a snapshot belongs to (``"unknown"`` for snapshots written without one)."""
    run_id = snapshot.metadata.get("run_id")
    return str(run_id) if run_id else "unknown"


def _describe_run(run_id: str, members: list[Snapshot]) -> str:
    metadata = members[0].metadata
    rounds = sorted(snapshot.round for snapshot in members)
    folders = sorted({os.path.dirname(snapshot.path) for snapshot in members})
    return (
        f"run_id={run_id} ({len(members)} snapshot(s), rounds {rounds[0]}..{rounds[-1]}, seed={metadata.get('seed')}, "
        f"n_envs={metadata.get('n_envs')}, n_steps={metadata.get('n_steps')}, name_prefix={metadata.get('name_prefix')!r}, "
        f"in {', '.join(folders)})"
    )


def _select_runs(where: str, snapshots: list[Snapshot], run_id: str | None, allow_mixed: bool) -> list[Snapshot]:
    """Group by run, keep the requested run(s) and refuse what cannot be told apart."""
    runs: dict[str, list[Snapshot]] = {}
    for snapshot in snapshots:
        runs.setdefault(run_key(snapshot), []).append(snapshot)
    if run_id is not None:
        if not isinstance(run_id, str) or not run_id:
            raise TypeError(f"run_id must be a run id string (or a unique prefix of one), got {run_id!r}")
        chosen = [key for key in runs if key == run_id] or [key for key in runs if key.startswith(run_id)]
        if len(chosen) != 1:
            listing = "; ".join(_describe_run(key, members) for key, members in runs.items())
            found = "matches none" if not chosen else f"matches {len(chosen)}"
            raise SnapshotError(where, f"run_id={run_id!r} {found} of the runs found here: {listing}")
        runs = {chosen[0]: runs[chosen[0]]}
    elif len(runs) > 1 and not allow_mixed:
        listing = "; ".join(_describe_run(key, members) for key, members in runs.items())
        raise SnapshotError(
            where,
            f"holds snapshots of {len(runs)} different runs, which cannot be mixed: {listing}. Load one with "
            "run_id='<id>' (sb3-influence report --run-id), point at the folder of one run, or pass allow_mixed=True "
            "(load_snapshots then adds a run_id column)",
        )
    for key, members in runs.items():
        by_round: dict[int, list[str]] = {}
        for snapshot in members:
            by_round.setdefault(snapshot.round, []).append(snapshot.path)
        duplicates = {round_: paths for round_, paths in by_round.items() if len(paths) > 1}
        if duplicates:
            round_, paths = min(duplicates.items())
            raise SnapshotError(
                where,
                f"run_id={key} holds round {round_} more than once ({', '.join(paths)}; {len(duplicates)} duplicated "
                "round(s) in all): "
                + (
                    "these snapshots carry no run id (written by an older sb3_influence), so several runs may have "
                    "written here"
                    if key == "unknown"
                    else "two trainings wrote the same run here (a model loaded from an older save?)"
                )
                + ". Move the snapshots of one of them to another folder",
            )
        layouts = {(snapshot.layout, snapshot.metadata.get("name_prefix")) for snapshot in members}
        if len(layouts) > 1:
            raise SnapshotError(
                where,
                f"run_id={key} holds rounds of different layouts (n_steps, n_envs), name_prefix: {sorted(layouts, key=str)}",
            )
    selected = [snapshot for members in runs.values() for snapshot in members]
    return sorted(selected, key=lambda snapshot: (run_key(snapshot), snapshot.round, snapshot.num_timesteps, snapshot.path))


def snapshot_files(
    path: str | os.PathLike, on_error: str = "raise", run_id: str | None = None, allow_mixed: bool = False
) -> list[str]:
    """
    The snapshot files at ``path`` (one file, or every ``.npz`` below a folder, searched recursively), sorted by
    the ``round`` stored in each, then ``num_timesteps``, then path. Temporary files of unfinished writes
    (``.tmp_*``) are never listed.

    :param path: A snapshot file or a folder of them.
    :param on_error: ``"raise"``: a damaged file raises :class:`SnapshotError`; ``"skip"``: it is left out with a
        warning naming it.
    :param run_id: Keep the snapshots of this run only (a unique prefix is enough).
    :param allow_mixed: Accept a folder holding several runs.
    :return: The file paths.
    """
    return [snapshot.path for snapshot in load_all(path, on_error=on_error, run_id=run_id, allow_mixed=allow_mixed)]


def load_all(
    snapshots: Any,
    on_error: str = "raise",
    run_id: str | None = None,
    allow_mixed: bool = False,
    on_file: Callable[[int, int], None] | None = None,
) -> list[Snapshot]:
    """
    Several snapshots, in round order.

    A folder must hold one run: several ``run_id`` s, or a round present twice within a run, raise a
    :class:`SnapshotError` listing the runs (unless ``run_id`` picks one, or ``allow_mixed=True``: then the runs
    come one after the other, each in round order).

    :param snapshots: A folder, a single file, a snapshot, or an iterable of anything :func:`as_snapshot` takes.
    :param on_error: For folders: ``"raise"`` (a damaged file raises :class:`SnapshotError`) or ``"skip"`` (left
        out with a warning naming it).
    :param run_id: For folders: keep the snapshots of this run only (a unique prefix is enough).
    :param allow_mixed: For folders: accept several runs.
    :param on_file: For folders: called as ``on_file(files read, files)`` after each file (to show progress).
    :return: The snapshots, sorted by ``(round, num_timesteps)``.
    """
    if isinstance(snapshots, (str, os.PathLike)):
        loaded = _scan(snapshots, on_error, load_snapshot, on_file)
        return _select_runs(os.fspath(snapshots), loaded, run_id, allow_mixed)
    if isinstance(snapshots, (dict, Snapshot)):
        return [as_snapshot(snapshots)]
    if not isinstance(snapshots, Iterable):
        raise TypeError(f"snapshots must be a folder, a file or a list of snapshots, got {type(snapshots).__name__}")
    loaded = [as_snapshot(snapshot) for snapshot in snapshots]
    return sorted(loaded, key=lambda snapshot: (snapshot.round, snapshot.num_timesteps))


def _peek(path: str) -> Snapshot:
    """A snapshot's ``round``, ``num_timesteps``, ``keep`` and metadata only (what the writer's folder check needs)."""
    arrays = _read_npz(path, keys=("metadata", "keep", "round", "num_timesteps"))
    _check_snapshot_arrays(path, arrays)
    return Snapshot(arrays=arrays, metadata=_decode_file_metadata(path, arrays["metadata"]), path=path)


def claim_save_dir(save_dir: str, run_id: str, layout: dict[str, Any], overwrite: bool = False) -> dict[int, str]:
    """
    Check that ``save_dir`` may receive the snapshots of run ``run_id`` (what ``AttributionCallback`` does before
    its first write): it must hold no snapshot of another run, nor of this run with another layout.

    :param save_dir: The snapshot folder (searched recursively, as the readers do).
    :param run_id: The writing model's ``run_id``.
    :param layout: ``n_envs``, ``n_steps`` and ``name_prefix`` of the writer.
    :param overwrite: Delete the conflicting snapshot files instead of raising.
    :return: The rounds of this run already in the folder, with their files (a resumed run continues after them).
    """
    conflicts: list[Snapshot] = []
    mine: dict[int, str] = {}
    root = Path(save_dir)
    for file in sorted(f for f in root.rglob("*.npz") if _is_snapshot_name(f)) if root.is_dir() else []:
        try:
            snapshot = _peek(str(file))
        except SnapshotError as error:
            if not error.foreign:
                warnings.warn(f"save_dir holds an unreadable snapshot, left as it is: {error}", UserWarning)
            continue
        theirs = {name: snapshot.metadata.get(name) for name in layout}
        if run_key(snapshot) == run_id and theirs == layout:
            mine[snapshot.round] = snapshot.path
        else:
            conflicts.append(snapshot)
    if conflicts and overwrite:
        for snapshot in conflicts:
            os.remove(snapshot.path)
    elif conflicts:
        runs: dict[str, list[Snapshot]] = {}
        for snapshot in conflicts:
            runs.setdefault(run_key(snapshot), []).append(snapshot)
        listing = "; ".join(_describe_run(key, members) for key, members in runs.items())
        same = run_id in runs
        raise ValueError(
            f"AttributionCallback: save_dir {save_dir!r} already holds {len(conflicts)} snapshot(s) of "
            + ("this run with another layout" if same and len(runs) == 1 else "another run")
            + f" ({listing}); this run is run_id={run_id} with {layout}. Snapshots of different runs cannot be mixed: "
            "give this run a new save_dir, pass AttributionCallback(overwrite=True) to delete those snapshot files, "
            "or resume the model that wrote them (InfluencePPO.load) with the same n_envs and name_prefix"
        )
    return mine


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


def load_snapshots(path: str, on_error: str = "raise", run_id: str | None = None, allow_mixed: bool = False) -> "pd.DataFrame":
    """
    Load attribution snapshots into one pandas DataFrame, one row per record.

    Columns: ``round, num_timesteps, env, step, record_id, trajectory_id, reward, advantage, training_advantage,
    return, value, log_prob, episode_start, keep, influence_<target>...``, then ``action``, ``action_mask`` (masked
    policies) and ``obs`` (``obs/<key>`` for Dict observations): scalars when a record's value has a single element,
    else object columns holding arrays. ``trajectory_id`` (absent from older snapshots) numbers the round's
    trajectories; :func:`sb3_influence.analysis.trajectory_frame` gives one row per ``(round, trajectory_id)``.
    ``df.attrs["metadata"]`` lists each file's metadata, in file order.

    A folder must hold one run (see :func:`load_all`), so ``(round, record_id)`` identifies a row; with
    ``allow_mixed=True`` a first column ``run_id`` is added and ``(run_id, round, record_id)`` does.

    :param path: A snapshot file or a folder of them (in round order).
    :param on_error: ``"raise"``: a damaged file raises :class:`SnapshotError`; ``"skip"``: it is left out with a
        warning naming it.
    :param run_id: Keep the snapshots of this run only (a unique prefix is enough).
    :param allow_mixed: Accept a folder holding several runs (adds the ``run_id`` column).
    :return: The DataFrame.
    """
    import pandas as pd

    snapshots = load_all(path, on_error=on_error, run_id=run_id, allow_mixed=allow_mixed)
    frames = [snapshot_frame(snapshot) for snapshot in snapshots]
    if allow_mixed:
        for snapshot, part in zip(snapshots, frames, strict=True):
            part.insert(0, "run_id", run_key(snapshot))
    frame = pd.concat(frames, ignore_index=True)
    frame.attrs["metadata"] = [snapshot.metadata for snapshot in snapshots]
    return frame
