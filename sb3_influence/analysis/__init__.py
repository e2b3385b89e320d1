"""
The paper's three applications (Sec. 4: diagnosis, behaviour formation, intervention) and the HTML report.

- :mod:`~sb3_influence.analysis.diagnosis`: top/bottom records, exact and in-buffer Monte-Carlo advantages, the
  influence-advantage correlation;
- :mod:`~sb3_influence.analysis.formation`: behaviour formation across rounds, graph roughness;
- :mod:`~sb3_influence.analysis.intervention`: retrain a round without chosen records;
- :mod:`~sb3_influence.analysis.report`: ``sb3-influence report RUN_DIR``;
- :mod:`~sb3_influence.analysis.trajectories`: one row per ``(round, trajectory)`` of snapshots.

pandas and scipy (core requirements) and matplotlib (the ``analysis`` extra: the report, :func:`plot_phases`) are
imported inside the functions that need them; without matplotlib those functions say which extra installs it.
"""

from sb3_influence.analysis.diagnosis import (
    DiagnosisCallback,
    TabularValues,
    advantage_correlation,
    diagnose_tabular,
    monte_carlo_advantages,
    monte_carlo_returns,
    snapshot_diagnosis,
    tabular_true_advantages,
    top_bottom_records,
)
from sb3_influence.analysis.formation import behaviour_formation, graph_roughness, plot_phases, state_embeddings
from sb3_influence.analysis.intervention import InterventionCallback, drop_mask, intervene, target_value
from sb3_influence.analysis.report import build_report
from sb3_influence.analysis.trajectories import trajectory_frame

__all__ = [
    "DiagnosisCallback",
    "InterventionCallback",
    "TabularValues",
    "advantage_correlation",
    "behaviour_formation",
    "build_report",
    "diagnose_tabular",
    "drop_mask",
    "graph_roughness",
    "intervene",
    "monte_carlo_advantages",
    "monte_carlo_returns",
    "plot_phases",
    "snapshot_diagnosis",
    "state_embeddings",
    "tabular_true_advantages",
    "target_value",
    "top_bottom_records",
    "trajectory_frame",
]
