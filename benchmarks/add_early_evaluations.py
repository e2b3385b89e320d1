"""
Give the result files made before their environment had ``eval_first`` (highway-v0's evaluation after each of its
first ten rounds) the evaluations they lack, without training the runs again.

A run is deterministic on the machine kind that made it, and evaluating does not touch its training (the
evaluation env is seeded afresh and the torch RNG restored). So the script replays the first ``eval_first`` rounds
of each such run with the current schedule (``bench.run_one`` with ``rounds=eval_first``, in a scratch folder),
checks the replay against the file **bit for bit** (initial weights, the kept fraction and step count of every
replayed round, and every evaluation the file already has among those rounds), and only then writes the new
evaluations into the file, under the current config, with a record of what was added (``early_evaluations``).
A file whose replay differs is left as it is and named: delete it and run it again with ``bench run``.
Unfinished runs are migrated too (their checkpoint stays valid), so they resume under the new schedule.

    nice -n 19 python benchmarks/add_early_evaluations.py --env highway --setting sgd [FILE ...]

Cost: ``eval_first`` rounds and evaluations per file (highway: 23–30 min of CPU measured, against ~1.8 h to
train a run again).
"""

import argparse
import glob
import json
import os
import tempfile
from typing import Any

import torch as th

from sb3_influence import bench
from sb3_influence.bench.harness import package_versions


def migrate(path: str, env: str, eval_episodes: int) -> str:
    """Add the missing early evaluations to one result file; return what was done."""
    with open(path) as file:
        result: dict[str, Any] = json.load(file)
    old = result["config"]
    spec = bench.ENVS[env]
    new_config = bench.run_config(env, old["setting"], old["arm"], old["seed"], old["variants"], old["rounds"], eval_episodes)
    if old == new_config:
        return "already on the current schedule"
    if {key: value for key, value in new_config.items() if key != "eval_first"} != old:
        return "its config differs from the current one in more than eval_first: not touched"
    first = spec.eval_first
    done = result["rows"][-1]["round"]
    if done < first:
        return f"only {done} rounds done: run it again with bench run"
    with tempfile.TemporaryDirectory() as scratch:
        replay = bench.run_one(env, old["arm"], old["seed"], scratch, old["setting"], old["variants"], first, eval_episodes)
    rows = {row["round"]: row for row in result["rows"]}
    mismatches = [
        f"round {row['round']} {key}: {rows[row['round']][key]!r} in the file, {row[key]!r} replayed"
        for row in replay["rows"]
        for key in ("timesteps", "kept_fraction", "eval_return")
        if rows[row["round"]].get(key) is not None and rows[row["round"]][key] != row[key]
    ]
    if replay["init_hash"] != result["init_hash"]:
        mismatches.insert(0, f"initial weights {result['init_hash']} in the file, {replay['init_hash']} replayed")
    if mismatches:
        return "the replay differs, not touched (delete the file and run it again): " + "; ".join(mismatches)
    added = []
    for row in replay["rows"]:
        if rows[row["round"]]["eval_return"] is None:
            rows[row["round"]].update(eval_return=row["eval_return"], eval_cpu_time=row["eval_cpu_time"])
            added.append(row["round"])
    spent = sum(rows[round_]["eval_cpu_time"] for round_ in added)
    result["config"] = new_config
    result["total_cpu_time"] += spent
    result["early_evaluations"] = {
        "rounds": added,
        "eval_cpu_time": spent,
        "replay_cpu_time": replay["total_cpu_time"],
        "checked": "initial weights, the kept fraction and step count of every replayed round and the evaluations "
        "the file had among them, bit for bit",
        "versions": package_versions(),
    }
    bench.write_json(path, result)
    return f"added the evaluations of rounds {added} ({spent:.0f} s of CPU; replay {replay['total_cpu_time']:.0f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="highway", help="environment (a key of bench.ENVS with eval_first > 0)")
    parser.add_argument("--setting", default="sgd", help="optimizer setting (the cell's folder)")
    parser.add_argument("--out", default="benchmarks/results/grid", help="results directory of bench run")
    parser.add_argument("--eval-episodes", type=int, default=100, help="as given to bench run (default: 100)")
    parser.add_argument("files", nargs="*", help="result files of the cell (default: all of them)")
    args = parser.parse_args()
    if bench.ENVS[args.env].eval_first == 0:
        parser.error(f"--env {args.env} has eval_first 0: there is nothing to add")
    th.set_num_threads(1)
    cell = bench.cell_directory(args.out, args.env, args.setting)
    paths = args.files or sorted(glob.glob(os.path.join(cell, "*.json")))
    if not paths:
        parser.error(f"no result files in {cell}")
    outside = [path for path in paths if os.path.dirname(os.path.abspath(path)) != os.path.abspath(cell)]
    if outside:
        parser.error(f"{', '.join(outside)} not in {cell}, the cell of --env {args.env} --setting {args.setting}")
    for path in paths:
        print(f"{path}: {migrate(path, args.env, args.eval_episodes)}", flush=True)


if __name__ == "__main__":
    main()
