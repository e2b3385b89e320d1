import json
import os

import gymnasium as gym
import numpy as np
import pytest

from sb3_influence import bench


def test_first_round():
    rounds, returns = [0, 1, 2, 3], [0.0, 0.5, 0.4, 0.9]
    assert bench.first_round(rounds, returns, 0.45) == 1
    assert bench.first_round(rounds, returns, 0.9) == 3
    assert bench.first_round(rounds, returns, 1.0) is None
    with pytest.raises(ValueError, match="same length"):
        bench.first_round(rounds, returns[:2], 0.1)


def test_ppo_levels_are_successive_new_bests_after_round_zero():
    levels = bench.ppo_levels([0, 1, 2, 3, 4, 5], [1.0, 0.5, 2.0, 1.5, 2.0, 3.0])
    # round 1 is below the initial value, round 4 only ties the best: neither is a level
    assert levels == [(2, 2.0), (5, 3.0)]


def test_speedup_metrics_hand_made_curves():
    rounds = [0, 1, 2, 3, 4]
    ppo = [0.0, 1.0, 2.0, 3.0, 4.0]
    iif = [0.0, 2.0, 4.0, 4.0, 4.0]
    ppo_time = [0.0, 1.0, 2.0, 3.0, 4.0]
    iif_time = [0.0, 0.9, 1.8, 2.7, 3.6]
    metrics = bench.speedup_metrics(rounds, ppo, iif, ppo_time, iif_time)
    # levels 1, 2, 3, 4 reached by PPO at rounds 1..4 and by IIF at rounds 1, 1, 2, 2
    assert metrics["n_levels"] == 4
    assert metrics["se_ave"] == pytest.approx(np.mean([0.0, 1 - 1 / 2, 1 - 2 / 3, 1 - 2 / 4]))
    assert metrics["se_peak"] == pytest.approx(0.5)
    assert metrics["rt_peak"] == pytest.approx(1 - 1.8 / 4.0)
    assert metrics["peak_reached"] == 1.0
    # Swapping the arms gives the slower method negative reductions
    assert bench.speedup_metrics(rounds, iif, ppo)["se_peak"] < 0
    # Identical curves: no speed-up at all
    same = bench.speedup_metrics(rounds, ppo, ppo, ppo_time, ppo_time)
    assert same["se_ave"] == same["se_peak"] == same["rt_peak"] == 0.0


