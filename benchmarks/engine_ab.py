"""
A change to the scoring engine, timed side by side: ``compute_influence()`` with the engine of a git revision
(``--base``) against the working tree's, in one process, on the same rollouts, in ABBA order, with the scores
compared.

Per case and repeat: collect a rollout; one untimed call (the first call after a rollout is slower); time
``compute_influence()`` in ABBA order (base, current, current, base), or BAAB on every other repeat; then time
PPO's ``train()`` from the same saved state (the denominator of the ratios). Reported: medians over repeats of each
engine's time over ``train()``, the median of the per-pair ratios current / base, and the largest score
difference relative to the largest score.

    python benchmarks/engine_ab.py --base 6519800~1 --repeats 8

One torch thread, CPU only. The base revision's ``sb3_influence/common/scoring/engine.py`` is loaded next to the
current package (the rest of the package is the working tree's), so it measures changes confined to that module.
"""

import argparse
import copy
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch as th

sys.path.insert(0, str(Path(__file__).parent))
import overhead

from sb3_influence.common.scoring import engine as current

ENGINE = "sb3_influence/common/scoring/engine.py"
#: The engine's methods that are swapped between the two versions
METHODS = ("influence", "alignment", "_fused_alignment", "_chunk_alignment", "_plan", "_jvp", "target_gradient")


def load_base(revision: str) -> types.ModuleType:
    """The engine module as it is at ``revision``."""
    source = subprocess.run(["git", "show", f"{revision}:{ENGINE}"], capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "engine_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("engine_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use(engine: Any, module: types.ModuleType) -> None:
    """Bind ``engine``'s scoring methods to ``module``'s engine class (the instance's state is shared)."""
    for name in METHODS:
        if hasattr(module.InfluenceEngine, name):
            setattr(engine, name, types.MethodType(getattr(module.InfluenceEngine, name), engine))


def measure(case: str, base: types.ModuleType, repeats: int) -> dict[str, Any]:
    params = overhead.CASES[case]
    model = overhead._model(params["env"], params["n_envs"], params["n_steps"], params["net_arch"])
    engine = next(value for value in vars(model).values() if isinstance(value, current.InfluenceEngine))
    times: dict[str, list[float]] = {"base": [], "current": [], "train": []}
    pairs, differences = [], []
    for repeat in range(repeats):
        overhead._collect(model)
        model.compute_influence()
        scores = {}
        order = ("base", "current", "current", "base") if repeat % 2 == 0 else ("current", "base", "base", "current")
        for name in order:
            use(engine, base if name == "base" else current)
            tic = time.perf_counter()
            scores[name] = model.compute_influence()
            times[name].append(time.perf_counter() - tic)
        pairs += [times["current"][-2] / times["base"][-2], times["current"][-1] / times["base"][-1]]
        differences.append(float(np.abs(scores["current"] - scores["base"]).max() / np.abs(scores["base"]).max()))
        saved = (copy.deepcopy(model.policy.state_dict()), copy.deepcopy(model.policy.optimizer.state_dict()))
        times["train"].append(overhead._timed_train(model))
        model.policy.load_state_dict(saved[0])
        model.policy.optimizer.load_state_dict(saved[1])
    train = statistics.median(times["train"])
    return {
        "case": case,
        "base_over_train": statistics.median(times["base"]) / train,
        "current_over_train": statistics.median(times["current"]) / train,
        "current_over_base": statistics.median(pairs),
        "max_relative_difference": max(differences),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--base", required=True, help="git revision of the engine to compare against")
    parser.add_argument("--repeats", type=int, default=7, help="rollouts per case (each timed ABBA)")
    parser.add_argument("--cases", nargs="+", default=list(overhead.CASES)[:2], choices=list(overhead.CASES))
    parser.add_argument("--out", default=None, help="write the results to this JSON file")
    args = parser.parse_args()
    th.set_num_threads(1)
    base = load_base(args.base)
    rows = [measure(case, base, args.repeats) for case in args.cases]
    print("| case | base / train() | current / train() | current / base (median of pairs) | max score difference |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['case']} | {100 * row['base_over_train']:.1f} % | {100 * row['current_over_train']:.1f} % | "
            f"{row['current_over_base']:.2f} | {row['max_relative_difference']:.0e} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"base": args.base, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
