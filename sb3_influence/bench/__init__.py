"""
``sb3-influence bench``: does iterative influence-based filtering (IIF) train faster than PPO? The comparison of
Hu et al., "A Snapshot of Influence" (arXiv 2505.19281), Sec. 5, over a grid of environment × optimizer setting ×
arm × seed.

Every run trains one arm (:data:`ARMS`: ``ppo``, ``iif``, ``random``, ``iif-aware`` in the Adam settings, the
trajectory arms in MiniGrid's SGD cells, and ``iif-smoothed``, opt-in, where named) on one environment with one
optimizer setting (:data:`SETTINGS`) and one seed, round by round (one round = one rollout of ``n_steps * n_envs``
records + one PPO update), evaluates the stochastic policy every ``eval_every`` rounds (and each of the first
``eval_first``) and writes its per-round results to ``<out>/<env>/<setting>/<arm>_seed<seed>.json`` as it goes. Arms
with the same seed start from identical initial weights (the harness stores a hash of them in every result file and
:func:`summarize` checks it). Finished runs are skipped when the command is run again; an unfinished run resumes
from its last checkpoint in ``<out>/checkpoints/``. Runs are dispatched by Ray (optional extra ``distributed``) or a
local process pool.

The speed-up metrics (:func:`first_round`, :func:`ppo_levels`, :func:`speedup_metrics`) are the paper's (Sec. 5):
``m(v)`` is the first round whose test return is ``>= v``, ``Reduction(v) = 1 - m_IIF(v) / m_PPO(v)``, SE_ave is
the mean reduction over the successive new-best values of standard PPO, SE_peak the reduction at PPO's peak and
RT_peak the same in cumulative time. :mod:`sb3_influence.bench.stats` adds rliable's aggregate statistics.
"""

import argparse
import json
import math
import sys

from sb3_influence.bench.evaluation import EVAL_ENVS, evaluate, exact_frozenlake_return, make_eval_env
from sb3_influence.bench.grid import Job, cpu_hours, grid, missing, run_grid
from sb3_influence.bench.harness import (
    DropPartialMinibatch,
    make_callback,
    make_env,
    make_model,
    parameter_fingerprint,
    parameter_hash,
    run_config,
    run_one,
    write_json,
)
from sb3_influence.bench.protocol import (
    ARMS,
    ENVS,
    EXTRA_ENVS,
    PAPER_ENVS,
    PPO_KWARGS,
    SETTINGS,
    VARIANT_ARMS,
    VARIANTS,
    Arm,
    EnvSpec,
    OptimizerSetting,
    Variant,
    arms_for,
    reuses_unfiltered,
    cell_name,
    result_path,
    run_kwargs,
)
from sb3_influence.bench.metrics import bootstrap_ci, curve_mean, first_round, ppo_levels, speedup_metrics
from sb3_influence.bench.summary import cell_directory, curve, load_runs, markdown_table, plot, summarize, time_key

__all__ = [
    "ARMS",
    "ENVS",
    "EVAL_ENVS",
    "EXTRA_ENVS",
    "PAPER_ENVS",
    "PPO_KWARGS",
    "SETTINGS",
    "VARIANTS",
    "VARIANT_ARMS",
    "Arm",
    "DropPartialMinibatch",
    "EnvSpec",
    "Job",
    "OptimizerSetting",
    "Variant",
    "arms_for",
    "bootstrap_ci",
    "cell_directory",
    "cell_name",
    "cpu_hours",
    "curve",
    "curve_mean",
    "evaluate",
    "exact_frozenlake_return",
    "first_round",
    "grid",
    "load_runs",
    "main",
    "make_callback",
    "make_env",
    "make_eval_env",
    "make_model",
    "markdown_table",
    "missing",
    "parameter_fingerprint",
    "parameter_hash",
    "plot",
    "ppo_levels",
    "result_path",
    "reuses_unfiltered",
    "run_config",
    "run_grid",
    "run_kwargs",
    "run_one",
    "speedup_metrics",
    "summarize",
    "time_key",
    "write_json",
]

