#!/usr/bin/env bash
# The runs behind docs/benchmarks.md: 3 seeds, paper settings (see sb3_influence/bench/harness.py), 2 worker processes
# with one torch thread each. PPO and IIF of every environment first, random filtering afterwards.
# Finished runs are skipped; an interrupted run resumes from its last 10-round checkpoint in benchmarks/results/raw/.
set -euo pipefail
ENVS="FrozenLake Acrobot MiniGrid LunarLander"
nice -n 5 sb3-influence bench run --envs $ENVS --arms ppo iif --seeds 0 1 2 --eval-episodes 10 --workers 2
nice -n 5 sb3-influence bench run --envs $ENVS --arms random --seeds 0 1 2 --eval-episodes 10 --workers 2
sb3-influence bench summary --envs $ENVS --plots docs/_static/bench --json benchmarks/results/summary.json
