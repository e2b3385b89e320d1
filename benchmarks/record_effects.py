"""
Record by record: does a score rank records by the measured effect of leaving each one out?

For a random sample of the round's records, retrain the round from θ(k) without each one (zero-weight: the record
stays in its minibatch with loss weight 0, the counterfactual the unrolled score differentiates) under 4 minibatch
orders, and compare every scorer with the mean effect (Spearman over the sampled records). The split-half
reliability of that mean (orders 1–2 against 3–4, Spearman–Brown corrected) gives the ceiling any score can reach.

The scorers: the paper's (``single``), the in-run optimizer-aware (``aware``), the exact unrolled derivative
(``unrolled``), and the unrolled derivative with PPO's ratio clip softened to a softplus of width τ
(``clip_smoothing``) and/or averaged over 4 minibatch orders (``n_orders``), whose orders are drawn independently
of the truth's. ``--no-ratio-clip`` trains and measures with the ratio clip off (``clip_range=1e9``): a control that
shows what the clip does. One result file per cell in ``benchmarks/results/record_effects/``, finished cells
skipped; ``--summary`` writes ``docs/record_effects_table.md``.

    nice -n 10 python benchmarks/record_effects.py --envs CartPole Acrobot --optimizers adam --rounds 3 10
    nice -n 10 python benchmarks/record_effects.py --envs CartPole --optimizers adam sgd --rounds 3 --no-ratio-clip
    python benchmarks/record_effects.py --summary
"""

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch as th
from faithfulness import ENVS, OPTIMIZERS, collect_round, make_model, write_result
from stable_baselines3.common.utils import get_schedule_fn

from sb3_influence.analysis.faithfulness import retrained_target
from sb3_influence.common.stats import spearman

RESULTS = Path(__file__).parent / "results" / "record_effects"
TABLE = Path(__file__).parent.parent / "docs" / "record_effects_table.md"
N_ORDERS = 4


def scorers(taus: list[float]) -> dict[str, dict[str, Any]]:
    """Scorer name → ``compute_influence`` arguments."""
    out: dict[str, dict[str, Any]] = {
        "single": {},
        "aware": dict(optimizer_aware=True),
        "unrolled": dict(optimizer_aware="unrolled"),
        f"unrolled ×{N_ORDERS} orders": dict(optimizer_aware="unrolled", n_orders=N_ORDERS),
    }
    for tau in taus:
        out[f"unrolled τ={tau:g}"] = dict(optimizer_aware="unrolled", clip_smoothing=tau)
        out[f"unrolled τ={tau:g} ×{N_ORDERS} orders"] = dict(optimizer_aware="unrolled", clip_smoothing=tau, n_orders=N_ORDERS)
    return out


