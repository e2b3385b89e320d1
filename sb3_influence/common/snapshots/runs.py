"""
Folders of snapshots: scanning them (damaged and foreign files per ``on_error``), grouping by run and the
folder readers :func:`load_all` and :func:`snapshot_files`, which load one run in round order.
"""

import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sb3_influence.common.snapshots.reader import Snapshot, SnapshotError, as_snapshot, load_snapshot

ON_ERROR = ("raise", "skip")


def is_snapshot_name(path: Path) -> bool:
    """
    Whether a file may be a snapshot by its name: an ``.npz`` that is not the temporary file of a write.

    :param path: The file.
    :return: True for a candidate snapshot.
    """
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
    files = sorted(file for file in root.rglob("*.npz") if is_snapshot_name(file))
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


def describe_run(run_id: str, members: list[Snapshot]) -> str:
    """
    One run in an error message: its id, rounds, seed, layout and folders.

    :param run_id: The run's id (see :func:`run_key`).
    :param members: The run's snapshots (at least one).
    :return: The description.
    """
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
            listing = "; ".join(describe_run(key, members) for key, members in runs.items())
            found = "matches none" if not chosen else f"matches {len(chosen)}"
            raise SnapshotError(where, f"run_id={run_id!r} {found} of the runs found here: {listing}")
        runs = {chosen[0]: runs[chosen[0]]}
    elif len(runs) > 1 and not allow_mixed:
        listing = "; ".join(describe_run(key, members) for key, members in runs.items())
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
