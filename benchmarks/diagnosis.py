"""
Diagnosis of learning at the paper's scale (Sec. 4.1, Fig. 3(d)), and the MiniGrid bottom-record inspection.

FrozenLake 4x4 (not slippery), 2048 records per round, SGD 5e-3 (the paper's protocol, ``sb3_influence.bench``):
PPO trains for 11 rounds; at every round the records are scored on ``f_return`` at θ(k) and the Spearman
correlation of the influence with ``Ā·Â`` is taken, with ``Ā`` both ways: exact (policy evaluation on the
transition table) and the paper's in-buffer Monte-Carlo estimate (App. B.4). ``Â`` is the raw GAE advantage.
One result file per seed (``benchmarks/results/diagnosis/frozenlake_seed<k>.json``); finished seeds are skipped.

MiniGrid-Empty-8x8: the agent's position and heading are recorded with every record; at a chosen round the
bottom-20 records on ``f_return`` are compared with the whole buffer: how many step *away* from the goal (forward
while facing left or up; the goal is the bottom-right corner) with a positive advantage estimate.

    nice python benchmarks/diagnosis.py --seeds 0 1 2 3 4             # FrozenLake, ~35 CPU-seconds per seed
    nice python benchmarks/diagnosis.py --minigrid --seeds 0 1 2      # MiniGrid, ~35 CPU-seconds per seed
    python benchmarks/diagnosis.py --summary    # docs tables and figures from the result files
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

RESULTS = Path(__file__).parent / "results" / "diagnosis"
DOCS = Path(__file__).parent.parent / "docs"
ROUNDS = 11  # rounds 0..10 (round 0 = the first rollout, scored at the initial parameters)
SHOWN_ROUNDS = (2, 5, 10)
MINIGRID_ROUND = 5
BOTTOM = 20
FORWARD = 2  # MiniGrid's "move forward" action
AWAY_DIRECTIONS = (2, 3)  # facing left or up: a step forward moves away from the bottom-right goal
GOAL = (6, 6)  # the goal cell of MiniGrid-Empty-8x8 (x, y)
TURNS = (0, 1)


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()}


def frozenlake(seed: int) -> dict[str, Any]:
    from sb3_influence.analysis import DiagnosisCallback
    from sb3_influence.bench import ENVS
    from sb3_influence.bench.harness import make_model

    start, cpu = time.time(), time.process_time()
    model = make_model(ENVS["FrozenLake"], seed, "sgd")
    exact = DiagnosisCallback(true_advantage="exact")
    monte_carlo = DiagnosisCallback(true_advantage="monte_carlo")
    model.learn(ROUNDS * model.n_steps, callback=[exact, monte_carlo])
    rounds = []
    arrays = {}
    for ex, mc in zip(exact.results, monte_carlo.results, strict=True):
        influence = ex["influence"].reshape(-1)
        estimate = ex["estimated_advantage"].reshape(-1)
        bottom = np.argsort(influence, kind="stable")[: len(influence) // 20]
        rows = {"round": ex["round"], "spearman_exact": ex["spearman"], "spearman_monte_carlo": mc["spearman"]}
        for kind, result in (("exact", ex), ("monte_carlo", mc)):
            flips = result["true_advantage"].reshape(-1) * estimate < 0
            rows[f"sign_flip_share_{kind}"] = float(flips.mean())
            rows[f"sign_flip_share_bottom5_{kind}"] = float(flips[bottom].mean())
        rounds.append(rows)
        if ex["round"] in SHOWN_ROUNDS:
            arrays[str(ex["round"])] = {
                "influence": influence.tolist(),
                "true_advantage_exact": ex["true_advantage"].reshape(-1).tolist(),
                "true_advantage_monte_carlo": mc["true_advantage"].reshape(-1).tolist(),
                "estimated_advantage": estimate.tolist(),
            }
    return {
        "env": "FrozenLake",
        "seed": seed,
        "n_steps": model.n_steps,
        "rounds": rounds,
        "records": arrays if seed == 0 else {},
        "wall_s": time.time() - start,
        "cpu_s": time.process_time() - cpu,
        "machine": _machine(),
    }


class AgentPositions(BaseCallback):
    """Record the MiniGrid agent's position and heading for every record of the rollout (env 0..n-1)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: list[np.ndarray] = []
        self.directions: list[np.ndarray] = []

    def _current(self) -> None:
        env = self.training_env
        self.positions.append(np.array(env.get_attr("agent_pos"), dtype=np.int64))
        self.directions.append(np.array(env.get_attr("agent_dir"), dtype=np.int64))

    def _on_rollout_start(self) -> None:
        # The record of step t holds the observation before step t: the state now, then after every step
        self.positions, self.directions = [], []
        self._current()

    def _on_step(self) -> bool:
        self._current()
        return True


