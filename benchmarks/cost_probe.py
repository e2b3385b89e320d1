"""
CPU cost of one round and one evaluation in every cell of the protocol, for the CPU-hour estimates of
docs/benchmarks.md (used for cells with no finished or unfinished run).

Per cell (environment × optimizer setting): build the seed-0 model, train one IIF round (process CPU time of
rollout + scoring + update) and evaluate the initial policy on ``--episodes`` episodes, scaled to 100 episodes.
A trained policy's episodes can be longer or shorter than the initial policy's, so the evaluation cost is a rough
guide (LunarLander and BipedalWalker episodes get longer as the policy learns to stay up).

    python benchmarks/cost_probe.py --out benchmarks/results/cost_probe.json
"""

import argparse
import platform
import time

import torch as th

from sb3_influence import bench


def probe(env: str, setting: str, episodes: int) -> dict[str, float]:
    spec = bench.ENVS[env]
    kwargs = bench.run_kwargs(spec, setting)
    model = bench.make_model(spec, 0, setting)
    callback = bench.make_callback("iif", spec.fraction)
    tic = time.process_time()
    model.learn(model.n_steps * model.n_envs, callback=callback)
    round_cpu = time.process_time() - tic
    eval_env = bench.make_eval_env(spec, episodes, 10_000)
    tic = time.process_time()
    bench.evaluate(model, spec, episodes, 10_000, eval_env)
    eval_cpu = (time.process_time() - tic) * (1 if spec.exact_eval else 100 / episodes)
    return {"round_cpu_s": round_cpu, "eval_cpu_s": eval_cpu, "rounds": kwargs["rounds"], "probe_episodes": episodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(bench.PAPER_ENVS), help="environments (default: all six)")
    parser.add_argument("--episodes", type=int, default=20, help="evaluation episodes measured (default: 20)")
    parser.add_argument("--out", default="benchmarks/results/cost_probe.json", help="output JSON (default: %(default)s)")
    args = parser.parse_args()
    th.set_num_threads(1)
    cells = {}
    for env in args.envs:
        for setting in bench.ENVS[env].settings:
            cells[f"{env} {setting}"] = probe(env, setting, args.episodes)
            print(env, setting, cells[f"{env} {setting}"], flush=True)
    bench.write_json(args.out, {"machine": platform.processor() or platform.machine(), "torch_threads": 1, "cells": cells})


if __name__ == "__main__":
    main()