def run_cell(env: str, optimizer: str, rounds: int, seed: int, args: argparse.Namespace) -> Path:
    suffix = "_noratioclip" if args.no_ratio_clip else ""
    path = RESULTS / f"{env}_{optimizer}_r{rounds}_s{seed}_n{args.records}{suffix}.json"
    if path.exists():
        print(f"skip {path.name} (done)", flush=True)
        return path
    start = time.process_time()
    model = make_model(env, optimizer, seed, args.n_steps)
    if args.no_ratio_clip:
        model.clip_range = get_schedule_fn(1e9)
    collect_round(model, rounds)
    scores, seconds = {}, {}
    for name, kwargs in scorers(args.taus).items():
        begin = time.process_time()
        scores[name] = model.rollout_buffer.to_flat(model.compute_influence(**kwargs))
        seconds[name] = time.process_time() - begin
    # The truth: each sampled record left out alone, under the orders faithfulness() uses for this seed
    buffer = model.rollout_buffer
    shape = buffer.keep.shape
    records = np.random.default_rng(5 + seed).choice(buffer.n_records, size=args.records, replace=False)
    order_seeds = np.random.default_rng(1000 + seed).integers(0, 2**31 - 1, size=N_ORDERS)
    begin = time.process_time()
    reference = [retrained_target(model, np.zeros(shape, dtype=bool), int(s), drop_mode="zero-weight") for s in order_seeds]
    effects = np.zeros((N_ORDERS, len(records)))
    for j, record in enumerate(records):
        drop = np.zeros(buffer.n_records, dtype=bool)
        drop[record] = True
        for o, order_seed in enumerate(order_seeds):
            value = retrained_target(model, drop.reshape(shape), int(order_seed), drop_mode="zero-weight")
            # In the sign of a score: positive when leaving the record out lowers f
            effects[o, j] = -(value - reference[o])
    loo_seconds = time.process_time() - begin
    truth = effects.mean(axis=0)
    split = spearman(effects[: N_ORDERS // 2].mean(axis=0), effects[N_ORDERS // 2 :].mean(axis=0))
    reliability = 2 * split / (1 + split) if split > -1 else float("nan")
    result = dict(
        env=env,
        optimizer=optimizer,
        round=rounds,
        seed=seed,
        ratio_clip=not args.no_ratio_clip,
        n_steps=args.n_steps,
        n_records=len(records),
        n_orders=N_ORDERS,
        spearman={name: spearman(values[records], truth) for name, values in scores.items()},
        reliability=reliability,
        ceiling=float(np.sqrt(max(reliability, 0.0))),
        cross_order_spearman=spearman(effects[0], effects[1]),
        scoring_cpu_s=seconds,
        loo_cpu_s=loo_seconds,
        cpu_s=time.process_time() - start,
    )
    write_result(path, result)
    best = max(result["spearman"].items(), key=lambda item: item[1])
    print(
        f"{path.name}: unrolled {result['spearman']['unrolled']:.3f}, best {best[0]} {best[1]:.3f}, "
        f"ceiling {result['ceiling']:.3f}, {result['cpu_s'] / 60:.1f} CPU min",
        flush=True,
    )
    return path


def summary(out: Path) -> None:
    """The per-record agreement of every cell, as a Markdown table."""
    rows = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))]
    if not rows:
        raise SystemExit(f"no result files in {RESULTS}")
    names = list(rows[0]["spearman"])
    lines = [
        "| cell | ratio clip | ceiling | " + " | ".join(f"`{name}`" for name in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for row in rows:
        cell = f"{row['env']} {row['optimizer']} r{row['round']} s{row['seed']}"
        values = [row["spearman"].get(name, float("nan")) for name in names]
        best = np.nanmax(values)
        shown = [f"**{value:.2f}**" if value == best else f"{value:.2f}" for value in values]
        clip = "on" if row["ratio_clip"] else "off"
        lines.append(f"| {cell} | {clip} | {row['ceiling']:.2f} | " + " | ".join(shown) + " |")
    lines.append("")
    lines.append(
        f"Spearman correlation, over {rows[0]['n_records']} sampled records per cell, of each score with the record's "
        f"measured leave-one-out effect (zero-weight, mean of {N_ORDERS} minibatch orders); ceiling: √(split-half "
        "reliability) of that mean. Bold: the best scorer of the cell. Written by `python benchmarks/record_effects.py "
        "--summary`."
    )
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVS), default=["CartPole"], help="environments")
    parser.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=["adam"], help="optimizer settings")
    parser.add_argument("--rounds", nargs="+", type=int, default=[3], help="rounds trained before the scored one")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds")
    parser.add_argument("--n-steps", type=int, default=512, help="records per round (n_envs = 1)")
    parser.add_argument("--records", type=int, default=96, help="records left out one at a time")
    parser.add_argument("--taus", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2], help="clip_smoothing widths")
    parser.add_argument("--no-ratio-clip", action="store_true", help="train and measure with clip_range=1e9")
    parser.add_argument("--summary", action="store_true", help="only write the docs table from the result files")
    args = parser.parse_args()
    if args.summary:
        summary(TABLE)
        return
    th.set_num_threads(1)
    for env in args.envs:
        for optimizer in args.optimizers:
            for rounds in args.rounds:
                for seed in args.seeds:
                    run_cell(env, optimizer, rounds, seed, args)


if __name__ == "__main__":
    main()