def test_speedup_metrics_unreached_and_flat():
    rounds = [0, 1, 2, 3, 4]
    metrics = bench.speedup_metrics(rounds, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    # never reached: counted as reached at round 5 (and after 5 s)
    assert metrics["se_peak"] == pytest.approx(1 - 5 / 4)
    assert metrics["rt_peak"] == pytest.approx(1 - 5 / 4)
    assert metrics["se_ave"] == pytest.approx(np.mean([1 - 5 / m for m in (1, 2, 3, 4)]))
    assert metrics["peak_reached"] == 0.0
    flat = bench.speedup_metrics(rounds, [3, 2, 1, 0, 0], [0, 1, 2, 3, 4])
    assert flat["n_levels"] == 0 and np.isnan(flat["se_ave"])
    with pytest.raises(ValueError, match="same length"):
        bench.speedup_metrics(rounds, [0, 1], [0, 1])


def test_bootstrap_ci():
    low, high = bench.bootstrap_ci([2.0, 2.0, 2.0])
    assert low == high == 2.0
    values = np.random.default_rng(1).normal(5.0, 1.0, size=50)
    low, high = bench.bootstrap_ci(values)
    assert low < values.mean() < high
    assert high - low < 1.0
    assert np.isnan(bench.bootstrap_ci([np.nan])[0])
    with pytest.raises(ValueError, match="level"):
        bench.bootstrap_ci([1.0], level=1.5)


def test_exact_frozenlake_return_matches_monte_carlo():
    spec = bench.ENVS["FrozenLake"]
    model = bench.make_model(spec, seed=3, n_steps=64)
    # Make the policy far from uniform so that the goal is reached often
    with th_no_grad():
        model.policy.action_net.bias.copy_(model.policy.action_net.bias.new_tensor([0.0, 1.5, 1.5, 0.0]))
    env = gym.make(spec.env_id, **spec.env_kwargs)
    exact = bench.exact_frozenlake_return(model, env)
    obs, _ = model.policy.obs_to_tensor(np.arange(16))
    probs = model.policy.get_distribution(obs).distribution.probs.detach().numpy()
    # Independent check: simulate 20 000 episodes through the transition table
    rng = np.random.default_rng(0)
    n = 20_000
    state, alive, total = np.zeros(n, dtype=int), np.ones(n, dtype=bool), np.zeros(n)
    for _ in range(100):
        actions = (rng.random(n)[:, None] > probs[state].cumsum(axis=1)).sum(axis=1)
        for i in np.flatnonzero(alive):
            _, state[i], reward, done = env.unwrapped.P[state[i]][actions[i]][0]
            total[i] += reward
            alive[i] = not done
    assert 0.05 < exact < 0.95
    assert exact == pytest.approx(total.mean(), abs=4 * np.sqrt(exact * (1 - exact) / n))


def th_no_grad():
    import torch as th

    return th.no_grad()


def _fake_result(arm, seed, returns, times, init_hash="abc"):
    rows = [dict(round=r, timesteps=r * 10, wall_time=t, round_time=1.0, eval_return=v, kept_fraction=1.0)
            for r, (v, t) in enumerate(zip(returns, times, strict=True))]  # fmt: skip
    return {"config": {"arm": arm, "seed": seed}, "init_hash": init_hash, "complete": True, "rows": rows}


def test_summarize_and_table(tmp_path):
    out = str(tmp_path)
    ppo = [0.0, 1.0, 2.0, 3.0, 4.0]
    for seed, iif in enumerate(([0.0, 2.0, 4.0, 4.0, 4.0], [0.0, 1.0, 2.0, 4.0, 4.0])):
        bench._write_json(bench.result_path(out, "Acrobot", "ppo", seed), _fake_result("ppo", seed, ppo, range(5)))
        bench._write_json(bench.result_path(out, "Acrobot", "iif", seed), _fake_result("iif", seed, iif, range(5)))
    summary = bench.summarize(out, "Acrobot", final_window=2)
    per_seed = summary["iif"]["per_seed"]
    assert per_seed[0]["se_peak"] == pytest.approx(0.5)
    assert per_seed[1]["se_peak"] == pytest.approx(0.25)
    assert summary["iif"]["se_peak"]["mean"] == pytest.approx(0.375)
    assert summary["iif"]["se_peak"]["se"] == pytest.approx(np.std([0.5, 0.25], ddof=1) / np.sqrt(2))
    assert per_seed[0]["final_gain"] == pytest.approx(0.5)
    assert "random" not in summary
    table = bench.markdown_table(out, ["Acrobot"])
    assert "| Acrobot | iif | 2 |" in table and "37.5" in table
    bench.plot(out, "Acrobot", os.path.join(out, "plot.png"))
    assert os.path.getsize(os.path.join(out, "plot.png")) > 0
    # Different initial weights for the same seed are an error
    bench._write_json(bench.result_path(out, "Acrobot", "iif", 0), _fake_result("iif", 0, ppo, range(5), init_hash="other"))
    with pytest.raises(RuntimeError, match="same initial weights"):
        bench.summarize(out, "Acrobot")


def test_same_seed_same_initial_weights():
    spec = bench.ENVS["CartPole"]
    first, again, other = (bench.make_model(spec, seed, n_steps=64) for seed in (0, 0, 1))
    assert bench.parameter_hash(first) == bench.parameter_hash(again) != bench.parameter_hash(other)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="arm"):
        bench.make_callback("ppo2", 0.5)
    with pytest.raises(ValueError, match="env"):
        bench.run_one("Pong", "ppo", 0, str(tmp_path))
    with pytest.raises(ValueError, match="unknown arm"):
        bench.run_all(["CartPole"], ["nope"], [0], str(tmp_path))
    with pytest.raises(ValueError, match="eval_episodes"):
        bench.run_all(["CartPole"], ["ppo"], [0], str(tmp_path), eval_episodes=0)


