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

This package is the one reader and the one writer of snapshots, one concept per module:

- :mod:`~sb3_influence.common.snapshots.reader`: :class:`Snapshot`, :func:`load_snapshot`, :func:`as_snapshot` and
  :class:`SnapshotError` (one file);
- :mod:`~sb3_influence.common.snapshots.runs`: :func:`load_all` and :func:`snapshot_files` (a folder, one run);
- :mod:`~sb3_influence.common.snapshots.frames`: :func:`load_snapshots` and :func:`snapshot_frame` (DataFrames);
- :mod:`~sb3_influence.common.snapshots.records`: :func:`record_arrays` and :func:`snapshot_metadata` (what is
  written);
- :mod:`~sb3_influence.common.snapshots.writer`: :func:`save_snapshot`, :func:`snapshot_path`,
  :func:`claim_save_dir` and :func:`remove_orphaned_temp_files`.

The readers serve the API, the analysis functions and the report alike. Files are written atomically
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

from sb3_influence.common.snapshots.reader import Snapshot, SnapshotError, as_snapshot, load_snapshot
from sb3_influence.common.snapshots.runs import ON_ERROR, load_all, run_key, snapshot_files
from sb3_influence.common.snapshots.frames import load_snapshots, snapshot_frame
from sb3_influence.common.snapshots.records import record_arrays, snapshot_metadata, vec_normalize_metadata
from sb3_influence.common.snapshots.writer import (
    ORPHAN_AGE,
    claim_save_dir,
    remove_orphaned_temp_files,
    save_snapshot,
    snapshot_path,
)

__all__ = [
    "ON_ERROR",
    "ORPHAN_AGE",
    "Snapshot",
    "SnapshotError",
    "as_snapshot",
    "claim_save_dir",
    "load_all",
    "load_snapshot",
    "load_snapshots",
    "record_arrays",
    "remove_orphaned_temp_files",
    "run_key",
    "save_snapshot",
    "snapshot_files",
    "snapshot_frame",
    "snapshot_metadata",
    "snapshot_path",
    "vec_normalize_metadata",
]
