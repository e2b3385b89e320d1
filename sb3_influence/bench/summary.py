"""Reading the runs back: metrics per seed, the results table and the learning-curve plots."""

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from sb3_influence.bench.harness import ARMS, ENVS
from sb3_influence.bench.metrics import bootstrap_ci, speedup_metrics


def load_runs(out: str, env: str) -> dict[str, dict[int, dict[str, Any]]]:
    """
    The complete runs of one benchmark: ``{arm: {seed: result}}``.

    :param out: Results directory.
    :param env: A key of :data:`ENVS`.
    :return: The results (incomplete runs are left out).
    """
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    directory = os.path.join(out, env)
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


def summarize(out: str, env: str, final_window: int = 5) -> dict[str, Any]:
    """
    Paired metrics of IIF and random filtering against PPO on one benchmark, per seed and aggregated (mean,
    standard error and 95 % percentile-bootstrap CI over seeds). Checks identical initial weights per seed.

    :param out: Results directory.
    :param env: A key of :data:`ENVS`.
    :param final_window: The final return is the mean of the last this-many evaluations.
    :return: ``{arm: {"per_seed": {...}, metric: {"mean", "se", "ci"}}}`` for the filtering arms.
    """
    runs = load_runs(out, env)
    summary: dict[str, Any] = {}
    for arm in ("iif", "random"):
        seeds = sorted(set(runs.get(arm, {})) & set(runs.get("ppo", {})))
        if not seeds:
            continue
        per_seed = {}
        for seed in seeds:
            base, new = runs["ppo"][seed], runs[arm][seed]
            if base["init_hash"] != new["init_hash"]:
                raise RuntimeError(f"{env} seed {seed}: ppo and {arm} did not start from the same initial weights")
            # CPU time when both runs have it (load-independent on a shared machine), else wall-clock time
            clock = "cpu_time" if time_key(base) == time_key(new) == "cpu_time" else "wall_time"
            rounds, ppo_ret, ppo_time = curve(base, clock)
            rounds_new, new_ret, new_time = curve(new, clock)
            if not np.array_equal(rounds, rounds_new):
                raise RuntimeError(f"{env} seed {seed}: ppo and {arm} were evaluated at different rounds")
            metrics: dict[str, Any] = speedup_metrics(rounds, ppo_ret, new_ret, ppo_time, new_time, ENVS[env].resolution)
            metrics["clock"] = clock
            metrics["final_gain"] = float(new_ret[-final_window:].mean() - ppo_ret[-final_window:].mean())
            metrics["auc_gain"] = float(new_ret[1:].mean() - ppo_ret[1:].mean())
            metrics["round_time_ratio"] = float(new_time[-1] / ppo_time[-1])
            per_seed[seed] = metrics
        entry: dict[str, Any] = {"per_seed": per_seed}
        for key in ("se_ave", "se_peak", "rt_peak", "final_gain", "auc_gain", "round_time_ratio"):
            values = np.array([m[key] for m in per_seed.values()], dtype=np.float64)
            finite = values[np.isfinite(values)]
            se = float(finite.std(ddof=1) / np.sqrt(len(finite))) if len(finite) > 1 else float("nan")
            entry[key] = {"mean": float(finite.mean()) if len(finite) else float("nan"), "se": se, "ci": bootstrap_ci(finite)}
        summary[arm] = entry
    return summary


def plot(out: str, env: str, path: str) -> None:
    """
    Learning curves (mean over seeds, shaded 95 % bootstrap CI of the mean) of every arm, saved to ``path``.

    :param out: Results directory.
    :param env: A key of :data:`ENVS`.
    :param path: Output image.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(out, env)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for arm, color in zip(ARMS, ("tab:blue", "tab:red", "tab:gray"), strict=True):
        if arm not in runs:
            continue
        curves = [curve(result) for result in runs[arm].values()]
        rounds = curves[0][0]
        returns = np.stack([c[1] for c in curves if np.array_equal(c[0], rounds)])
        mean = returns.mean(axis=0)
        low, high = np.array([bootstrap_ci(column, n_boot=2000) for column in returns.T]).T
        ax.plot(
            rounds, mean, color=color, label=f"{arm.upper() if arm != 'random' else 'random filter'} ({len(returns)} seeds)"
        )
        ax.fill_between(rounds, low, high, color=color, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test return (stochastic policy)")
    ax.set_title(f"{env} ({ENVS[env].env_id})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percent(entry: dict[str, Any]) -> str:
    if not np.isfinite(entry["mean"]):
        return "n/a"
    return f"{100 * entry['mean']:.1f} ± {100 * entry['se']:.1f} %"


def markdown_table(out: str, envs: Sequence[str]) -> str:
    """The results table of ``docs/benchmarks.md`` (IIF and random filtering vs PPO, mean ± s.e. over seeds)."""
    lines = [
        "| env | arm | seeds | SE_ave | SE_peak | RT_peak | final gain [95 % CI] | mean-curve gain | time vs PPO | clock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for env in envs:
        for arm, entry in summarize(out, env).items():
            gain, auc, ratio = entry["final_gain"], entry["auc_gain"], entry["round_time_ratio"]
            clocks = "/".join(sorted({m["clock"].replace("_time", "") for m in entry["per_seed"].values()}))
            lines.append(
                f"| {env} | {arm} | {len(entry['per_seed'])} | {_percent(entry['se_ave'])} | {_percent(entry['se_peak'])} | "
                f"{_percent(entry['rt_peak'])} | {gain['mean']:+.3g} [{gain['ci'][0]:+.3g}, {gain['ci'][1]:+.3g}] | "
                f"{auc['mean']:+.3g} | {ratio['mean']:.3f} | {clocks} |"
            )
    return "\n".join(lines)