def test_run_one_end_to_end_and_skip_finished(tmp_path):
    out = str(tmp_path)
    result = bench.run_one("CartPole", "ppo", 0, out, rounds=2, eval_episodes=2)
    assert [row["round"] for row in result["rows"]] == [0, 1, 2]
    assert result["complete"] and result["rows"][-1]["timesteps"] == 2 * bench.PPO_KWARGS["n_steps"]
    assert all(row["eval_return"] > 0 and row["kept_fraction"] == 1.0 for row in result["rows"])
    assert result["init_hash"] == bench.parameter_hash(bench.make_model(bench.ENVS["CartPole"], 0))
    path = bench.result_path(out, "CartPole", "ppo", 0)
    with open(path) as file:
        assert json.load(file) == result
    mtime = os.path.getmtime(path)
    # A finished run is not trained again
    assert bench.run_one("CartPole", "ppo", 0, out, rounds=2, eval_episodes=2) == result
    assert os.path.getmtime(path) == mtime
    assert bench.main(["summary", "--out", out, "--envs", "CartPole"]) == 0


def test_filtering_arms_drop_records_from_identical_initial_weights(tmp_path):
    out = str(tmp_path)
    results = {arm: bench.run_one("CartPole", arm, 5, out, rounds=1, eval_episodes=1) for arm in bench.ARMS}
    assert len({result["init_hash"] for result in results.values()}) == 1
    kept = {arm: result["rows"][1]["kept_fraction"] for arm, result in results.items()}
    assert kept["ppo"] == 1.0
    # Same seed, same first rollout: both filters drop floor(0.5 * n_neg) of the same records' count
    assert 0.5 < kept["iif"] < 1.0
    assert kept["random"] == kept["iif"]


def test_resolution_floors_creeping_curves():
    rounds = [0, 1, 2, 3, 4]
    # An exact evaluation creeping to 1: without a resolution every tiny gain is a new PPO level and a peak
    # that the other arm "misses" by 1e-4
    ppo = [0.0, 0.5, 0.999, 0.9999, 0.99999]
    iif = [0.0, 0.9, 0.9995, 0.9995, 0.9995]
    raw = bench.speedup_metrics(rounds, ppo, iif)
    assert raw["n_levels"] == 4 and raw["peak_reached"] == 0.0
    floored = bench.speedup_metrics(rounds, ppo, iif, resolution=0.01)
    # levels 0.5 and 0.99, both reached by IIF at round 1 and 2
    assert floored["n_levels"] == 2 and floored["peak_reached"] == 1.0
    assert floored["se_ave"] == pytest.approx(np.mean([0.0, 0.0]))
    with pytest.raises(ValueError, match="resolution"):
        bench.speedup_metrics(rounds, ppo, iif, resolution=-1)


def test_time_key_prefers_cpu_time():
    result = _fake_result("ppo", 0, [0.0, 1.0], [0.0, 2.0])
    assert bench.time_key(result) == "wall_time"
    for row, cpu in zip(result["rows"], (0.0, 1.5), strict=True):
        row["cpu_time"] = cpu
    assert bench.time_key(result) == "cpu_time"
    assert bench.curve(result, "cpu_time")[2].tolist() == [0.0, 1.5]


def test_initial_weights_do_not_depend_on_the_callers_thread_count():
    import torch as th

    previous = th.get_num_threads()
    try:
        hashes = set()
        for threads in (1, 2):
            th.set_num_threads(threads)
            hashes.add(bench.parameter_hash(bench.make_model(bench.ENVS["CartPole"], 0, n_steps=64)))
            assert th.get_num_threads() == threads
    finally:
        th.set_num_threads(previous)
    assert len(hashes) == 1
