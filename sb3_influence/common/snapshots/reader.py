"""
The one reader of a snapshot file: :class:`Snapshot` (a round's arrays in record-id order), :func:`load_snapshot`
and :func:`as_snapshot` (what the analysis functions accept), and :class:`SnapshotError` for every file that
cannot be used. Loading never unpickles anything.
"""

import json
import os
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Scalar columns of ``load_snapshots``, in order (influence, action and obs columns follow)
SCALAR_COLUMNS = (
    "reward",
    "advantage",
    "training_advantage",
    "return",
    "value",
    "log_prob",
    "episode_start",
    "keep",
)


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
        if (key.startswith("influence/") or key in SCALAR_COLUMNS) and value.shape[:2] != keep.shape:
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


def peek_snapshot(path: str) -> Snapshot:
    """
    Read a snapshot's ``round``, ``num_timesteps``, ``keep`` and metadata only (what the writer's folder check needs).

    :param path: A snapshot file.
    :return: A :class:`Snapshot` holding those arrays.
    :raises SnapshotError: As :func:`load_snapshot`.
    """
    arrays = _read_npz(path, keys=("metadata", "keep", "round", "num_timesteps"))
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