class BottomRecords(BaseCallback):
    """At one round, the positions, headings, actions, advantages and influence of every record."""

    def __init__(self, positions: AgentPositions, round_index: int) -> None:
        super().__init__()
        self.tracker = positions
        self.round_index = round_index
        self.result: dict[str, Any] = {}

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        if self.model.current_round().index != self.round_index:  # type: ignore[attr-defined]
            return
        buffer = self.model.rollout_buffer
        n = buffer.buffer_size
        positions = np.stack(self.tracker.positions[:n])  # (n_steps, n_envs, 2)
        directions = np.stack(self.tracker.directions[:n])
        influence = self.model.compute_influence("return", cache=True)  # type: ignore[attr-defined]
        self.result = {
            "influence": influence.reshape(-1).tolist(),
            "advantage": buffer.advantages.reshape(-1).tolist(),
            "action": buffer.actions.reshape(-1).astype(int).tolist(),
            "position": positions.reshape(-1, 2).tolist(),
            "direction": directions.reshape(-1).tolist(),
        }


def minigrid(seed: int) -> dict[str, Any]:
    from sb3_influence.bench import ENVS
    from sb3_influence.bench.harness import make_model

    start, cpu = time.time(), time.process_time()
    model = make_model(ENVS["MiniGrid"], seed, "sgd")
    positions = AgentPositions()
    bottom = BottomRecords(positions, MINIGRID_ROUND)
    model.learn((MINIGRID_ROUND + 1) * model.n_steps, callback=[positions, bottom])
    return {
        "env": "MiniGrid-Empty-8x8",
        "seed": seed,
        "round": MINIGRID_ROUND,
        "records": bottom.result,
        "wall_s": time.time() - start,
        "cpu_s": time.process_time() - cpu,
        "machine": _machine(),
    }


def _away(records: dict[str, Any]) -> np.ndarray:
    """A step forward while facing left or up: away from the bottom-right goal."""
    action = np.asarray(records["action"])
    direction = np.asarray(records["direction"])
    return (action == FORWARD) & np.isin(direction, AWAY_DIRECTIONS)


def _no_progress(records: dict[str, Any]) -> np.ndarray:
    """Any action that does not shorten the path to the goal: a turn, a no-op, or a step forward not right/down."""
    action = np.asarray(records["action"])
    direction = np.asarray(records["direction"])
    position = np.asarray(records["position"])
    towards = ((direction == 0) & (position[:, 0] < GOAL[0])) | ((direction == 1) & (position[:, 1] < GOAL[1]))
    return ~((action == FORWARD) & towards)


