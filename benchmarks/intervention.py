"""
Targeted intervention at the paper's scale (Sec. 4.3, Fig. 5 and Fig. 11).

For each env × seed, PPO trains with the paper's protocol (``sb3_influence.bench``: 2048 records per round, SGD
5e-3, no gradient clipping). At the scheduled rounds, :func:`sb3_influence.analysis.intervene` retrains the round
from θ(k) three times — on every record (what PPO does), without every record of negative influence on
``f_return``, and without a random set of the same size — and measures the test return of each (stochastic policy;
exact on FrozenLake, 100 episodes elsewhere, the same episode seeds for every arm) and of θ(k) itself. Training
goes on with PPO's own update, untouched.

One result file per env × seed (``benchmarks/results/intervention/<env>_seed<k>.json``), rewritten after every
scheduled round; a complete file is skipped on a re-run, an incomplete one (a killed run) is redone.

    OMP_NUM_THREADS=1 nice python benchmarks/intervention.py --envs FrozenLake Acrobot MiniGrid LunarLander --seeds 0 1 2
    python benchmarks/intervention.py --summary    # docs/_static/img/intervention_*.png and the docs table
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "intervention"
DOCS = Path(__file__).parent.parent / "docs"
EPISODES = 100
# Rounds intervened at (0 = the first rollout): as many as the CPU budget allows, spread over the learning phase
SCHEDULE = {
    "FrozenLake": tuple(range(0, 20)),
    "Acrobot": tuple(range(0, 50, 6)),
    "MiniGrid": tuple(range(0, 40, 8)),
    "LunarLander": tuple(range(0, 60, 15)),
}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def run(env: str, seed: int, path: Path) -> dict[str, Any]:
    from sb3_influence.analysis import InterventionCallback
    from sb3_influence.bench import ENVS
    from sb3_influence.bench.evaluation import evaluate, make_eval_env
    from sb3_influence.bench.harness import make_model

    spec = ENVS[env]
    schedule = SCHEDULE[env]
    eval_seed = 10_000 + seed
    eval_env = make_eval_env(spec, EPISODES, eval_seed)
    start, cpu = time.time(), time.process_time()
    data: dict[str, Any] = {
        "env": env,
        "seed": seed,
        "schedule": list(schedule),
        "episodes": "exact" if spec.exact_eval else EPISODES,
        "rounds": [],
        "complete": False,
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count()},
    }

    class Writer(InterventionCallback):
        def _on_round(self, index: int) -> None:
            super()._on_round(index)
            table = self.results[-1].set_index("arm")
            data["rounds"].append(
                {
                    "round": index,
                    "n_dropped": int(table.loc["negatives", "n_dropped"]),
                    "return_start": float(table.loc["none", "test_return_start"]),
                    **{f"return_{arm}": float(table.loc[arm, "test_return"]) for arm in table.index},
                    **{f"delta_target_{arm}": float(table.loc[arm, "delta_target"]) for arm in table.index},
                }
            )
            data.update(wall_s=time.time() - start, cpu_s=time.process_time() - cpu)
            _write(path, data)
            last = data["rounds"][-1]
            print(
                f"{env} seed {seed} round {index}: start {last['return_start']:.3f}, PPO {last['return_none']:.3f}, "
                f"-neg {last['return_negatives']:.3f}, random {last['return_random']:.3f}",
                flush=True,
            )

    def evaluator(model: Any) -> float:
        return evaluate(model, spec, EPISODES, eval_seed, eval_env)

    model = make_model(spec, seed, "sgd")
    callback = Writer(rounds=schedule, arms=["negatives", "random"], evaluator=evaluator, seed=seed)
    model.learn((max(schedule) + 1) * model.n_steps * model.n_envs, callback=callback)
    data.update(complete=True, wall_s=time.time() - start, cpu_s=time.process_time() - cpu)
    _write(path, data)
    return data


def _bootstrap_ci(values: np.ndarray, rng: np.random.Generator, n: int = 2000) -> tuple[float, float]:
    if values.size < 2:
        return float("nan"), float("nan")
    means = rng.choice(values, size=(n, values.size), replace=True).mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def summary() -> None:
    (DOCS / "guide" / "generated").mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sb3_influence.bench import PPO_KWARGS

    rng = np.random.default_rng(0)
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(RESULTS.glob("*_seed*.json")):
        data = json.loads(path.read_text())
        runs.setdefault(data["env"], []).append(data)
    envs = [env for env in SCHEDULE if env in runs]
    if not envs:
        print("no result files")
        return
    lines = [
        "<!-- generated by: python benchmarks/intervention.py --summary -->",
        "",
        "| env | seeds | rounds | drop negatives beats PPO | random drop beats PPO | PPO's own update improves | "
        "negatives beat PPO where PPO improves | where PPO does not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    failure = [
        "",
        "Rounds split by whether PPO's own update raised the test return over θ(k) (medians over those rounds): the "
        "share of records with negative influence, and what dropping them did to `f_return` and to the test return.",
        "",
        "| env | PPO's update | rounds | negative share | Δ f_return (drop negatives) | Δ test return (drop negatives) |",
        "|---|---|---|---|---|---|",
    ]
    figure, axes = plt.subplots(1, len(envs), figsize=(4.2 * len(envs), 3.4), constrained_layout=True, squeeze=False)
    for axis, env in zip(axes[0], envs, strict=True):
        rows = [row for data in runs[env] for row in data["rounds"]]
        by_round: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            by_round.setdefault(row["round"], []).append(row)
        rounds = sorted(by_round)
        for arm, color, label in (("negatives", "tab:red", "drop negatives"), ("random", "tab:gray", "random drop")):
            deltas = [np.array([r[f"return_{arm}"] - r["return_none"] for r in by_round[k]]) for k in rounds]
            means = np.array([d.mean() for d in deltas])
            cis = np.array([_bootstrap_ci(d, rng) for d in deltas])
            axis.plot(rounds, means, marker="o", ms=3, color=color, label=label)
            axis.fill_between(rounds, cis[:, 0], cis[:, 1], color=color, alpha=0.2)
        gain = [np.mean([r["return_none"] - r["return_start"] for r in by_round[k]]) for k in rounds]
        axis.plot(rounds, gain, ls="--", color="tab:blue", lw=1, label="PPO's own update (vs θ(k))")
        axis.axhline(0.0, color="black", lw=0.6)
        axis.set_title(f"{env} ({len(runs[env])} seeds)")
        axis.set_xlabel("round k")
        axis.set_ylabel("Δ test return vs PPO's update")
        axis.legend(fontsize=7)
        negatives = np.array([r["return_negatives"] - r["return_none"] for r in rows])
        random = np.array([r["return_random"] - r["return_none"] for r in rows])
        improves = np.array([r["return_none"] - r["return_start"] > 0 for r in rows])

        def share(mask: np.ndarray) -> str:
            return f"{100 * mask.mean():.0f} % ({mask.sum()}/{mask.size})" if mask.size else "n/a"

        unfinished = sum(not data.get("complete") for data in runs[env])
        seeds = f"{len(runs[env])}" + (f" ({unfinished} unfinished)" if unfinished else "")
        lines.append(
            f"| {env} | {seeds} | {len(rows)} | {share(negatives > 0)} | {share(random > 0)} | {share(improves)} | "
            f"{share(negatives[improves] > 0)} | {share(negatives[~improves] > 0)} |"
        )
        records = PPO_KWARGS["n_steps"]  # one env per run: 2048 records per round
        for label, mask in (("improves", improves), ("does not improve", ~improves)):
            if not mask.any():
                continue
            chosen = [row for row, keep in zip(rows, mask, strict=True) if keep]
            negative_share = np.median([row["n_dropped"] / records for row in chosen])
            delta_target = np.median([row["delta_target_negatives"] for row in chosen])
            failure.append(
                f"| {env} | {label} | {len(chosen)} | {100 * negative_share:.0f} % | {delta_target:+.3g} | "
                f"{np.median(negatives[mask]):+.3g} |"
            )
    figure.suptitle("Retraining one round without the negative records vs a random drop (cf. the paper's Fig. 5 / 11)")
    figure.savefig(DOCS / "_static" / "img" / "intervention_rounds.png", dpi=110)
    plt.close(figure)
    (DOCS / "guide" / "generated" / "intervention_table.md").write_text("\n".join(lines + failure) + "\n")
    cpu = sum(data.get("cpu_s", 0.0) for group in runs.values() for data in group)
    print(f"{sum(len(group) for group in runs.values())} result files, {cpu / 3600:.2f} CPU hours")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(SCHEDULE), choices=list(SCHEDULE))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--summary", action="store_true", help="write the docs figure and table from the result files")
    args = parser.parse_args()
    import torch as th

    # One torch thread: the networks are small, and several benchmarks share the cores (more threads oversubscribe
    # them and run ~10x slower)
    th.set_num_threads(1)
    if args.summary:
        summary()
        return
    for env in args.envs:
        for seed in args.seeds:
            path = RESULTS / f"{env.lower()}_seed{seed}.json"
            if path.exists() and json.loads(path.read_text()).get("complete"):
                print(f"{path.name}: done, skipped")
                continue
            run(env, seed, path)


if __name__ == "__main__":
    main()
