"""
Reading attribution snapshots for the analysis tools, whatever form the user hands them in.

A snapshot is one scored round (see ``AttributionCallback``): an ``.npz`` file with ``influence/<target>`` and
per-record arrays of shape ``(n_steps, n_envs, ...)``, the scalars ``round`` and ``num_timesteps`` and a JSON
``metadata`` string. The analysis functions accept a path to such a file, an object with ``.arrays`` (what
``sb3_influence.load_snapshot`` returns) or a plain dict of arrays.
"""

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

_STEPS_PATTERN = re.compile(r"_(\d+)_steps\.npz$")


def snapshot_arrays(snapshot: Any) -> dict[str, np.ndarray]:
    """
    The arrays of one snapshot as a dict.

    :param snapshot: Path to a snapshot ``.npz``, an object with an ``arrays`` dict, or a dict of arrays.
    :return: Key -> numpy array (``metadata`` stays a 0-d string array when present).
    """
    if isinstance(snapshot, (str, os.PathLike)):
        path = Path(snapshot)
        if not path.is_file():
            raise ValueError(f"snapshot: {str(path)!r} is not a file; pass the path of one snapshot .npz")
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    arrays = getattr(snapshot, "arrays", snapshot)
    if not isinstance(arrays, dict):
        raise TypeError(
            f"snapshot must be a path to a snapshot .npz, the result of sb3_influence.load_snapshot or a dict of "
            f"arrays, got {type(snapshot).__name__}"
        )
    return arrays


def snapshot_metadata(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """
    The decoded ``metadata`` JSON of a snapshot (``{}`` when absent or unreadable).

    :param arrays: The snapshot's arrays.
    :return: The metadata dict.
    """
    raw = arrays.get("metadata")
    if raw is None:
        return {}
    try:
        value = json.loads(str(np.asarray(raw).item()))
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def influence_key(arrays: dict[str, np.ndarray], target: str | None) -> str:
    """
    The ``influence/<target>`` key to read, checking that it exists.

    :param arrays: The snapshot's arrays.
    :param target: Target name; ``None`` picks ``"return"`` when present, else the only target.
    :return: The key.
    """
    names = target_names(arrays)
    if not names:
        raise ValueError(
            "snapshot holds no influence scores (no 'influence/<target>' key): was it written by AttributionCallback?"
        )
    if target is None:
        target = "return" if "return" in names else names[0]
    if target not in names:
        raise ValueError(f"target {target!r} is not in this snapshot; it holds {names}. Pass one of these as `target`.")
    return f"influence/{target}"


def target_names(arrays: dict[str, np.ndarray]) -> list[str]:
    """
    Names of the targets scored in a snapshot.

    :param arrays: The snapshot's arrays.
    :return: Sorted target names.
    """
    return sorted(key.split("/", 1)[1] for key in arrays if key.startswith("influence/"))


def snapshot_files(path: str | os.PathLike) -> list[Path]:
    """
    Snapshot files under ``path`` (searched recursively), sorted by the ``num_timesteps`` in their name.

    :param path: A snapshot file or a directory holding snapshots.
    :return: The files.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is neither a snapshot file nor a directory")
    files = [p for p in path.rglob("*.npz") if _STEPS_PATTERN.search(p.name)]

    def steps(p: Path) -> tuple[int, str]:
        match = _STEPS_PATTERN.search(p.name)
        return (int(match.group(1)) if match else 0, str(p))

    return sorted(files, key=steps)


def load_all(snapshots: Any) -> list[dict[str, np.ndarray]]:
    """
    Several snapshots as a list of array dicts, in round order.

    :param snapshots: A directory, a single file, or an iterable of anything :func:`snapshot_arrays` accepts.
    :return: The array dicts, sorted by ``num_timesteps`` when every snapshot has it.
    """
    if isinstance(snapshots, (str, os.PathLike)):
        files = snapshot_files(snapshots)
        if not files:
            raise ValueError(f"no snapshot (*_<num_timesteps>_steps.npz) found under {str(snapshots)!r}")
        return [snapshot_arrays(f) for f in files]
    if isinstance(snapshots, dict) or hasattr(snapshots, "arrays"):
        return [snapshot_arrays(snapshots)]
    if not isinstance(snapshots, Iterable):
        raise TypeError(f"snapshots must be a directory, a file or a list of snapshots, got {type(snapshots).__name__}")
    arrays = [snapshot_arrays(s) for s in snapshots]
    if arrays and all("num_timesteps" in a for a in arrays):
        arrays.sort(key=lambda a: int(a["num_timesteps"]))
    return arrays


def scalar(arrays: dict[str, np.ndarray], key: str, default: float = float("nan")) -> float:
    """
    A scalar entry of a snapshot (``round``, ``num_timesteps``) as a float.

    :param arrays: The snapshot's arrays.
    :param key: The key.
    :param default: Returned when the key is absent.
    :return: The value.
    """
    if key not in arrays:
        return default
    return float(np.asarray(arrays[key]).reshape(-1)[0])


def observations(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """
    The records' observations flattened to ``(n_records, features)`` floats (Dict observations: concatenated
    in key order), in the same record order as ``arrays["influence/..."].reshape(-1)``.

    :param arrays: The snapshot's arrays.
    :return: 2-D float array.
    """
    if "obs" in arrays:
        parts = [arrays["obs"]]
    else:
        keys = sorted(k for k in arrays if k.startswith("obs/"))
        if not keys:
            raise ValueError("snapshot holds no observations ('obs' or 'obs/<key>')")
        parts = [arrays[k] for k in keys]
    n = int(np.prod(parts[0].shape[:2]))
    return np.concatenate([np.asarray(p, dtype=np.float64).reshape(n, -1) for p in parts], axis=1)
