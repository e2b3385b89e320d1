"""
Aggregate statistics across runs in the manner of rliable (Agarwal et al., "Deep RL at the Edge of the
Statistical Precipice", NeurIPS 2021): interquartile mean (IQM) and optimality gap of normalised scores with
stratified-bootstrap confidence intervals, performance profiles and the probability of improvement.

The point estimates are rliable's own functions (``rliable.metrics``). The bootstrap is written here in numpy,
following ``rliable.library.StratifiedBootstrap`` (runs resampled with replacement within each task, percentile
intervals): ``rliable.library`` imports ``arch``, whose 7.x releases (the ones rliable 1.2 accepts) do not import
under pandas 3.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from sb3_influence.bench.metrics import curve_mean
from sb3_influence.bench.protocol import ENVS
from sb3_influence.bench.summary import curve, figure
from sb3_influence.extras import import_optional

# A statistic of a score matrix (runs × tasks) -> a number
Statistic = Callable[[np.ndarray], float]


def _rliable_metrics() -> Any:
    return import_optional("rliable.metrics", "bench", "the aggregate statistics")


def normalized_score(result: dict[str, Any], env: str, kind: str = "curve", final_window: int = 5) -> float:
    """
    One run's score, normalised with the environment's ``score_range`` (0 = low end, 1 = high end).

    :param result: A run's result dict.
    :param env: A key of :data:`~sb3_influence.bench.harness.ENVS`.
    :param kind: ``"curve"``: mean test return over the rounds after round 0 (area under the learning curve: the
        speed measure, :func:`~sb3_influence.bench.metrics.curve_mean`); ``"final"``: mean of the last
        ``final_window`` evaluations.
    :param final_window: See ``kind``.
    :return: The normalised score.
    """
    if kind not in ("curve", "final"):
        raise ValueError(f"kind must be 'curve' or 'final', got {kind!r}")
    rounds, returns, _ = curve(result)
    value = curve_mean(rounds, returns) if kind == "curve" else returns[-final_window:].mean()
    low, high = ENVS[env].score_range
    return float((value - low) / (high - low))


def stratified_bootstrap_ci(
    scores: np.ndarray, statistic: Statistic, reps: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """
    Percentile interval of ``statistic`` under the stratified bootstrap: every replicate resamples the runs
    (rows) with replacement independently within each task (column).

    :param scores: Score matrix, runs × tasks.
    :param statistic: Function of a score matrix.
    :param reps: Bootstrap replicates.
    :param level: Confidence level.
    :param seed: Seed of the resampling.
    :return: ``(low, high)``.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"scores must be a non-empty runs × tasks matrix, got shape {scores.shape}")
    rng = np.random.default_rng(seed)
    n_runs, n_tasks = scores.shape
    columns = np.arange(n_tasks)
    values = np.empty(reps)
    for i in range(reps):
        rows = rng.integers(0, n_runs, size=(n_runs, n_tasks))
        values[i] = statistic(scores[rows, columns])
    alpha = (1 - level) / 2
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1 - alpha))


def aggregate_metrics(scores: dict[str, np.ndarray], reps: int = 2000, seed: int = 0) -> dict[str, dict[str, Any]]:
    """
    IQM and optimality gap (below 1) of each arm's normalised scores, with 95 % stratified-bootstrap CIs.

    :param scores: ``{arm: runs × tasks matrix}``.
    :param reps: Bootstrap replicates.
    :param seed: Seed of the resampling.
    :return: ``{arm: {"iqm": {"value", "ci"}, "optimality_gap": {"value", "ci"}}}``.
    """
    metrics = _rliable_metrics()
    statistics = {"iqm": metrics.aggregate_iqm, "optimality_gap": metrics.aggregate_optimality_gap}
    return {
        arm: {
            name: {"value": float(function(matrix)), "ci": stratified_bootstrap_ci(matrix, function, reps, seed=seed)}
            for name, function in statistics.items()
        }
        for arm, matrix in scores.items()
    }


def probability_of_improvement(x: np.ndarray, y: np.ndarray, reps: int = 2000, seed: int = 0) -> dict[str, Any]:
    """
    ``P(X > Y)`` averaged over tasks (rliable's ``probability_of_improvement``: the Mann-Whitney U statistic per
    task), with a 95 % CI from resampling the runs of ``x`` and ``y`` independently within each task.

    :param x: Scores of the arm claimed better, runs × tasks.
    :param y: Scores of the other arm, runs × tasks (same tasks).
    :param reps: Bootstrap replicates.
    :param seed: Seed of the resampling.
    :return: ``{"value", "ci"}``.
    """
    metrics = _rliable_metrics()
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must be runs × tasks matrices over the same tasks, got {x.shape} and {y.shape}")
    rng = np.random.default_rng(seed)
    columns = np.arange(x.shape[1])
    values = np.empty(reps)
    for i in range(reps):
        rows_x = rng.integers(0, x.shape[0], size=x.shape)
        rows_y = rng.integers(0, y.shape[0], size=y.shape)
        values[i] = metrics.probability_of_improvement(x[rows_x, columns], y[rows_y, columns])
    return {
        "value": float(metrics.probability_of_improvement(x, y)),
        "ci": (float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))),
    }


def performance_profile(scores: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """
    rliable's run-score distribution: the fraction of all runs (over tasks) whose normalised score exceeds each
    threshold ``tau``.

    :param scores: Score matrix, runs × tasks.
    :param taus: Thresholds.
    :return: One fraction per threshold.
    """
    flat = np.asarray(scores, dtype=np.float64).ravel()
    return np.array([(flat > tau).mean() for tau in np.asarray(taus)])


def plot_aggregates(
    aggregates: dict[str, dict[str, Any]],
    scores: dict[str, np.ndarray],
    labels: dict[str, str],
    colors: dict[str, str],
    path: str,
    title: str,
) -> None:
    """
    One figure: IQM and optimality gap with their CIs (left, middle) and the performance profiles (right).

    :param aggregates: From :func:`aggregate_metrics`.
    :param scores: The score matrices behind them.
    :param labels: Display name of each arm.
    :param colors: Colour of each arm.
    :param path: Output image.
    :param title: Figure title.
    """
    import os

    fig = figure((11, 2.8))
    axes = fig.subplots(1, 3)
    arms = list(aggregates)
    for ax, name in zip(axes[:2], ("iqm", "optimality_gap"), strict=True):
        for i, arm in enumerate(arms):
            low, high = aggregates[arm][name]["ci"]
            ax.barh(i, high - low, left=low, height=0.6, color=colors[arm], alpha=0.6)
            ax.plot([aggregates[arm][name]["value"]] * 2, [i - 0.3, i + 0.3], color="black")
        ax.set_yticks(range(len(arms)), [labels[arm] for arm in arms])
        ax.set_xlabel("IQM (normalised score)" if name == "iqm" else "optimality gap")
    taus = np.linspace(min(-0.1, min(float(m.min()) for m in scores.values())), 1.1, 101)
    for arm in arms:
        axes[2].plot(taus, performance_profile(scores[arm], taus), color=colors[arm], label=labels[arm])
    axes[2].set_xlabel("normalised score τ")
    axes[2].set_ylabel("fraction of runs > τ")
    axes[2].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
