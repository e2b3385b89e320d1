"""Learning-quality checks of the paper's claims (minutes each): `pytest -m expensive` or `make expensive`."""

import numpy as np
import pytest

from sb3_influence import bench

pytestmark = pytest.mark.expensive


def _curves(result: dict) -> tuple[list[int], list[float], list[float]]:
    rows = [row for row in result["rows"] if row["eval_return"] is not None]
    return [row["round"] for row in rows], [row["eval_return"] for row in rows], [row["cpu_time"] for row in rows]


@pytest.mark.timeout(1800)
def test_iif_learns_frozenlake_faster_than_ppo_and_random(tmp_path):
    """The paper's IIF experiment (Hu et al., arXiv 2505.19281, Sec. 5) on FrozenLake: IIF beats PPO, which beats random
    filtering (exact evaluation, 3 seeds)."""
    se = {"iif": [], "random": []}
    for seed in (0, 1, 2):
        runs = {arm: bench.run_one("FrozenLake", arm, seed, str(tmp_path), rounds=25) for arm in ("ppo", "iif", "random")}
        assert len({run["init_hash"] for run in runs.values()}) == 1  # paired: identical initial weights
        rounds, ppo_returns, _ = _curves(runs["ppo"])
        for arm in se:
            _, returns, _ = _curves(runs[arm])
            se[arm].append(bench.speedup_metrics(rounds, ppo_returns, returns, resolution=0.01)["se_ave"])
    assert np.mean(se["iif"]) > 0.1
    assert np.mean(se["iif"]) > np.mean(se["random"])