_DESCRIPTION = (
    "Does iterative influence-based filtering (IIF) train faster than PPO? Runs the comparison of Hu et al., "
    "'A Snapshot of Influence' (arXiv 2505.19281, Sec. 5) over environment x optimizer setting x arm x seed, "
    "summarises it and regenerates docs/benchmarks.md."
)
_DEFAULT_OUT = "benchmarks/results/grid"


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, lists written as on the command line (``--seeds 0 1 2``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "default" in help_ or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return help_
        default = action.default
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{help_} (default: {shown or 'none'})"


def _grid_arguments(parser: argparse.ArgumentParser) -> None:
    restricted = "; ".join(f"{name}: {' '.join(arm.settings)}" for name, arm in ARMS.items() if arm.settings is not None)
    parser.add_argument(
        "--envs",
        nargs="+",
        default=list(PAPER_ENVS),
        choices=sorted(ENVS),
        metavar="ENV",
        help=f"environments, from {', '.join(sorted(ENVS))}",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=None,
        choices=sorted(SETTINGS),
        metavar="SETTING",
        help=f"optimizer settings, from {', '.join(SETTINGS)}; default: each environment's own protocol settings",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=None,
        choices=list(ARMS),
        metavar="ARM",
        help=f"arms, from {', '.join(ARMS)}; default: every arm but the opt-in ones "
        f"({', '.join(a for a, spec in ARMS.items() if spec.opt_in)}), each in the optimizer settings it applies to "
        f"({restricted}; the others: all); with --variants, {' and '.join(VARIANT_ARMS)}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        choices=sorted(VARIANTS),
        metavar="VARIANT",
        help=f"options that the authors' code differs in, from {', '.join(sorted(VARIANTS))}; a cell with variants "
        f"runs {' and '.join(VARIANT_ARMS)} unless --arms names others",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per run; default: the paper's budget of environment steps for each cell",
    )
    parser.add_argument("--eval-episodes", type=int, default=100, help="stochastic evaluation episodes per evaluation")
    parser.add_argument("--out", default=_DEFAULT_OUT, help="results directory")


def _parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    parser = argparse.ArgumentParser(prog="sb3-influence bench", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", formatter_class=formatter, help="train the grid (skips finished runs, resumes unfinished ones)"
    )
    _grid_arguments(run)
    run.add_argument("--workers", type=int, default=2, help="runs at a time on this machine (one torch thread each)")
    run.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "ray", "process"],
        help="'ray', 'process' (local process pool; --workers 1 runs in this process) or 'auto' "
        "(Ray when installed or --address is given)",
    )
    run.add_argument(
        "--address", default=None, help="address of a Ray cluster to send the grid to; default: start Ray on this machine"
    )
    run.add_argument("--nice", type=int, default=0, help="niceness added to the worker processes")
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show the round of each run under way, the runs done and an ETA: a bar on a terminal (with tqdm), "
        "else plain lines on stdout",
    )
    run.add_argument(
        "--progress-interval",
        type=float,
        default=30.0,
        help="seconds between two plain progress lines (a line at the end of every run whatever it is)",
    )
    summary = sub.add_parser(
        "summary",
        formatter_class=formatter,
        help="print the metrics table and list missing result files (exit status 1 if any)",
    )
    _grid_arguments(summary)
    summary.add_argument(
        "--allow-missing",
        action="store_true",
        help="exit 0 when some requested runs are missing but at least one cell has results; default: exit 1",
    )
    summary.add_argument("--plots", default=None, help="directory for <env>_<setting>.png learning curves; default: none")
    summary.add_argument("--json", default=None, help="write the per-seed summary to this JSON file; default: none")
    docs = sub.add_parser(
        "docs",
        formatter_class=formatter,
        help="regenerate docs/benchmarks.md (tables, figures) from the result files and a template",
    )
    docs.add_argument("--template", default="benchmarks/benchmarks.md.in", help="Markdown template with the prose")
    docs.add_argument("--output", default="docs/benchmarks.md", help="the generated page")
    docs.add_argument("--figures", default="docs/_static/bench", help="directory of the generated figures")
    docs.add_argument("--out", default=_DEFAULT_OUT, help="results directory of the grid")
    docs.add_argument("--legacy", default="benchmarks/results/legacy", help="results of the superseded 3-seed protocol")
    docs.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds a complete cell has")
    return parser


def _progress(path: str) -> str:
    """``" (unfinished: round k of n)"`` for a result file of an unfinished run, ``""`` when there is none."""
    try:
        with open(path) as file:
            result = json.load(file)
    except FileNotFoundError:
        return ""
    return f" (unfinished or another configuration: round {result['rows'][-1]['round']} of {result['config']['rounds']})"


def _summary(args: argparse.Namespace) -> int:
    jobs = grid(args.envs, args.arms, args.seeds, args.settings, args.variants, args.rounds, args.eval_episodes)
    cells = list(dict.fromkeys((job.env, job.setting) for job in jobs))
    rows = [
        (f"{env} {cell_name(setting, args.variants)}", cell_directory(args.out, env, setting, args.variants), env)
        for env, setting in cells
    ]
    shown = [row for row in rows if summarize(row[1], row[2])]
    absent = missing(jobs, args.out)
    if shown:
        print(markdown_table(shown))
        print(f"\nCPU time of the runs in {args.out}: {cpu_hours(jobs, args.out):.2f} h")
    if absent:
        print(f"\n{len(absent)} of {len(jobs)} requested runs have no finished result file in {args.out}:", file=sys.stderr)
        for job in absent:
            print(f"  {job.describe()}: {job.path(args.out)}{_progress(job.path(args.out))}", file=sys.stderr)
        print("Run them with `sb3-influence bench run` and the same arguments.", file=sys.stderr)
    if not shown:
        print(
            "No cell has a finished PPO run and a finished filtering run of the same seed: nothing to summarise.",
            file=sys.stderr,
        )
        return 1
    if args.plots:
        for label, directory, env in shown:
            plot(directory, env, f"{args.plots}/{label.replace(' ', '_')}.png", title=label)
    if args.json:
        write_json(args.json, {label: summarize(directory, env) for label, directory, env in shown})
    return 1 if absent and not args.allow_missing else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sb3-influence bench``."""
    args = _parser().parse_args(argv)
    if args.command == "run":
        jobs = grid(args.envs, args.arms, args.seeds, args.settings, args.variants, args.rounds, args.eval_episodes)
        from sb3_influence.bench.page import hours_left

        todo = missing(jobs, args.out)
        if todo:
            left = hours_left(todo, args.out)
            known = not math.isnan(left)
            estimate = f"about {left:.1f} CPU h" if known else "not known yet (no run of their cells measured)"
            print(f"CPU time the {len(todo)} runs to do still need: {estimate}, as docs/benchmarks.md's cost table counts it")
        run_grid(
            jobs,
            args.out,
            args.workers,
            args.backend,
            args.address,
            args.nice,
            progress=args.progress,
            progress_interval=args.progress_interval,
        )
        return 0
    if args.command == "summary":
        return _summary(args)
    from sb3_influence.bench.page import generate_page

    report = generate_page(args.template, args.output, args.figures, args.out, args.legacy, args.seeds)
    print(json.dumps(report, indent=1))
    return 0
