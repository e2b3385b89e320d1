"""
``sb3-influence run``: train InfluencePPO with IIF on a small default and print an attribution summary.

::

    sb3-influence run                       # CartPole-v1, ~25k steps, about a minute on 2 CPU cores
    sb3-influence run --env Acrobot-v1 --timesteps 40960 --fraction 0.5 --save-dir snapshots/acrobot

Every round is scored against the return target, filtered with the paper's ``neg-bottom`` rule and written as an
attribution snapshot (to ``--save-dir``, or a temporary folder). The summary lists per round the kept fraction and
the influence statistics, the 3 most helpful and 3 most harmful records of the last round, and the final return.
"""

import argparse
import sys
import tempfile

import numpy as np

from sb3_influence.common.callbacks import AttributionCallback, IIFCallback
from sb3_influence.common.command_line import ArgumentParser
from sb3_influence.common.filters import DROP_RULES
from sb3_influence.common.snapshots import Snapshot, load_all


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of ``sb3-influence run``."""
    parser = ArgumentParser(
        prog="sb3-influence run",
        description="Train InfluencePPO with influence-based filtering (IIF) and print an attribution summary.",
    )
    parser.add_argument("--env", default="CartPole-v1", help="Gymnasium env id (default: CartPole-v1)")
    parser.add_argument("--timesteps", type=_positive_int, default=25_600, help="total env steps (default: 25600)")
    parser.add_argument("--n-steps", type=_positive_int, default=1024, help="rollout length per round (default: 1024)")
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="PPO minibatch size (default: 64)")
    parser.add_argument("--n-epochs", type=_positive_int, default=10, help="PPO epochs per round (default: 10)")
    parser.add_argument("--fraction", type=_fraction, default=0.5, help="IIF fraction p in [0, 1] (default: 0.5)")
    parser.add_argument("--rule", choices=sorted(DROP_RULES), default="neg-bottom", help="IIF drop rule (default: neg-bottom)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--save-dir", default=None, help="keep the attribution snapshots here (default: a temporary folder)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the snapshots of another run found in --save-dir (default: refuse)"
    )
    parser.add_argument("--eval-episodes", type=int, default=10, help="final evaluation episodes, 0: skip (default: 10)")
    parser.add_argument("--top", type=_positive_int, default=3, help="records listed at each end of round (default: 3)")
    parser.add_argument("--verbose", type=int, default=0, help="SB3 verbosity (default: 0)")
    return parser


def _round_table(snapshots: list[Snapshot]) -> list[str]:
    lines = [f"{'round':>5} {'steps':>8} {'kept':>6} {'mean I':>11} {'std I':>11} {'frac<0':>7} {'corr(I,A)':>9}"]
    for snapshot in snapshots:
        arrays = snapshot.arrays
        scores = snapshot.scores("return")
        advantages = snapshot.flat("advantage")
        corr = np.nan
        if scores.std() > 0 and advantages.std() > 0:
            corr = float(np.corrcoef(scores, advantages)[0, 1])
        lines.append(
            f"{snapshot.round:>5} {snapshot.num_timesteps:>8} {arrays['keep'].mean():>6.3f} {scores.mean():>11.3e} "
            f"{scores.std():>11.3e} {np.mean(scores < 0):>7.3f} {corr:>9.3f}"
        )
    return lines


def _format_action(action: np.ndarray) -> str:
    action = np.asarray(action)
    if action.size == 1:
        return f"{action.item():.4g}" if np.issubdtype(action.dtype, np.floating) else str(action.item())
    return np.array2string(action.ravel(), precision=3, separator=",")


def _extremes(snapshot: Snapshot, top: int) -> list[str]:
    arrays = snapshot.arrays
    scores = arrays["influence/return"]
    order = np.argsort(scores, axis=None, kind="stable")
    header = f"{'':8} {'env':>3} {'step':>5} {'action':>12} {'reward':>8} {'advantage':>10} {'influence':>11} {'kept':>5}"
    lines = [header]
    for label, flat_ids in (("top", order[::-1][:top]), ("bottom", order[:top])):
        for rank, flat_id in enumerate(flat_ids, start=1):
            step, env = np.unravel_index(flat_id, scores.shape)
            lines.append(
                f"{label + ' ' + str(rank):8} {env:>3} {step:>5} {_format_action(arrays['action'][step, env]):>12} "
                f"{arrays['reward'][step, env]:>8.3f} {arrays['advantage'][step, env]:>10.3f} "
                f"{scores[step, env]:>11.3e} {bool(arrays['keep'][step, env])!s:>5}"
            )
    return lines


def summary(save_dir: str, top: int = 3) -> str:
    """
    The attribution summary of the snapshots in ``save_dir`` (written with the ``return`` target).

    :param save_dir: A folder of attribution snapshots.
    :param top: Records listed at each end of the last round.
    :return: The text.
    """
    snapshots = load_all(save_dir)
    snapshots = [snapshot for snapshot in snapshots if "return" in snapshot.targets]
    if not snapshots:
        raise ValueError(f"No snapshot scored with the 'return' target in {save_dir!r}")
    last = snapshots[-1]
    lines = ["Per round (I: influence on the return target; kept: fraction of records IIF kept):"]
    lines += _round_table(snapshots)
    lines += ["", f"Most helpful (top) and most harmful (bottom) records of round {last.round}:"]
    lines += _extremes(last, top)
    return "\n".join(lines)


def run(args: argparse.Namespace, save_dir: str) -> str:
    """
    Train as ``args`` says, writing snapshots to ``save_dir``, and return the printed report.

    :param args: Parsed arguments of :func:`make_parser`.
    :param save_dir: Snapshot folder.
    :return: The report.
    """
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    from sb3_influence.influence_ppo import InfluencePPO

    n_steps = min(args.n_steps, args.timesteps)
    # The callbacks first: a bad save_dir is reported before the env is made
    callbacks: list[BaseCallback] = [
        IIFCallback(fraction=args.fraction, rule=args.rule),
        AttributionCallback(targets=("return",), save_dir=save_dir, overwrite=args.overwrite),
    ]
    model = InfluencePPO(
        "MlpPolicy",
        args.env,
        n_steps=n_steps,
        batch_size=min(args.batch_size, n_steps),
        n_epochs=args.n_epochs,
        seed=args.seed,
        verbose=args.verbose,
    )
    model.learn(args.timesteps, callback=callbacks)
    lines = [
        f"InfluencePPO + IIF (rule {args.rule}, fraction {args.fraction}) on {args.env}: "
        f"{model.num_timesteps} steps, {model.num_timesteps // n_steps} rounds of {n_steps} records, seed {args.seed}",
        "",
        summary(save_dir, top=args.top),
        "",
    ]
    episodes = [info["r"] for info in model.ep_info_buffer or []]
    if episodes:
        lines.append(f"Mean episode return over the last {len(episodes)} training episodes: {np.mean(episodes):.2f}")
    if args.eval_episodes > 0:
        mean_return, std_return = evaluate_policy(model, model.get_env(), n_eval_episodes=args.eval_episodes)  # type: ignore[arg-type]
        lines.append(f"Final mean episode return ({args.eval_episodes} eval episodes): {mean_return:.2f} +/- {std_return:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of ``sb3-influence run``.

    :param argv: Command-line arguments (default: ``sys.argv[1:]``).
    :return: The exit status.
    """
    args = make_parser().parse_args(argv)
    if args.eval_episodes < 0:
        make_parser().error(f"argument --eval-episodes: must be 0 (skip) or a positive int, got {args.eval_episodes}")
    if args.save_dir is not None:
        report = run(args, args.save_dir)
        report += f"\nSnapshots: {args.save_dir} (load them with sb3_influence.load_snapshots)"
    else:
        with tempfile.TemporaryDirectory(prefix="sb3_influence_run_") as save_dir:
            report = run(args, save_dir)
    print(report)
    return 0


if __name__ == "__main__":
    from sb3_influence.cli import main as cli_main

    raise SystemExit(cli_main(["run", *sys.argv[1:]]))
