"""
Faithfulness benchmark: LDS of every scorer × optimizer × env × round × seed, by counterfactual retraining.

One cell = (env, optimizer, round, seed). The model trains ``round`` rounds of plain PPO with that optimizer, then
collects round ``round``'s rollout and scores it with every scorer:

- ``single``: the paper's single-checkpoint SGD proxy at θ(k);
- ``multi``: the paper's multi-checkpoint (TracIn-style) sum over the update's steps;
- ``aware``: optimizer-aware in-run influence, ∇f at θ(k);
- ``aware_step``: the same with ∇f recomputed at every step;
- ``unrolled``: the exact first-order effect through the whole update (a hypergradient, curvature included);
- ``smoothed``: the unrolled derivative with PPO's ratio clip softened (``clip_smoothing=1e-3``) and averaged over
  4 minibatch orders (``n_orders=4``): what ``benchmarks/record_effects.py`` found to follow single-record effects;
- ``smoothed_1e-2``, ``smoothed_3e-2``: the same with a wider softening (``clip_smoothing=1e-2``, ``3e-2``).

:func:`sb3_influence.analysis.faithfulness.faithfulness` then retrains the round without random subsets (1 %, 5 %,
20 % of the records) under several minibatch orders and reports LDS, Pearson, the truth's reliability and the
bottom/top-5 % drop effects, with the records left out either removed and the rest re-batched (``--drop-modes
remove``, what IIF does) or kept in place with loss weight 0 (``zero-weight``, the counterfactual that first-order
scores describe). Each finished cell writes ``benchmarks/results/faithfulness/<cell>.json``; finished
cells are skipped on a re-run, so the grid grows across sessions. ``--tag`` measures a finished cell again under
another file name (e.g. once a scorer is added); the measurement is deterministic, so the summary merges the files
of one cell when their common scorers agree. ``--summary`` writes ``docs/faithfulness.md``'s table and plot from
whatever result files exist.

    nice -n 19 python benchmarks/faithfulness.py --envs CartPole --optimizers sgd adam adam1e-3 --rounds 3 10 --seeds 0
    nice -n 19 python benchmarks/faithfulness.py --envs CartPole --optimizers adam --drop-modes zero-weight
    python benchmarks/faithfulness.py --summary
"""

import argparse
import json
import os
import platform
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch as th

from sb3_influence.common import sb3_compat
from sb3_influence.common.stats import spearman

RESULTS = Path(__file__).parent / "results" / "faithfulness"
ENVS = {
    "CartPole": "CartPole-v1",
    "Acrobot": "Acrobot-v1",
    "LunarLander": "LunarLander-v3",
    "MiniGrid": "MiniGrid-Empty-8x8-v0",
}
# SGD 5e-3 without gradient clipping (the paper's setting); SB3's defaults (Adam 3e-4, max_grad_norm 0.5);
# Adam 1e-3 (the authors' LunarLander Adam runs); SB3's defaults without the gradient clip
OPTIMIZERS = {
    "sgd": dict(learning_rate=5e-3, max_grad_norm=1e10, policy_kwargs=dict(optimizer_class=th.optim.SGD)),
    "adam": dict(),
    "adam1e-3": dict(learning_rate=1e-3),
    # SB3's defaults without the gradient-norm clip: isolates what the clip does to the scores
    "adam-noclip": dict(max_grad_norm=1e10),
}
#: Widths of the softened ratio clip of the ``smoothed`` scorers (each averaged over 4 minibatch orders)
SMOOTHING = {"smoothed": 1e-3, "smoothed_1e-2": 1e-2, "smoothed_3e-2": 3e-2}
SCORERS = ("single", "multi", "aware", "aware_step", "unrolled", *SMOOTHING)
#: The scorers in the plot (every scorer is in the table)
PLOT_SCORERS = ("single", "multi", "aware", "unrolled", "smoothed_3e-2")
#: The measured leave-one-out effects, scored like a scorer (``--loo``): an oracle, not a scorer
ORACLE = "loo"


def make_model(env: str, optimizer: str, seed: int, n_steps: int) -> Any:
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_influence import InfluencePPO, MiniGridCNN

    kwargs: dict[str, Any] = {
        key: (dict(value) if isinstance(value, dict) else value) for key, value in OPTIMIZERS[optimizer].items()
    }
    policy = "MlpPolicy"
    wrapper = None
    if env == "MiniGrid":
        import minigrid  # noqa: F401  (registers the ids)
        from minigrid.wrappers import ImgObsWrapper

        wrapper, policy = ImgObsWrapper, "CnnPolicy"
        kwargs.setdefault("policy_kwargs", {}).update(
            features_extractor_class=MiniGridCNN, net_arch=dict(pi=[64, 64], vf=[64, 64])
        )
    th.set_num_threads(1)
    vec_env = make_vec_env(ENVS[env], n_envs=1, seed=seed, wrapper_class=wrapper)
    return InfluencePPO(policy, vec_env, n_steps=n_steps, batch_size=64, n_epochs=10, seed=seed, **kwargs)


