"""
The one writer of snapshot files: where a round's file goes (:func:`snapshot_path`), the atomic write
(:func:`save_snapshot`), the check that a folder may receive a run (:func:`claim_save_dir`) and the removal of
temporary files that killed writes left behind (:func:`remove_orphaned_temp_files`).
"""

import errno
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from sb3_influence.common.snapshots.reader import Snapshot, SnapshotError, peek_snapshot
from sb3_influence.common.snapshots.records import jsonable
from sb3_influence.common.snapshots.runs import describe_run, is_snapshot_name, run_key

#: Temporary files of unfinished writes older than this (seconds) are orphans: their writer is gone
ORPHAN_AGE = 300.0


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
    payload["metadata"] = np.array(json.dumps(jsonable(metadata)))
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


def claim_save_dir(save_dir: str, run_id: str, layout: dict[str, Any], overwrite: bool = False) -> dict[int, str]:
    """
    Check that ``save_dir`` may receive the snapshots of run ``run_id`` (what ``AttributionCallback`` does before
    its first write): it must hold no snapshot of another run, nor of this run with another layout.

    :param save_dir: The snapshot folder (searched recursively, as the readers do).
    :param run_id: The writing model's ``run_id``.
    :param layout: ``n_envs``, ``n_steps``, ``name_prefix`` and ``scorer`` of the writer (snapshots written before
        the scorer was recorded match any scorer).
    :param overwrite: Delete the conflicting snapshot files instead of raising.
    :return: The rounds of this run already in the folder, with their files (a resumed run continues after them).
    """
    conflicts: list[Snapshot] = []
    mine: dict[int, str] = {}
    root = Path(save_dir)
    for file in sorted(f for f in root.rglob("*.npz") if is_snapshot_name(f)) if root.is_dir() else []:
        try:
            snapshot = peek_snapshot(str(file))
        except SnapshotError as error:
            if not error.foreign:
                warnings.warn(f"save_dir holds an unreadable snapshot, left as it is: {error}", UserWarning)
            continue
        theirs = {name: snapshot.metadata.get(name) for name in layout}
        if "scorer" in layout and "scorer" not in snapshot.metadata:
            theirs["scorer"] = layout["scorer"]
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
        listing = "; ".join(describe_run(key, members) for key, members in runs.items())
        same = run_id in runs
        raise ValueError(
            f"AttributionCallback: save_dir {save_dir!r} already holds {len(conflicts)} snapshot(s) of "
            + ("this run with another layout" if same and len(runs) == 1 else "another run")
            + f" ({listing}); this run is run_id={run_id} with {layout}. Snapshots of different runs cannot be mixed: "
            "give this run a new save_dir, pass AttributionCallback(overwrite=True) to delete those snapshot files, "
            "or resume the model that wrote them (InfluencePPO.load) with the same n_envs, name_prefix and scorer"
        )
    return mine
