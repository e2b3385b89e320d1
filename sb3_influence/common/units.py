"""
The units that scores, drop rules and snapshots can speak of: records or trajectories.

A *record* is one ``(step, env)`` entry of the rollout buffer (flat id ``env · n_steps + step``). A *trajectory*
is a maximal run of one env's records inside the buffer: from an episode start (or the buffer's first step) to
the step before the next episode start (or the buffer's last step); ``rollout_buffer.trajectory_ids()`` numbers
them 0, 1, ... in record-id order. Influence is additive in the records (the loss of a set is the sum of its
records' losses), so a trajectory's score is the sum of its records' scores, and a rule applied to trajectory
scores drops whole trajectories.
"""

import numpy as np

UNITS = ("record", "trajectory")

# How a filter's fraction sizes a drop of whole units: in records or in units
BUDGETS = ("records", "units")


def _check_choice(name: str, value: str, choices: tuple[str, ...], owner: str) -> str:
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
    return value


def check_unit(unit: str, owner: str) -> str:
    """
    Validate a ``unit`` argument.

    :param unit: ``"record"`` or ``"trajectory"``.
    :param owner: Who takes it (named in the error).
    :return: The unit.
    """
    return _check_choice("unit", unit, UNITS, owner)


def check_budget(budget: str, owner: str) -> str:
    """
    Validate a ``budget`` argument.

    :param budget: ``"records"`` or ``"units"``.
    :param owner: Who takes it (named in the error).
    :return: The budget.
    """
    return _check_choice("budget", budget, BUDGETS, owner)


def trajectory_sums(record_values: np.ndarray, trajectory_ids: np.ndarray) -> np.ndarray:
    """
    Per-trajectory sums of a per-record quantity (scores: influence is additive).

    :param record_values: Flat array indexed by record id.
    :param trajectory_ids: The trajectory of every record (``rollout_buffer.trajectory_ids()``).
    :return: Float64 array indexed by trajectory id.
    """
    record_values = np.asarray(record_values, dtype=np.float64).reshape(-1)
    trajectory_ids = np.asarray(trajectory_ids)
    if record_values.shape != trajectory_ids.shape:
        raise ValueError(f"{record_values.shape[0]} record values for {trajectory_ids.shape[0]} trajectory ids")
    return np.bincount(trajectory_ids, weights=record_values, minlength=int(trajectory_ids.max(initial=-1)) + 1)


def to_records(unit_values: np.ndarray, trajectory_ids: np.ndarray) -> np.ndarray:
    """
    Expand a per-trajectory array to its records (a drop mask of trajectories to a drop mask of records).

    :param unit_values: Array indexed by trajectory id.
    :param trajectory_ids: The trajectory of every record.
    :return: Flat array indexed by record id.
    """
    return np.asarray(unit_values)[np.asarray(trajectory_ids)]
