"""
Diagnostic: the unrolled score (``compute_influence(optimizer_aware="unrolled")``, a hypergradient through the whole
update) against the in-run optimizer-aware score and the paper's, on one round, by LDS on 5 % subsets. This is the
measurement that showed curvature between steps to be what the in-run score misses (``docs/faithfulness.md``).

    nice -n 19 python benchmarks/unrolled.py --env CartPole-v1 --round 3 --seed 1
"""

import argparse
import json
import time
from pathlib import Path

import torch as th

from sb3_influence.common import sb3_compat

RESULTS = Path(__file__).parent / "results" / "unrolled"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--env", default="CartPole-v1", help="gymnasium id (MLP policy)")
    parser.add_argument("--round", type=int, default=3, help="rounds trained before the scored one")
    parser.add_argument("--seed", type=int, default=1, help="seed")
    parser.add_argument("--n-steps", type=int, default=512, help="records per round")
    parser.add_argument("--subsets", type=int, default=40, help="random 5 %% subsets")
    args = parser.parse_args()

    from sb3_influence import InfluencePPO
    from sb3_influence.analysis.faithfulness import faithfulness

    th.set_num_threads(1)
    model = InfluencePPO("MlpPolicy", args.env, n_steps=args.n_steps, seed=args.seed)
    if args.round:
        model.learn(args.round * args.n_steps)
    sb3_compat.collect_rollout(model, reset_num_timesteps=False)
    start = time.process_time()
    scores = {
        "single": model.compute_influence(),
        "aware": model.compute_influence(optimizer_aware=True),
        "unrolled": model.compute_influence(optimizer_aware="unrolled"),
    }
    seconds = time.process_time() - start
    result = faithfulness(model, scores, sizes=(0.05,), n_subsets=args.subsets, n_orders=4, seed=1)
    result.update(env=args.env, round=args.round, seed=args.seed, n_steps=args.n_steps, scoring_cpu_s=seconds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.env}_r{args.round}_s{args.seed}_n{args.subsets}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path.name, {name: round(value, 3) for name, value in result["lds"].items()}, "ceiling", round(result["ceiling"], 3))


if __name__ == "__main__":
    main()