def summary() -> None:
    (DOCS / "guide" / "generated").mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.stats import spearmanr

    files = sorted(RESULTS.glob("frozenlake_seed*.json"))
    runs = [json.loads(path.read_text()) for path in files]
    lines = [
        "<!-- generated by: python benchmarks/diagnosis.py --summary -->",
        "",
        f"FrozenLake 4x4 (not slippery), 2048 records per round, SGD 5e-3, {len(runs)} seeds. Spearman correlation "
        "of the influence on `f_return` with Ā·Â (positive = helpful records are those whose estimate agrees in sign "
        "with Ā); median over seeds and [min, max]. The paper reports −0.67 at round 5 in its rank convention.",
        "",
        "| round | Ā exact | Ā Monte Carlo (in-buffer) | sign flips: all records (MC) | sign flips: bottom 5 % (MC) |",
        "|---|---|---|---|---|",
    ]
    for index in range(ROUNDS):
        values = {}
        for key in (
            "spearman_exact",
            "spearman_monte_carlo",
            "sign_flip_share_monte_carlo",
            "sign_flip_share_bottom5_monte_carlo",
        ):
            column = np.array([run["rounds"][index][key] for run in runs], dtype=float)
            values[key] = column
        cells = []
        for key, column in values.items():
            finite = column[np.isfinite(column)]
            if finite.size == 0:
                cells.append("n/a")
            elif key.startswith("spearman"):
                cells.append(f"{np.median(finite):+.2f} [{finite.min():+.2f}, {finite.max():+.2f}]")
            else:
                cells.append(f"{100 * np.median(finite):.0f} %")
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    (DOCS / "guide" / "generated" / "diagnosis_table.md").write_text("\n".join(lines) + "\n")

    # Fig. 3(d) style: influence rank against Ā·Â, seed 0, the shown rounds
    seed0 = next((run for run in runs if run["seed"] == 0), None)
    if seed0 is not None:
        figure, axes = plt.subplots(1, len(SHOWN_ROUNDS), figsize=(4 * len(SHOWN_ROUNDS), 3.4), constrained_layout=True)
        for axis, index in zip(axes, SHOWN_ROUNDS, strict=True):
            records = seed0["records"][str(index)]
            influence = np.asarray(records["influence"])
            rank = np.empty(influence.size)
            rank[np.argsort(-influence, kind="stable")] = np.arange(1, influence.size + 1)  # 1 = most helpful
            for kind, color in (("monte_carlo", "tab:red"), ("exact", "tab:blue")):
                product = np.asarray(records[f"true_advantage_{kind}"]) * np.asarray(records["estimated_advantage"])
                rho = spearmanr(rank, product).statistic
                axis.scatter(rank, product, s=4, alpha=0.5, color=color, label=f"Ā {kind.replace('_', ' ')}: ρ = {rho:+.2f}")
            axis.set_title(f"round {index}")
            axis.set_xlabel("influence rank (1 = most helpful)")
            axis.set_ylabel("Ā·Â")
            axis.legend(fontsize=7, loc="lower left")
        figure.suptitle("FrozenLake, seed 0: influence rank vs Ā·Â (cf. the paper's Fig. 3(d))")
        figure.savefig(DOCS / "_static" / "img" / "diagnosis_frozenlake.png", dpi=110)
        plt.close(figure)

    grid_runs = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("minigrid_seed*.json"))]
    if grid_runs:
        rows = []
        figure, axes = plt.subplots(
            1, len(grid_runs), figsize=(3.6 * len(grid_runs), 3.8), constrained_layout=True, squeeze=False
        )
        for axis, run in zip(axes[0], grid_runs, strict=True):
            records = run["records"]
            influence = np.asarray(records["influence"])
            advantage = np.asarray(records["advantage"])
            away = _away(records)
            bottom = np.argsort(influence, kind="stable")[:BOTTOM]
            positive_away = away & (advantage > 0)
            positive_idle = _no_progress(records) & (advantage > 0)
            turns = np.isin(np.asarray(records["action"]), TURNS)
            rows.append(
                (
                    run["seed"],
                    positive_away[bottom].mean(),
                    positive_away.mean(),
                    positive_idle[bottom].mean(),
                    positive_idle.mean(),
                    turns[bottom].mean(),
                    turns.mean(),
                )
            )
            position = np.asarray(records["position"])
            direction = np.asarray(records["direction"])
            axis.set_xlim(-0.5, 7.5)
            axis.set_ylim(7.5, -0.5)
            axis.set_aspect("equal")
            axis.add_patch(plt.Rectangle((0, 0), 7, 7, fill=False, lw=2, color="gray"))
            axis.add_patch(plt.Rectangle((5.5, 5.5), 1, 1, color="tab:green", alpha=0.4))
            dx = {0: 1, 1: 0, 2: -1, 3: 0}
            dy = {0: 0, 1: 1, 2: 0, 3: -1}
            rng = np.random.default_rng(0)
            for i in bottom:
                x, y = position[i] + rng.uniform(-0.2, 0.2, size=2)
                color = "tab:red" if positive_away[i] else ("tab:orange" if advantage[i] > 0 else "tab:blue")
                if records["action"][i] == FORWARD:
                    axis.arrow(x, y, 0.35 * dx[direction[i]], 0.35 * dy[direction[i]], head_width=0.15, color=color)
                else:
                    axis.plot(x, y, marker="o", ms=4, color=color)
            axis.set_title(f"seed {run['seed']}, round {run['round']}: bottom {BOTTOM}", fontsize=9)
            axis.set_xticks(range(8))
            axis.set_yticks(range(8))
        figure.suptitle(
            "MiniGrid-Empty-8x8: bottom records. Red arrow: forward away from the goal with Â > 0; orange: other Â > 0; "
            "blue: Â ≤ 0; dot: a turn",
            fontsize=8,
        )
        figure.savefig(DOCS / "_static" / "img" / "diagnosis_minigrid.png", dpi=110)
        plt.close(figure)
        table = [
            "| seed | forward away from the goal with Â > 0: bottom 20 / all | no progress towards the goal with Â > 0: "
            "bottom 20 / all | turns: bottom 20 / all |",
            "|---|---|---|---|",
        ]
        table += [
            f"| {row[0]} | " + " | ".join(f"{100 * row[i]:.0f} % / {100 * row[i + 1]:.0f} %" for i in (1, 3, 5)) + " |"
            for row in rows
        ]
        (DOCS / "guide" / "generated" / "diagnosis_minigrid_table.md").write_text(
            "<!-- generated by: python benchmarks/diagnosis.py --summary -->\n\n" + "\n".join(table) + "\n"
        )
    cpu = sum(run["cpu_s"] for run in runs + grid_runs)
    print(f"{len(runs)} FrozenLake and {len(grid_runs)} MiniGrid result files, {cpu / 3600:.2f} CPU hours")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--minigrid", action="store_true", help="the MiniGrid bottom-record inspection instead")
    parser.add_argument("--summary", action="store_true", help="write the docs table and figures from the result files")
    args = parser.parse_args()
    import torch as th

    # One torch thread: the networks are small, and several benchmarks share the cores (more threads oversubscribe
    # them and run ~10x slower)
    th.set_num_threads(1)
    if args.summary:
        summary()
        return
    for seed in args.seeds:
        name = f"{'minigrid' if args.minigrid else 'frozenlake'}_seed{seed}.json"
        path = RESULTS / name
        if path.exists():
            print(f"{name}: done, skipped")
            continue
        result = minigrid(seed) if args.minigrid else frozenlake(seed)
        _write(path, result)
        print(f"{name}: written ({result['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
