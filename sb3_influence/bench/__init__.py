"""
``sb3-influence bench``: the paper's PPO / IIF / random-filtering comparison (METHOD §4 and §6).

Every run trains one arm (``ppo``, ``iif`` or ``random``) on one environment with one seed, round by round
(one round = one rollout of ``n_steps * n_envs`` records + one PPO update), evaluates the stochastic policy after
every ``eval_every`` rounds and writes its per-round results to ``<out>/<env>/<arm>_seed<seed>.json`` as it goes.
Arms with the same seed start from identical initial weights (same seed, same construction; the harness stores a
hash of the initial parameters in every result file and :func:`summarize` checks it). Finished runs are skipped
when the command is run again; an unfinished run resumes from its last checkpoint in ``<out>/raw/``.

The metrics (:func:`first_round`, :func:`ppo_levels`, :func:`speedup_metrics`) follow METHOD §6:
``m(v)`` is the first round whose test return is ``>= v``, ``Reduction(v) = 1 - m_IIF(v) / m_PPO(v)``, SE_ave is
the mean reduction over the successive new-best values of standard PPO, SE_peak the reduction at PPO's peak and
RT_peak the same in cumulative wall-clock time.
"""

import argparse
import os

from sb3_influence.bench.harness import (
    ARMS,
    ENVS,
    PPO_KWARGS,
    EnvSpec,
    _write_json,
    evaluate,
    exact_frozenlake_return,
    make_callback,
    make_env,
    make_model,
    parameter_hash,
    result_path,
    run_all,
    run_one,
)
from sb3_influence.bench.metrics import bootstrap_ci, first_round, ppo_levels, speedup_metrics
from sb3_influence.bench.summary import curve, load_runs, markdown_table, plot, summarize, time_key

__all__ = [
    "ARMS",
    "ENVS",
    "PPO_KWARGS",
    "EnvSpec",
    "bootstrap_ci",
    "curve",
    "evaluate",
    "exact_frozenlake_return",
    "first_round",
    "load_runs",
    "main",
    "make_callback",
    "make_env",
    "make_model",
    "markdown_table",
    "parameter_hash",
    "plot",
    "ppo_levels",
    "result_path",
    "run_all",
    "run_one",
    "speedup_metrics",
    "summarize",
    "time_key",
]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sb3-influence bench``."""
    parser = argparse.ArgumentParser(prog="sb3-influence bench", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the arms (skips finished runs, resumes unfinished ones)")
    run.add_argument("--envs", nargs="+", default=["FrozenLake", "Acrobot", "MiniGrid", "LunarLander"], choices=sorted(ENVS))
    run.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    run.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the paper's)")
    run.add_argument("--eval-episodes", type=int, default=10)
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--nice", type=int, default=0)
    summary = sub.add_parser("summary", help="print the metrics table and write the plots")
    summary.add_argument(
        "--envs", nargs="+", default=["FrozenLake", "Acrobot", "MiniGrid", "LunarLander"], choices=sorted(ENVS)
    )
    summary.add_argument("--plots", default=None, help="directory for <env>.png learning curves")
    summary.add_argument("--json", default=None, help="write the full summary to this JSON file")
    for sub_parser in (run, summary):
        sub_parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.command == "run":
        run_all(args.envs, args.arms, args.seeds, args.out, args.workers, args.rounds, args.eval_episodes, args.nice)
        return 0
    print(markdown_table(args.out, args.envs))
    if args.plots:
        for env in args.envs:
            if load_runs(args.out, env):
                plot(args.out, env, os.path.join(args.plots, f"{env}.png"))
    if args.json:
        _write_json(args.json, {env: summarize(args.out, env) for env in args.envs})
    return 0
