"""Reading the runs back: metrics per seed and per cell, the results tables and the learning-curve plots."""

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from sb3_influence.bench.protocol import ARMS, ENVS, cell_name
from sb3_influence.bench.metrics import bootstrap_ci, curve_mean, speedup_metrics
from sb3_influence.extras import import_optional


def figure(figsize: tuple[float, float]) -> Any:
    """
    A matplotlib figure for a benchmark plot (the ``bench`` extra), made without pyplot: it is only saved to a file,
    and the backend of the caller's session is left alone.

    :param figsize: Width and height in inches.
    :return: The ``matplotlib.figure.Figure``.
    """
    return import_optional("matplotlib.figure", "bench", "the benchmark plots").Figure(figsize=figsize)


def same_start(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """
    Whether two result files' runs started from the same initial weights: the same parameter hash, or, where both
    store a fingerprint (``init_fingerprint``), the same one up to float32 rounding. The same seed gives the same
    weights on every machine only up to a few ulps (torch's kernels differ by CPU instruction set: up to 3e-6 on
    LunarLander's MLP between AVX2 and the generic kernels), which changes the hash but not the start.
    """
    if a.get("init_hash") == b.get("init_hash"):
        return True
    if "init_fingerprint" not in a or "init_fingerprint" not in b or len(a["init_fingerprint"]) != len(b["init_fingerprint"]):
        return False
    return bool(np.allclose(a["init_fingerprint"], b["init_fingerprint"], rtol=1e-4, atol=1e-4))


def cell_directory(out: str, env: str, setting: str | None = None, variants: Sequence[str] = ()) -> str:
    """The folder of a cell's result files: ``<out>/<env>/<setting>[+variants]``, or ``<out>/<env>`` for the
    legacy layout (``setting=None``: ``benchmarks/results/legacy``)."""
    return os.path.join(out, env) if setting is None else os.path.join(out, env, cell_name(setting, variants))


def load_runs(directory: str) -> dict[str, dict[int, dict[str, Any]]]:
    """
    The complete runs of one cell: ``{arm: {seed: result}}``.

    :param directory: The cell's folder (:func:`cell_directory`).
    :return: The results (incomplete runs are left out).
    """
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    if not os.path.isdir(directory):
        return runs
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as file:
                result = json.load(file)
            if result.get("complete"):
                runs.setdefault(result["config"]["arm"], {})[result["config"]["seed"]] = result
    return runs


def time_key(result: dict[str, Any]) -> str:
    """``"cpu_time"`` when every row of the run has a finite process CPU time, else ``"wall_time"``."""
    cpu = [row.get("cpu_time") for row in result["rows"]]
    return "cpu_time" if all(c is not None and np.isfinite(c) for c in cpu) else "wall_time"


def curve(result: dict[str, Any], clock: str = "wall_time") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, eval_returns, cumulative time)`` at the evaluated rounds of one run; ``clock`` is the row key
    of the time (``"wall_time"`` or ``"cpu_time"``)."""
    rows = [row for row in result["rows"] if row["eval_return"] is not None]
    return (
        np.array([r["round"] for r in rows]),
        np.array([r["eval_return"] for r in rows]),
        np.array([r[clock] for r in rows]),
    )


def _aggregate(values: Sequence[float]) -> dict[str, Any]:
    array = np.asarray(values, dtype=np.float64)
    finite = array[np.isfinite(array)]
    se = float(finite.std(ddof=1) / np.sqrt(len(finite))) if len(finite) > 1 else float("nan")
    return {"mean": float(finite.mean()) if len(finite) else float("nan"), "se": se, "ci": bootstrap_ci(finite)}


def summarize(directory: str, env: str, final_window: int = 5) -> dict[str, Any]:
    """
    Paired metrics of every filtering arm against PPO in one cell, per seed and aggregated (mean, standard error
    and 95 % percentile-bootstrap CI over seeds). Checks identical initial weights per seed.

    :param directory: The cell's folder (:func:`cell_directory`).
    :param env: A key of :data:`~sb3_influence.bench.harness.ENVS` (for the return resolution).
    :param final_window: The final return is the mean of the last this-many evaluations.
    :return: ``{arm: {"per_seed": {...}, metric: {"mean", "se", "ci"}}}`` for the arms with a PPO seed to pair.
    """
    runs = load_runs(directory)
    summary: dict[str, Any] = {}
    for arm in [name for name in runs if name != "ppo"]:
        seeds = sorted(set(runs[arm]) & set(runs.get("ppo", {})))
        if not seeds:
            continue
        per_seed = {}
        for seed in seeds:
            base, new = runs["ppo"][seed], runs[arm][seed]
            if not same_start(base, new):
                raise RuntimeError(f"{directory} seed {seed}: ppo and {arm} did not start from the same initial weights")
            # CPU time when both runs have it (load-independent on a shared machine), else wall-clock time
            clock = "cpu_time" if time_key(base) == time_key(new) == "cpu_time" else "wall_time"
            rounds, ppo_ret, ppo_time = curve(base, clock)
            rounds_new, new_ret, new_time = curve(new, clock)
            if not np.array_equal(rounds, rounds_new):
                raise RuntimeError(f"{directory} seed {seed}: ppo and {arm} were evaluated at different rounds")
            metrics: dict[str, Any] = speedup_metrics(rounds, ppo_ret, new_ret, ppo_time, new_time, ENVS[env].resolution)
            metrics["clock"] = clock
            metrics["final_gain"] = float(new_ret[-final_window:].mean() - ppo_ret[-final_window:].mean())
            metrics["auc_gain"] = curve_mean(rounds, new_ret) - curve_mean(rounds, ppo_ret)
            metrics["round_time_ratio"] = float(new_time[-1] / ppo_time[-1])
            per_seed[seed] = metrics
        entry: dict[str, Any] = {"per_seed": per_seed}
        for key in ("se_ave", "se_peak", "rt_peak", "final_gain", "auc_gain", "round_time_ratio"):
            entry[key] = _aggregate([m[key] for m in per_seed.values()])
        summary[arm] = entry
    return summary


def plot(directory: str, env: str, path: str, title: str | None = None) -> bool:
    """
    Learning curves (mean over seeds, shaded 95 % bootstrap CI of the mean) of every arm of one cell.

    :param directory: The cell's folder (:func:`cell_directory`).
    :param env: A key of :data:`~sb3_influence.bench.harness.ENVS`.
    :param path: Output image.
    :param title: Plot title (default: the environment).
    :return: Whether a plot was written (``False`` when the cell has no complete run).
    :raises ValueError: When the runs of one arm were evaluated at different rounds (a mean curve needs one
        schedule; no seed is left out silently).
    """
    runs = load_runs(directory)
    if not runs:
        return False
    fig = figure((5, 3.2))
    ax = fig.subplots()
    for arm, spec in ARMS.items():
        if arm not in runs:
            continue
        curves = {seed: curve(result) for seed, result in runs[arm].items()}
        first = min(curves)
        rounds = curves[first][0]
        other = sorted(seed for seed, c in curves.items() if not np.array_equal(c[0], rounds))
        if other:
            raise ValueError(
                f"{directory}: the {arm} runs of seeds {other} were evaluated at other rounds than seed {first}'s, "
                "so their mean curve is undefined; rerun those seeds under the cell's current schedule, or add the "
                "missing evaluations by a checked replay (benchmarks/add_early_evaluations.py)"
            )
        returns = np.stack([c[1] for c in curves.values()])
        low, high = np.array([bootstrap_ci(column, n_boot=2000) for column in returns.T]).T
        ax.plot(rounds, returns.mean(axis=0), color=spec.color, label=f"{spec.label} ({len(returns)} seeds)")
        ax.fill_between(rounds, low, high, color=spec.color, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test return (stochastic policy)")
    ax.set_title(title or f"{env} ({ENVS[env].env_id})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def percent(entry: dict[str, Any]) -> str:
    """``"mean ± se %"`` of an aggregated fraction, ``"n/a"`` when there is none."""
    if not np.isfinite(entry["mean"]):
        return "n/a"
    se = f" ± {100 * entry['se']:.1f}" if np.isfinite(entry["se"]) else ""
    return f"{100 * entry['mean']:.1f}{se} %"


def markdown_table(cells: Sequence[tuple[str, str, str]]) -> str:
    """
    The results table: every filtering arm against PPO (mean ± s.e. over seeds) in each cell.

    :param cells: ``(label, directory, env)`` of each cell.
    :return: A Markdown table, one line per cell and arm.
    """
    lines = [
        "| cell | arm | seeds | SE_ave | SE_peak | RT_peak | final gain [95 % CI] | mean-curve gain | time vs PPO | clock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, directory, env in cells:
        for arm, entry in summarize(directory, env).items():
            gain, auc, ratio = entry["final_gain"], entry["auc_gain"], entry["round_time_ratio"]
            clocks = "/".join(sorted({m["clock"].replace("_time", "") for m in entry["per_seed"].values()}))
            lines.append(
                f"| {label} | {arm} | {len(entry['per_seed'])} | {percent(entry['se_ave'])} | {percent(entry['se_peak'])} | "
                f"{percent(entry['rt_peak'])} | {gain['mean']:+.3g} [{gain['ci'][0]:+.3g}, {gain['ci'][1]:+.3g}] | "
                f"{auc['mean']:+.3g} | {ratio['mean']:.3f} | {clocks} |"
            )
    return "\n".join(lines)
