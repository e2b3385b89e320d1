#!/usr/bin/env bash
# The grid behind docs/benchmarks.md: the paper's six environments with their optimizer settings, arms ppo, iif,
# random and (in the Adam settings only) iif-aware, seeds 0-4, 100 vectorised evaluation episodes (see
# sb3_influence/bench/harness.py). Cheapest cells first.
# Finished runs are skipped; an interrupted run resumes from its last 10-round checkpoint in benchmarks/results/grid/raw/.
# Ray dispatches the runs when it is installed (pip install torch==2.13.0 -e ".[distributed]"); add --address to use a cluster.
set -euo pipefail
WORKERS=${WORKERS:-2}
for ENV in FrozenLake Acrobot MiniGrid LunarLander highway BipedalWalker; do
    nice -n 5 sb3-influence bench run --envs $ENV --seeds 0 1 2 3 4 --workers "$WORKERS"
done
# The LunarLander investigation (docs/benchmarks.md, "Why LunarLander differs from the paper")
for VARIANT in drop-partial clip0.5 first-unfiltered; do
    nice -n 5 sb3-influence bench run --envs LunarLander --settings sgd --arms ppo iif --variants $VARIANT --workers "$WORKERS"
done
sb3-influence bench docs
