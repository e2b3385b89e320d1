"""Snapshots as pandas DataFrames, one row per record in record-id order: :func:`load_snapshots`."""

from typing import TYPE_CHECKING, Any

import numpy as np

from sb3_influence.common.snapshots.reader import SCALAR_COLUMNS, Snapshot
from sb3_influence.common.snapshots.runs import load_all, run_key

if TYPE_CHECKING:
    import pandas as pd


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
    for name in SCALAR_COLUMNS:
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
