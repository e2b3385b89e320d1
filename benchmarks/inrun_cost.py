"""
Cost of the in-run optimizer-aware scorer next to the PPO update it rides on, measured side by side.

Per case: build the seed-0 model (SB3's PPO defaults: ``n_steps=2048``, batch 64, 10 epochs, Adam 3e-4, with
``max_grad_norm=0.5`` or with clipping off), train ``--rounds`` rounds of plain PPO, collect the next rollout and
open its round. Then, ``--repeats`` times, run the round's ``update()`` from the round's saved training state
(parameters, optimizer state, RNG) alone and with an :class:`OptimizerAwareScorer` (``"return"`` target, as
``AttributionCallback(optimizer_aware=True)`` builds it) in ABBA order (alone, scored, scored, alone), so that
drifts of a shared machine's load cancel. Timed: process CPU time of ``update()`` (the scorer's construction and
its target gradient included). Reported per case: medians over repeats of both times and of the ratio
``t_scored / t_alone`` (each repeat's ratio of its two means), and the fraction of steps whose gradient norm was
clipped.

    OMP_NUM_THREADS=1 python benchmarks/inrun_cost.py --repeats 5 --label after --out benchmarks/results/inrun_cost.json
    OMP_NUM_THREADS=1 python benchmarks/inrun_cost.py --parts --repeats 6 --label parts \
        --out benchmarks/results/inrun_cost.json

With ``--parts`` each case times instead the update alone and with the scorer cut after each of its stages
(:data:`PARTS`: the capture of the update's passes; the capture and each step's recording; the whole scorer), to
show where its cost goes. One torch thread, CPU only. ``--label`` names the entry of the JSON the run writes
(other labels already in the file are kept, so that a "before" and an "after" measurement sit side by side).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.logger import Logger

# benchmarks/ is not a package: reuse overhead.py's rollout helper
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import _collect

import sb3_influence
from sb3_influence import ReturnTarget, bench
from sb3_influence.common import sb3_compat
from sb3_influence.common.scoring.optimizer_aware import OptimizerAwareScorer
from sb3_influence.common.state import training_state

CASES: dict[str, dict[str, Any]] = {
    "CartPole MLP, clip 0.5": dict(env="CartPole", max_grad_norm=0.5),
    "CartPole MLP, no clip": dict(env="CartPole", max_grad_norm=1e10),
    "LunarLander MLP, clip 0.5": dict(env="LunarLander", max_grad_norm=0.5),
    "LunarLander MLP, no clip": dict(env="LunarLander", max_grad_norm=1e10),
    "MiniGrid CNN, clip 0.5": dict(env="MiniGrid", max_grad_norm=0.5),
}


class _ClipCounter:
    """Step hook counting the steps whose gradient norm was clipped."""

    def __init__(self) -> None:
        self.steps = 0
        self.clipped = 0

    def __call__(self, info: Any) -> None:
        self.steps += 1
        self.clipped += info.clip_coef < 1.0


def _model(env: str, max_grad_norm: float, rounds: int) -> Any:
    """The seed-0 model of ``env`` (SB3's PPO defaults), ``rounds`` rounds trained, its next rollout's round open."""
    spec = bench.ENVS[env]
    model = bench.make_model(spec, 0, "adam3e-4", n_envs=1, n_steps=2048, max_grad_norm=max_grad_norm)
    if rounds:
        model.learn(rounds * model.n_steps)
    sb3_compat.setup_learn(model, 10**9, reset_num_timesteps=False)
    _collect(model)
    model.run_round()
    return model


class _CaptureOnly(OptimizerAwareScorer):
    """The scorer's capture of the update's passes (forward hooks, kept output gradients) and nothing else."""

    def _score_step(self, info: Any) -> None:
        self._prepare(info.optimizer)
        self._output_gradients()


class _RecordOnly(OptimizerAwareScorer):
    """The capture and each step's recording (gradients, optimizer state, layer calls), no batched scoring."""

    def _score_pending(self, pending: Any, layout: Any, v: Any) -> None:
        pass


#: ``--parts``: the scorer cut after each of its stages, to see where its cost goes
PARTS: dict[str, type[OptimizerAwareScorer]] = {
    "capture": _CaptureOnly,
    "capture + record": _RecordOnly,
    "full": OptimizerAwareScorer,
}


def _timed_update(model: Any, scored: bool | type[OptimizerAwareScorer], hooks: list[Any] | None = None) -> float:
    """
    CPU seconds of the round's ``update()`` from θ(k), with the in-run scorer (``scored``: ``True`` or the scorer
    class to use) or without; the state is put back after.
    """
    round_ = model.current_round()
    scorer = OptimizerAwareScorer if scored is True else scored
    with training_state(model):
        round_.start_state.restore(model, keep=False)
        sb3_compat.set_model_logger(model, Logger(folder=None, output_formats=[]))
        tic = time.process_time()
        step_hooks = [scorer(model, ReturnTarget(), model.influence_batch_size)] if scorer else []
        model.update(step_hooks=step_hooks + (hooks or []))
        return time.process_time() - tic


def measure_parts(env: str, max_grad_norm: float, repeats: int, rounds: int) -> dict[str, Any]:
    """
    The update alone and with the scorer cut after each stage (:data:`PARTS`), in one process, each repeat in the
    order alone, parts…, parts reversed…, alone. Medians over the repeats of each variant's excess over the update.

    :return: Per variant: the median CPU seconds and the median excess in % of ``update()``.
    """
    model = _model(env, max_grad_norm, rounds)
    variants: dict[str, Any] = {"alone": False, **PARTS}
    for scorer in variants.values():
        _timed_update(model, scorer)  # warm-up, not timed
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        order = list(variants)
        for name in order + order[::-1]:
            times[name].append(_timed_update(model, variants[name]))
    alone = statistics.median(times["alone"])
    return {
        name: {"update_s": statistics.median(values), "excess_percent": 100 * (statistics.median(values) / alone - 1)}
        for name, values in times.items()
    }


def measure_case(env: str, max_grad_norm: float, repeats: int, rounds: int) -> dict[str, Any]:
    """
    Side-by-side timings of one case.

    :return: Medians and the raw per-repeat numbers.
    """
    model = _model(env, max_grad_norm, rounds)
    counter = _ClipCounter()
    # Warm-up, not timed (first calls pay for lazy set-up and allocator growth)
    _timed_update(model, False, [counter])
    _timed_update(model, True)
    rows = []
    for _ in range(repeats):
        alone, scored = [], []
        for with_scorer in (False, True, True, False):
            (scored if with_scorer else alone).append(_timed_update(model, with_scorer))
        rows.append(dict(alone=float(np.mean(alone)), scored=float(np.mean(scored))))
    return {
        "update_s": statistics.median(r["alone"] for r in rows),
        "update_with_scorer_s": statistics.median(r["scored"] for r in rows),
        "ratio": statistics.median(r["scored"] / r["alone"] for r in rows),
        "clipped_steps": counter.clipped / max(counter.steps, 1),
        "optimizer_steps": counter.steps,
        "repeats": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="ABBA repeats per case (medians over them)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of plain PPO before the measured round")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--label", default="current", help="name of this measurement in the JSON")
    parser.add_argument("--out", default=None, help="add the results to this JSON file")
    parser.add_argument(
        "--parts", action="store_true", help="time the scorer cut after each stage instead (capture, record, full)"
    )
    args = parser.parse_args()
    th.set_num_threads(1)
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/inrun_cost.py", *sys.argv[1:]]),
        # the commit of the sb3_influence that is imported (a "before" run may import another checkout)
        "commit": subprocess.run(
            ["git", "-C", os.path.dirname(sb3_influence.__file__), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "threads": 1,
        "torch": th.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cases": {},
    }
    for name in args.cases:
        if args.parts:
            case = measure_parts(**CASES[name], repeats=args.repeats, rounds=args.rounds)
            result["cases"][name] = case
            print(f"{name}: " + ", ".join(f"{part} {v['excess_percent']:+.1f} %" for part, v in case.items()), flush=True)
            continue
        case = measure_case(**CASES[name], repeats=args.repeats, rounds=args.rounds)
        result["cases"][name] = case
        print(
            f"{name}: update {case['update_s']:.2f} s, with scorer {case['update_with_scorer_s']:.2f} s, "
            f"ratio {case['ratio']:.3f} ({100 * (case['ratio'] - 1):+.1f} %), clipped steps {case['clipped_steps']:.0%}",
            flush=True,
        )
    if args.out:
        previous: dict[str, Any] = {}
        if os.path.exists(args.out):
            with open(args.out) as file:
                previous = json.load(file)
        previous[args.label] = result
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as file:
            json.dump(previous, file, indent=1)


if __name__ == "__main__":
    main()