def collect_round(model: Any, rounds: int) -> None:
    """Train ``rounds`` rounds of plain PPO, then collect the next rollout (round ``rounds``) without training."""
    if rounds:
        model.learn(rounds * model.n_steps)
    sb3_compat.collect_rollout(model, reset_num_timesteps=False)


def score(model: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every scorer's scores of the current round, and the seconds each took."""
    calls = {
        "single": lambda: model.compute_influence(),
        "multi": lambda: model.compute_influence(checkpoints="multi"),
        "aware": lambda: model.compute_influence(optimizer_aware=True),
        "aware_step": lambda: model.compute_influence(optimizer_aware=True, target_gradient="step"),
        "unrolled": lambda: model.compute_influence(optimizer_aware="unrolled"),
    }
    for name, width in SMOOTHING.items():
        calls[name] = partial(model.compute_influence, optimizer_aware="unrolled", clip_smoothing=width, n_orders=4)
    scores, seconds = {}, {}
    for name, call in calls.items():
        start = time.process_time()
        scores[name] = call()
        seconds[name] = time.process_time() - start
    return scores, seconds


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write one cell's result file atomically (a finished cell is skipped on a re-run), with the Python and torch."""
    result.update(python=platform.python_version(), torch=th.__version__)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def run_cell(env: str, optimizer: str, rounds: int, seed: int, args: argparse.Namespace, drop_mode: str = "remove") -> Path:
    from sb3_influence.analysis.faithfulness import faithfulness, leave_one_out

    mode = (
        ("" if drop_mode == "remove" else f"_{drop_mode}")
        + ("_loo" if args.loo else "")
        + (f"_{args.tag}" if args.tag else "")
    )
    path = RESULTS / f"{env}_{optimizer}_r{rounds}_s{seed}_n{args.subsets}{mode}.json"
    if path.exists():
        print(f"skip {path.name} (done)", flush=True)
        return path
    start = time.process_time()
    model = make_model(env, optimizer, seed, args.n_steps)
    collect_round(model, rounds)
    scores, seconds = score(model)
    record_spearman = {}
    if args.loo:
        # Every record's measured effect alone, under the orders faithfulness() uses below (same seed)
        start_loo = time.process_time()
        scores[ORACLE] = leave_one_out(model, args.orders, seed=1000 + seed, progress=args.progress, drop_mode=drop_mode)
        seconds[ORACLE] = time.process_time() - start_loo
        kept = model.rollout_buffer.keep
        oracle = scores[ORACLE][kept]
        record_spearman = {name: spearman(values[kept], oracle) for name, values in scores.items() if name != ORACLE}
    result = faithfulness(
        model,
        scores,
        sizes=tuple(args.sizes),
        n_subsets=args.subsets,
        n_orders=args.orders,
        seed=1000 + seed,
        progress=args.progress,
        drop_mode=drop_mode,
    )
    result.update(
        env=env,
        optimizer=optimizer,
        round=rounds,
        seed=seed,
        n_steps=args.n_steps,
        n_subsets=args.subsets,
        n_orders=args.orders,
        scoring_cpu_s=seconds,
        record_spearman_vs_loo=record_spearman,
        cpu_s=time.process_time() - start,
    )
    write_result(path, result)
    lds = {name: round(value, 3) for name, value in result["lds"].items()}
    print(f"{path.name}: LDS {lds}, ceiling {result['ceiling']:.3f}, {result['cpu_s'] / 60:.1f} CPU min", flush=True)
    return path


def _merge_cells(rows: list[dict[str, Any]], cell: Any) -> list[dict[str, Any]]:
    """
    One row per cell. Files of one cell (measured again with ``--loo`` or ``--tag``: same subsets, same orders) are
    merged into one row holding every scorer. Where a scorer they share has another per-size LDS (the scorer changed
    between the measurements), the later file (in name order) wins for that scorer and a line says so.
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        key = cell(row)
        if key not in merged:
            merged[key] = row
            continue
        first = merged[key]
        sizes = [size.get("size") for size in first["per_size"]] == [size.get("size") for size in row["per_size"]]
        if not sizes or any(
            abs(a["ceiling"] - b["ceiling"]) > 1e-9 for a, b in zip(first["per_size"], row["per_size"], strict=True)
        ):
            # Another truth (other subsets, orders or sizes): not one measurement, the later file replaces the row
            print(f"cell {key}: its files measured another truth; the later file is shown")
            merged[key] = row
            continue
        shared = set(first["per_size"][0]["lds"]) & set(row["per_size"][0]["lds"])
        pairs = list(zip(first["per_size"], row["per_size"], strict=True))
        changed = sorted(name for name in shared if any(abs(a["lds"][name] - b["lds"][name]) > 1e-9 for a, b in pairs))
        if changed:
            print(f"cell {key}: {changed} differ between its files; the later file's values are shown")
        for a, b in zip(first["per_size"], row["per_size"], strict=True):
            for field in ("lds", "pearson"):
                a[field] = {**a[field], **b[field]}
            if "noise_floor" in b:
                a["noise_floor"] = b["noise_floor"]
        for field in ("lds", "pearson", "extremes", "record_spearman_vs_loo"):
            first[field] = {**first.get(field, {}), **row.get(field, {})}
        if "noise_floor" in row:
            first["noise_floor"] = row["noise_floor"]
    return list(merged.values())


def summary(out: Path) -> None:
    """
    ``docs/faithfulness_table.md`` (every cell), ``docs/faithfulness_table_aggregate.md`` (by env and optimizer)
    and ``docs/_static/faithfulness.png`` (the aggregate) from the result files.
    """
    rows = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))]
    if not rows:
        raise SystemExit(f"no result file in {RESULTS}: run the grid first")

    # A cell measured again with --loo (same subsets, same orders, the oracle added) replaces its plain file
    def cell(row: dict[str, Any]) -> tuple[Any, ...]:
        return (row["env"], row["optimizer"], row["round"], row["seed"], row.get("drop_mode", "remove"), row["n_subsets"])

    rows = _merge_cells(rows, cell)
    for row in rows:
        # LDS per subset size (pooling sizes would reward predicting the size), then averaged over the sizes
        sizes = row["per_size"]
        row["lds"] = {name: float(np.mean([size["lds"][name] for size in sizes])) for name in sizes[0]["lds"]}
        row["ceiling"] = float(np.mean([size["ceiling"] for size in sizes]))
        # Measured by the files written since it was added; older cells show "—"
        floors = [size["noise_floor"] for size in sizes if "noise_floor" in size]
        row["noise_floor"] = float(np.mean(floors)) if len(floors) == len(sizes) else None
    lines = [
        "| env | optimizer | round | seed | drop | subsets/size | " + " | ".join(f"LDS {name}" for name in SCORERS) + " | "
        "ceiling | noise floor | best ≥ 80 % of ceiling | bottom-5 % drop (single / best), σ | "
        "LDS loo (additive oracle) | per record ρ(unrolled, loo) |",
        "|---|---|---|---|---|---|" + "---|" * len(SCORERS) + "---|---|---|---|---|---|",
    ]
    for row in rows:
        lds = [f"{row['lds'][name]:.2f}" if name in row["lds"] else "—" for name in SCORERS]
        # The best of the optimizer-aware scorers in this cell
        best = max(
            (name for name in ("aware", "aware_step", "unrolled", *SMOOTHING) if name in row["lds"]), key=row["lds"].get
        )
        ratio = row["lds"][best] / row["ceiling"] if row["ceiling"] > 0 else float("nan")
        extremes = row["extremes"]
        oracle = f"{row['lds'][ORACLE]:.2f}" if ORACLE in row["lds"] else "—"
        agreement = row.get("record_spearman_vs_loo", {})
        per_record = f"{agreement['unrolled']:.2f}" if "unrolled" in agreement else "—"
        floor = "—" if row["noise_floor"] is None else f"{row['noise_floor']:.2f}"
        lines.append(
            f"| {row['env']} | {row['optimizer']} | {row['round']} | {row['seed']} | {row.get('drop_mode', 'remove')} | "
            f"{row['n_subsets']} | " + " | ".join(lds) + f" | "
            f"{row['ceiling']:.2f} | {floor} | "
            f"{'yes' if ratio >= 0.8 else 'no'} ({best} {ratio:.0%}) | "
            f"{extremes['single']['bottom']:+.1f} / {extremes[best]['bottom']:+.1f} | {oracle} | {per_record} |"
        )
    out.write_text("\n".join(lines) + "\n")

    # The aggregate: the cells at the largest number of subsets per size, remove mode, by env and optimizer
    most = max(r["n_subsets"] for r in rows)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["n_subsets"] == most and row.get("drop_mode", "remove") == "remove":
            groups.setdefault((row["env"], row["optimizer"]), []).append(row)
    order = {name: i for i, name in enumerate(OPTIMIZERS)}
    keys = sorted(groups, key=lambda key: (key[0], order.get(key[1], 99)))
    recommended = "smoothed_3e-2"
    aggregate = [
        "| env | optimizer | cells | " + " | ".join(f"LDS {name}" for name in PLOT_SCORERS) + " | ceiling | "
        f"noise floor (cells measured) | {recommended} / ceiling | {recommended} ≥ single |",
        "|---|---|---|" + "---|" * len(PLOT_SCORERS) + "---|---|---|---|",
    ]

    def mean_min(values: list[float]) -> str:
        return f"{np.mean(values):.2f} ({min(values):.2f})" if values else "—"

    for key in keys:
        cells = groups[key]
        columns = [mean_min([c["lds"][name] for c in cells if name in c["lds"]]) for name in PLOT_SCORERS]
        paired = [c for c in cells if recommended in c["lds"] and c["ceiling"] > 0]
        ratio = mean_min([c["lds"][recommended] / c["ceiling"] for c in paired]).replace("(", "(min ")
        ahead = sum(c["lds"][recommended] >= c["lds"]["single"] for c in paired)
        floors = [c["noise_floor"] for c in cells if c["noise_floor"] is not None]
        floor = f"{np.mean(floors):.2f} ({len(floors)})" if floors else "—"
        aggregate.append(
            f"| {key[0]} | {key[1]} | {len(cells)} | " + " | ".join(columns) + f" | "
            f"{np.mean([c['ceiling'] for c in cells]):.2f} | {floor} | {ratio} | {ahead} of {len(paired)} |"
        )
    aggregate_path = out.with_name(out.stem + "_aggregate.md")
    aggregate_path.write_text("\n".join(aggregate) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    # The plot: the aggregate (mean over a group's cells, bars from the lowest to the highest cell)
    figure = Figure(figsize=(max(6.0, 0.9 * len(keys) + 1.5), 3.6), layout="constrained")
    ax = figure.subplots()
    x = np.arange(len(keys))
    width = 0.8 / len(PLOT_SCORERS)
    for offset, name in enumerate(PLOT_SCORERS):
        values = [[c["lds"][name] for c in groups[key] if name in c["lds"]] or [np.nan] for key in keys]
        means = np.array([np.mean(v) for v in values])
        spread = np.array([[m - min(v), max(v) - m] for m, v in zip(means, values, strict=True)]).T
        ax.bar(
            x + (offset - (len(PLOT_SCORERS) - 1) / 2) * width,
            means,
            width=width,
            yerr=spread,
            capsize=1.5,
            label=name,
            error_kw=dict(lw=0.6),
        )
    ax.plot(x, [np.mean([c["ceiling"] for c in groups[key]]) for key in keys], "k_", markersize=18, label="ceiling")
    ax.set_xticks(x, [f"{env}\n{optimizer}\n{len(groups[(env, optimizer)])} cells" for env, optimizer in keys], fontsize=7)
    ax.set_title(f"Mean LDS over rounds and seeds ({most} subsets per size; bars: lowest to highest cell)", fontsize=8)
    ax.set_ylabel("LDS (Spearman)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.legend(fontsize=7, ncol=6)
    image = Path(__file__).parent.parent / "docs" / "_static" / "faithfulness.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(image, dpi=110)
    print(f"wrote {out}, {aggregate_path} and {image}: {len(rows)} cells")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVS), default=["CartPole"], help="environments")
    parser.add_argument(
        "--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=["sgd", "adam", "adam1e-3"], help="optimizers"
    )
    parser.add_argument("--rounds", nargs="+", type=int, default=[3, 10], help="rounds trained before the scored one")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds")
    parser.add_argument("--n-steps", type=int, default=512, help="records per round (n_envs = 1)")
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.01, 0.05, 0.2], help="subset sizes (fractions)")
    parser.add_argument("--subsets", type=int, default=100, help="random subsets per size")
    parser.add_argument("--orders", type=int, default=4, help="minibatch orders the truth is averaged over")
    parser.add_argument(
        "--drop-modes",
        nargs="+",
        choices=["remove", "zero-weight"],
        default=["remove"],
        help="how a retrain leaves records out: removed and re-batched, or kept with loss weight 0",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show the retrains of the cell under way and an ETA (a bar on a terminal, else a line every 30 s)",
    )
    parser.add_argument(
        "--loo",
        action="store_true",
        help="also measure every record's leave-one-out effect (one retrain per record and order) and score with it: "
        "the LDS an additive score reaches knowing each record's true effect alone",
    )
    parser.add_argument("--tag", default="", help="measure cells again under file names ending in _TAG")
    parser.add_argument("--summary", action="store_true", help="only write the docs table and plot from the result files")
    args = parser.parse_args(argv)
    if args.summary:
        summary(Path(__file__).parent.parent / "docs" / "faithfulness_table.md")
        return
    for env in args.envs:
        for rounds in args.rounds:
            for optimizer in args.optimizers:
                for seed in args.seeds:
                    for drop_mode in args.drop_modes:
                        run_cell(env, optimizer, rounds, seed, args, drop_mode)


if __name__ == "__main__":
    main()
