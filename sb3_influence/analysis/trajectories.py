"""Trajectory rows: one row per ``(round, trajectory_id)`` of attribution snapshots (see ``sb3_influence.common.units``)."""

from typing import TYPE_CHECKING, Any

from sb3_influence.common.snapshots import load_all, snapshot_frame

if TYPE_CHECKING:
    import pandas as pd


def trajectory_frame(snapshots: Any) -> "pd.DataFrame":
    """
    Aggregate the record rows of snapshots per ``(round, trajectory_id)``. Influence is additive, so a
    trajectory's ``influence_<target>`` is the sum of its records' scores (what ``compute_influence(...,
    unit="trajectory")`` and ``IIFCallback(unit="trajectory")`` rank).

    :param snapshots: A DataFrame from :func:`~sb3_influence.load_snapshots`, or anything it reads (a folder or
        a file), or a list of snapshots.
    :return: DataFrame with ``round, trajectory_id, num_timesteps, env, first_step, length, reward, advantage,
        training_advantage, kept_fraction, starts_episode, influence_<target>...`` (sums over the records, except
        ``kept_fraction``, the share of its records kept after filtering, and ``starts_episode``, True when the
        trajectory begins with an episode start rather than at the buffer's first step mid-episode).
    """
    import pandas as pd

    if isinstance(snapshots, pd.DataFrame):
        frame = snapshots
    else:
        frame = pd.concat([snapshot_frame(snapshot) for snapshot in load_all(snapshots)], ignore_index=True)
    if "trajectory_id" not in frame.columns:
        raise ValueError(
            "these snapshots have no trajectory_id column: they were written before trajectories were recorded; "
            "write new ones with AttributionCallback"
        )
    influence = [column for column in frame.columns if column.startswith("influence_")]
    frame = frame.sort_values(["round", "record_id"], kind="stable")
    grouped = frame.groupby(["round", "trajectory_id"], sort=True)
    rows = grouped.agg(
        num_timesteps=("num_timesteps", "first"),
        env=("env", "first"),
        first_step=("step", "min"),
        length=("step", "size"),
        reward=("reward", "sum"),
        advantage=("advantage", "sum"),
        training_advantage=("training_advantage", "sum"),
        kept_fraction=("keep", "mean"),
        starts_episode=("episode_start", "first"),
        **{column: (column, "sum") for column in influence},
    )
    return rows.reset_index()
