import json
import itertools
import os
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
import torch as th

import sb3_influence
from conftest import requires
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


def test_curve_mean_weighs_each_evaluation_by_the_rounds_it_stands_for():
    # regular schedule: the plain mean of the evaluations after round 0 (the committed cells' curve score)
    assert bench.curve_mean([0, 3, 6, 9], [-5.0, 1.0, 2.0, 6.0]) == pytest.approx(3.0)
    # denser early: rounds 1 and 2 stand for one round each, round 12 for ten
    assert bench.curve_mean([0, 1, 2, 12], [0.0, 1.0, 3.0, 5.0]) == pytest.approx((1.0 + 3.0 + 10 * 5.0) / 12)
    with pytest.raises(ValueError, match="round 0"):
        bench.curve_mean([1, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="one return per round"):
        bench.curve_mean([0, 1, 2], [1.0, 2.0])


def test_highway_is_evaluated_every_round_until_10_and_only_its_config_says_so():
    highway = bench.ENVS["highway"]
    assert highway.eval_rounds(100) == [*range(11), *range(20, 101, 10)]
    assert bench.ENVS["LunarLander"].eval_rounds(10) == [0, 3, 6, 9, 10]
    assert bench.run_config("highway", "sgd", "iif", 0)["eval_first"] == 10
    # the other environments' configs, and so their committed result files, stay as they were
    assert all("eval_first" not in bench.run_config(env, "sgd", "ppo", 0) for env in ("Acrobot", "LunarLander"))
    from sb3_influence.bench import stats

    # a learning curve evaluated so is scored by the rounds, not by the number of evaluations
    rows = [{"round": r, "eval_return": 1.0 if r <= 10 else 2.0, "wall_time": float(r)} for r in range(101)]
    result = {"rows": [row for row in rows if highway.evaluated(row["round"], 100)]}
    low, high = highway.score_range
    assert stats.normalized_score(result, "highway") == pytest.approx(((10 + 2.0 * 90) / 100 - low) / (high - low))


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


@requires("matplotlib", extra="bench")
def test_summarize_and_table(tmp_path):
    out = str(tmp_path)
    ppo = [0.0, 1.0, 2.0, 3.0, 4.0]
    for seed, iif in enumerate(([0.0, 2.0, 4.0, 4.0, 4.0], [0.0, 1.0, 2.0, 4.0, 4.0])):
        bench.write_json(bench.result_path(out, "Acrobot", "sgd", "ppo", seed), _fake_result("ppo", seed, ppo, range(5)))
        bench.write_json(bench.result_path(out, "Acrobot", "sgd", "iif", seed), _fake_result("iif", seed, iif, range(5)))
    cell = bench.cell_directory(out, "Acrobot", "sgd")
    summary = bench.summarize(cell, "Acrobot", final_window=2)
    per_seed = summary["iif"]["per_seed"]
    assert per_seed[0]["se_peak"] == pytest.approx(0.5)
    assert per_seed[1]["se_peak"] == pytest.approx(0.25)
    assert summary["iif"]["se_peak"]["mean"] == pytest.approx(0.375)
    assert summary["iif"]["se_peak"]["se"] == pytest.approx(np.std([0.5, 0.25], ddof=1) / np.sqrt(2))
    assert per_seed[0]["final_gain"] == pytest.approx(0.5)
    assert "random" not in summary
    table = bench.markdown_table([("Acrobot sgd", cell, "Acrobot")])
    assert "| Acrobot sgd | iif | 2 |" in table and "37.5" in table
    assert bench.plot(cell, "Acrobot", os.path.join(out, "plot.png"))
    assert os.path.getsize(os.path.join(out, "plot.png")) > 0
    assert not bench.plot(os.path.join(out, "nothing"), "Acrobot", os.path.join(out, "none.png"))
    # A seed evaluated at other rounds is an error naming it, not a curve with that seed silently left out
    shifted = _fake_result("iif", 1, [0.0, 2.0, 4.0, 4.0, 4.0], range(5))
    for row in shifted["rows"]:
        row["round"] += 1
    bench.write_json(bench.result_path(out, "Acrobot", "sgd", "iif", 1), shifted)
    with pytest.raises(ValueError, match=r"iif runs of seeds \[1\] were evaluated at other rounds than seed 0"):
        bench.plot(cell, "Acrobot", os.path.join(out, "mixed.png"))
    bench.write_json(bench.result_path(out, "Acrobot", "sgd", "iif", 1), _fake_result("iif", 1, ppo, range(5)))
    # Different initial weights for the same seed are an error
    bench.write_json(bench.result_path(out, "Acrobot", "sgd", "iif", 0), _fake_result("iif", 0, ppo, range(5), "other"))
    with pytest.raises(RuntimeError, match="same initial weights"):
        bench.summarize(cell, "Acrobot")


def test_same_seed_same_initial_weights():
    spec = bench.ENVS["CartPole"]
    first, again, other = (bench.make_model(spec, seed, n_steps=64) for seed in (0, 0, 1))
    assert bench.parameter_hash(first) == bench.parameter_hash(again) != bench.parameter_hash(other)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="arm"):
        bench.make_callback("ppo2", 0.5)
    with pytest.raises(ValueError, match="unknown env 'Pong'"):
        bench.run_one("Pong", "ppo", 0, str(tmp_path))
    with pytest.raises(ValueError, match="unknown arm 'nope'"):
        bench.grid(["CartPole"], ["nope"], [0])
    with pytest.raises(ValueError, match="unknown setting 'rmsprop'"):
        bench.grid(["CartPole"], ["ppo"], [0], settings=["rmsprop"])
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        bench.grid(["CartPole"], ["ppo"], [0], variants=["fast"])
    with pytest.raises(ValueError, match="eval_episodes"):
        bench.grid(["CartPole"], ["ppo"], [0], eval_episodes=0)
    with pytest.raises(ValueError, match="seeds is empty"):
        bench.grid(["CartPole"], ["ppo"], [])
    # Before any run starts, not in a worker after the grid started (gymnasium refuses negative seeds)
    with pytest.raises(ValueError, match=r"seeds must be ints >= 0 \(gymnasium's seeds\), got -1"):
        bench.grid(["CartPole"], ["ppo"], [0, -1])
    with pytest.raises(ValueError, match=r"got 1\.5"):
        bench.grid(["CartPole"], ["ppo"], [1.5])
    with pytest.raises(ValueError, match=r"seeds \[0\] are given twice"):
        bench.grid(["CartPole"], ["ppo"], [0, 1, 0])
    with pytest.raises(ValueError, match="got -3"):
        bench.run_one("CartPole", "ppo", -3, str(tmp_path))
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="backend"):
        bench.run_grid([], str(tmp_path), backend="slurm")


def test_run_one_end_to_end_and_skip_finished(tmp_path, monkeypatch):
    out = str(tmp_path)
    result = bench.run_one("CartPole", "ppo", 0, out, rounds=2, eval_episodes=2)
    assert [row["round"] for row in result["rows"]] == [0, 1, 2]
    assert result["complete"] and result["rows"][-1]["timesteps"] == 2 * bench.PPO_KWARGS["n_steps"]
    assert all(row["eval_return"] > 0 and row["kept_fraction"] == 1.0 for row in result["rows"])
    assert result["init_hash"] == bench.parameter_hash(bench.make_model(bench.ENVS["CartPole"], 0))
    assert 0 < result["total_cpu_time"] and all(row["eval_cpu_time"] >= 0 for row in result["rows"])
    path = bench.result_path(out, "CartPole", "sgd", "ppo", 0)
    with open(path) as file:
        assert json.load(file) == result
    mtime = os.path.getmtime(path)
    # A finished run is not trained again, by run_one or by the grid
    assert bench.run_one("CartPole", "ppo", 0, out, rounds=2, eval_episodes=2) == result
    job = bench.Job("CartPole", "sgd", "ppo", 0, rounds=2, eval_episodes=2)
    assert job.finished(out) and not bench.missing([job], out)
    assert bench.run_grid([job], out, workers=1, backend="process", log=lambda line: None) > 0
    # Without Ray installed, "auto" falls back to the local process pool
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    lines = []
    bench.run_grid([job], out, workers=2, backend="auto", log=lines.append)
    assert lines[0] == "1 of 1 runs already finished; running 0 with backend 'process'"
    assert os.path.getmtime(path) == mtime
    # Another configuration is another run
    assert not bench.Job("CartPole", "sgd", "ppo", 0, rounds=3, eval_episodes=2).finished(out)


def test_filtering_arms_drop_records_from_identical_initial_weights(tmp_path):
    out = str(tmp_path)
    arms = bench.arms_for("sgd", env="CartPole")
    assert {"iif-trajectory", "dtv-loo"} <= set(arms) and "iif-aware" not in arms
    results = {arm: bench.run_one("CartPole", arm, 5, out, rounds=1, eval_episodes=1) for arm in arms}
    assert len({result["init_hash"] for result in results.values()}) == 1
    kept = {arm: result["rows"][1]["kept_fraction"] for arm, result in results.items()}
    assert kept["ppo"] == 1.0
    # Same seed, same first rollout: both filters drop floor(0.5 * n_neg) of the same records' count
    assert 0.5 < kept["iif"] < 1.0
    assert kept["random"] == kept["iif"]
    # Whole trajectories, at least half the records of the negative ones
    assert 0.0 < kept["iif-trajectory"] < 1.0 and 0.0 < kept["dtv-loo"] < 1.0
    assert results["dtv-loo"]["config"]["filter_class"] == "DTVLooCallback"
    assert results["iif-trajectory"]["config"]["iif_kwargs"] == {"unit": "trajectory", "budget": "records"}
    assert "filter_class" not in results["iif"]["config"] and "iif_kwargs" not in results["iif"]["config"]
    # The trajectory arms run on MiniGrid's SGD cell only among the paper's cells
    assert bench.arms_for("sgd", env="MiniGrid") == ("ppo", "iif", "random", "iif-trajectory", "dtv-loo")
    assert bench.arms_for("sgd", env="Acrobot") == ("ppo", "iif", "random")
    with pytest.raises(ValueError, match=r"runs in settings sgd of MiniGrid, DoorKey, CartPole only"):
        bench.run_config("Acrobot", "sgd", "dtv-loo", 0)


def test_drop_partial_variant_leaves_whole_minibatches(tmp_path):
    out = str(tmp_path)
    plain = bench.run_one("CartPole", "iif", 2, out, rounds=1, eval_episodes=1)
    variant = bench.run_one("CartPole", "iif", 2, out, variants=["drop-partial"], rounds=1, eval_episodes=1)
    n = bench.PPO_KWARGS["n_steps"]
    n_plain, n_variant = (round(r["rows"][1]["kept_fraction"] * n) for r in (plain, variant))
    assert n_plain % 64 != 0  # otherwise this test checks nothing
    assert n_variant == n_plain - n_plain % 64
    assert os.path.exists(bench.result_path(out, "CartPole", "sgd", "iif", 2, ["drop-partial"]))


def test_a_run_that_would_not_start_from_its_ppo_runs_weights_fails_before_training(tmp_path):
    out = str(tmp_path)
    ppo = bench.run_one("CartPole", "ppo", 3, out, rounds=1, eval_episodes=1)
    versions = ppo["versions"]
    assert set(versions) == {"torch", "stable-baselines3", "gymnasium", "numpy"} and all(versions.values())
    # The PPO run made under other package versions (other initial weights for the same seed)
    path = bench.result_path(out, "CartPole", "sgd", "ppo", 3)
    other = {**ppo, "init_hash": "0" * 16, "versions": {**versions, "stable-baselines3": "0.0"}}
    other["init_fingerprint"] = [value + 0.1 for value in ppo["init_fingerprint"]]
    bench.write_json(path, other)
    with pytest.raises(RuntimeError, match=r"other initial weights.*'stable-baselines3': '0.0'.*ppo_seed3.json and run"):
        bench.run_one("CartPole", "iif", 3, out, rounds=1, eval_episodes=1)
    assert not os.path.exists(bench.result_path(out, "CartPole", "sgd", "iif", 3))
    # The runs of the seed that started with that PPO run are named with it: deleting PPO alone would orphan them
    bench.write_json(bench.result_path(out, "CartPole", "sgd", "random", 3), {**other, "config": {}})
    with pytest.raises(RuntimeError, match=r"Delete \S*ppo_seed3.json and \S*random_seed3.json and run them again"):
        bench.run_one("CartPole", "iif", 3, out, rounds=1, eval_episodes=1)
    os.remove(bench.result_path(out, "CartPole", "sgd", "random", 3))
    # A variant cell pairs with its own PPO run: trained there, whether the variant changes PPO (clip0.5) or only
    # filtering (drop-partial: the run without the variant is reused only where it started from the same weights)
    for variants in (["clip0.5"], ["drop-partial"]):
        for arm in ("iif", "ppo"):
            result = bench.run_one("CartPole", arm, 3, out, variants=variants, rounds=1, eval_episodes=1)
            assert result["complete"] and "reused_from" not in result and result["init_hash"] == ppo["init_hash"]
        assert bench.summarize(os.path.join(out, "CartPole", bench.cell_name("sgd", variants)), "CartPole")["iif"]
    # Without a fingerprint, another hash is another start
    bench.write_json(path, {key: value for key, value in ppo.items() if key != "init_fingerprint"} | {"init_hash": "0"})
    with pytest.raises(RuntimeError, match="without 'init_fingerprint'"):
        bench.run_one("CartPole", "iif", 3, out, rounds=1, eval_episodes=1)
    # The same weights up to a few ulps (another CPU's kernels): another hash, the same start
    import torch as th

    model = bench.make_model(bench.ENVS["CartPole"], 3)
    with th.no_grad():
        for parameter in model.policy.parameters():
            parameter.copy_(th.nextafter(parameter, th.full_like(parameter, 1.0)))
    ulps = {"init_hash": bench.parameter_hash(model), "init_fingerprint": bench.parameter_fingerprint(model)}
    assert ulps["init_hash"] != ppo["init_hash"]
    bench.write_json(path, {**ppo, **ulps})
    assert bench.run_one("CartPole", "iif", 3, out, rounds=1, eval_episodes=1)["init_hash"] == ppo["init_hash"]
    assert bench.summarize(os.path.join(out, "CartPole", "sgd"), "CartPole")["iif"]["per_seed"]


def test_an_interrupted_run_resumes_from_its_committed_checkpoint_which_goes_once_it_finishes(tmp_path):
    out = str(tmp_path)
    whole = bench.run_one("CartPole", "iif", 0, os.path.join(out, "whole"), rounds=3, eval_episodes=2, checkpoint_every=1)

    def stop(round_, rounds):
        if round_ == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench.run_one("CartPole", "iif", 0, out, rounds=3, eval_episodes=2, checkpoint_every=1, on_round=stop)
    checkpoint = bench.harness.checkpoint_path(out, "CartPole", "sgd", "iif", 0)
    # Next to the result files (committed with them), not in a git-ignored folder
    assert checkpoint == os.path.join(out, "checkpoints", "CartPole", "sgd", "iif_seed0.zip") and os.path.exists(checkpoint)
    interrupted = json.loads(open(bench.result_path(out, "CartPole", "sgd", "iif", 0)).read())
    assert not interrupted["complete"] and interrupted["checkpoint_round"] == 2
    resumed = bench.run_one("CartPole", "iif", 0, out, rounds=3, eval_episodes=2, checkpoint_every=1)
    assert resumed["complete"] and resumed["resumed_at"] == [2] and resumed["resumed_versions"] == [whole["versions"]]
    # The rounds before the interruption are the uninterrupted run's; the run goes on from the checkpoint
    assert [r["eval_return"] for r in resumed["rows"][:3]] == [r["eval_return"] for r in whole["rows"][:3]]
    assert [r["round"] for r in resumed["rows"]] == [0, 1, 2, 3] and resumed["rows"][3]["timesteps"] == 3 * 2048
    assert resumed["total_cpu_time"] > interrupted["total_cpu_time"]
    assert not os.path.exists(checkpoint)


def test_first_unfiltered_variant_takes_ppos_first_update(tmp_path):
    out = str(tmp_path)
    ppo = bench.run_one("CartPole", "ppo", 1, out, rounds=2, eval_episodes=3)
    iif = bench.run_one("CartPole", "iif", 1, out, variants=["first-unfiltered"], rounds=2, eval_episodes=3)
    assert iif["rows"][1]["kept_fraction"] == 1.0 and iif["rows"][2]["kept_fraction"] < 1.0
    assert iif["rows"][1]["eval_return"] == ppo["rows"][1]["eval_return"]
    # PPO filters nothing, so its run in the variant's cell is the one without the variant, reused (not retrained)
    reused = bench.run_one("CartPole", "ppo", 1, out, variants=["first-unfiltered"], rounds=2, eval_episodes=3)
    assert reused["rows"] == ppo["rows"] and reused["reused_from"] == os.path.join("CartPole", "sgd", "ppo_seed1.json")
    assert reused["total_cpu_time"] == 0.0 and reused["config"]["variants"] == ["first-unfiltered"]
    assert bench.Job("CartPole", "sgd", "ppo", 1, ("first-unfiltered",), rounds=2, eval_episodes=3).finished(out)
    # Clipping changes PPO too: not reused
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run_one("CartPole", "ppo", 1, out, variants=["clip"], rounds=2, eval_episodes=3)
    start = {key: ppo[key] for key in ("init_hash", "init_fingerprint")}
    assert not bench.harness._reuse_unfiltered(bench.run_config("CartPole", "sgd", "ppo", 1, ["clip0.5"], 2, 3), out, 3, start)


def test_settings_and_variants_make_the_run_kwargs():
    acrobot = bench.ENVS["Acrobot"]
    sgd = bench.run_kwargs(acrobot, "sgd")
    assert sgd["optimizer"] == "sgd" and sgd["learning_rate"] == 5e-3 and sgd["max_grad_norm"] == 1e10
    assert sgd["rounds"] == 50 and sgd["n_envs"] == 1
    sb3 = bench.run_kwargs(acrobot, "sb3")
    # rl-zoo's Acrobot values at the paper's budget of 50 * 2048 environment steps
    assert (sb3["n_envs"], sb3["n_steps"], sb3["n_epochs"], sb3["max_grad_norm"]) == (16, 256, 4, 0.5)
    assert sb3["rounds"] == 25 and sb3["optimizer"] == "adam"
    assert bench.run_kwargs(acrobot, "sgd", ["clip0.5"])["max_grad_norm"] == 0.5
    model = bench.make_model(bench.ENVS["CartPole"], 0, "adam1e-3", n_steps=64)
    assert isinstance(model.policy.optimizer, th.optim.Adam) and model.learning_rate == 1e-3
    for env in bench.PAPER_ENVS:
        assert set(bench.ENVS[env].settings) <= set(bench.SETTINGS)


def test_grid_order_and_protocol_settings():
    jobs = bench.grid(["FrozenLake", "MiniGrid"], ["random", "ppo", "iif"], [0, 1])
    cells = list(dict.fromkeys((job.env, job.setting) for job in jobs))
    assert cells == [("FrozenLake", "sgd"), ("MiniGrid", "sgd"), ("MiniGrid", "adam1e-3"), ("MiniGrid", "sb3")]
    first = [(job.arm, job.seed) for job in jobs[:6]]
    assert first == [("ppo", 0), ("iif", 0), ("ppo", 1), ("iif", 1), ("random", 0), ("random", 1)]


def test_vectorised_evaluation_is_paired_and_leaves_the_torch_rng():
    spec = bench.ENVS["CartPole"]
    model = bench.make_model(spec, 0, n_steps=64)
    eval_env = bench.make_eval_env(spec, 30, 7)
    assert eval_env.num_envs == 20
    th.manual_seed(123)
    state = th.random.get_rng_state()
    first = bench.evaluate(model, spec, 30, 7, eval_env)
    assert th.equal(state, th.random.get_rng_state())
    # Reusing the environments gives the same episodes as fresh ones
    assert bench.evaluate(model, spec, 30, 7, eval_env) == first == bench.evaluate(model, spec, 30, 7)
    assert bench.evaluate(model, spec, 30, 8) != first


def test_summary_lists_missing_runs_and_fails(tmp_path, capsys):
    out = str(tmp_path)
    args = ["summary", "--out", out, "--envs", "CartPole", "--seeds", "0", "--arms", "ppo", "iif", "--rounds", "1",
            "--eval-episodes", "1"]  # fmt: skip
    assert bench.main(args) == 1
    err = capsys.readouterr().err
    assert "CartPole sgd ppo seed 0" in err and "CartPole sgd iif seed 0" in err and "nothing to summarise" in err
    for arm in ("ppo", "iif"):
        bench.run_one("CartPole", arm, 0, out, rounds=1, eval_episodes=1)
    assert bench.main(args) == 0
    assert "| CartPole sgd | iif | 1 |" in capsys.readouterr().out
    # A seed still missing: listed, exit status 1 unless --allow-missing
    assert bench.main([*args[:6], "0", "1", *args[7:]]) == 1
    assert "CartPole sgd iif seed 1" in capsys.readouterr().err
    assert bench.main([*args[:6], "0", "1", *args[7:], "--allow-missing"]) == 0


def _children(pid: int) -> list[int]:
    """The pids of the pool workers whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as file:
                ppid = int(file.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as file:
                worker = b"multiprocessing-fork" in file.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and worker:
            found.append(int(name))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc (Linux)")
def test_a_grid_killed_by_a_signal_leaves_no_worker_training_on(tmp_path):
    import signal

    out = tmp_path / "grid"
    command = [sys.executable, "-m", "sb3_influence.cli", "bench", "run", "--envs", "CartPole", "--arms", "ppo", "iif"]
    command += ["--seeds", "0", "--rounds", "200", "--workers", "2", "--backend", "process", "--out", str(out)]
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [out / "CartPole" / "sgd" / f"{arm}_seed0.json" for arm in ("ppo", "iif")]
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(f.exists() for f in files), "the runs did not start within 2 minutes"
        workers = _children(parent.pid)
        assert len(workers) == 2
        parent.send_signal(signal.SIGTERM)  # as `timeout` or `kill` does: the parent runs no cleanup
        parent.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
        assert not alive, "workers went on training after their grid was killed"
        rounds = [json.loads(f.read_text())["rows"][-1]["round"] for f in files]
        assert all(0 < r < 200 for r in rounds)
        time.sleep(1.0)
        assert [json.loads(f.read_text())["rows"][-1]["round"] for f in files] == rounds
    finally:
        parent.kill()
        for pid in workers:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)


def test_help_shows_every_default_and_no_markup(capsys):
    parser = bench._parser()
    for command in ("run", "summary", "docs"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and ":func:" not in text and ":param" not in text
        sub = parser._subparsers._group_actions[0].choices[command]
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert "default" in sub.formatter_class("x")._get_help_string(action), (command, action.dest)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "``" not in capsys.readouterr().out


def test_import_does_not_import_ray():
    code = "import sys, sb3_influence, sb3_influence.bench; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_grid_through_ray(tmp_path):
    ray = pytest.importorskip("ray", reason="install the distributed extra: pip install -e '.[distributed]'")
    out = str(tmp_path)
    jobs = bench.grid(["CartPole"], ["ppo", "iif"], [3], rounds=1, eval_episodes=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        lines = []
        hours = bench.run_grid(jobs, out, workers=2, backend="ray", log=lines.append)
    finally:
        ray.shutdown()
    assert hours > 0 and not bench.missing(jobs, out)
    assert sum("CartPole sgd" in line for line in lines) == 2
    # The runs are the same as in this process
    local = bench.run_one("CartPole", "ppo", 3, str(tmp_path / "local"), rounds=1, eval_episodes=2)
    with open(jobs[0].path(out)) as file:
        assert json.load(file)["rows"][1]["eval_return"] == local["rows"][1]["eval_return"]


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


def test_stratified_bootstrap_and_rliable_metrics():
    metrics = pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench import stats

    rng = np.random.default_rng(0)
    scores = {"iif": rng.normal(0.8, 0.05, size=(10, 3)), "ppo": rng.normal(0.5, 0.05, size=(10, 3))}
    result = stats.aggregate_metrics(scores, reps=300)
    for arm, matrix in scores.items():
        iqm = result[arm]["iqm"]
        assert iqm["value"] == pytest.approx(metrics.aggregate_iqm(matrix))
        assert iqm["ci"][0] < iqm["value"] < iqm["ci"][1]
        assert result[arm]["optimality_gap"]["value"] == pytest.approx(metrics.aggregate_optimality_gap(matrix))
    assert result["iif"]["iqm"]["ci"][0] > result["ppo"]["iqm"]["ci"][1]
    # Stratified: each task keeps its own runs, so a constant column stays constant in every replicate
    constant = np.column_stack([np.full(5, 2.0), rng.normal(size=5)])
    low, high = stats.stratified_bootstrap_ci(constant, lambda m: float(m[:, 0].std()), reps=100)
    assert low == high == 0.0
    better = stats.probability_of_improvement(scores["iif"], scores["ppo"], reps=200)
    assert better["value"] == 1.0 and better["ci"] == (1.0, 1.0)
    assert stats.probability_of_improvement(scores["ppo"], scores["iif"], reps=50)["value"] == 0.0
    assert stats.performance_profile(np.array([[0.1, 0.5], [0.9, 1.2]]), np.array([0.0, 0.5, 1.0])).tolist() == [
        1.0,
        0.5,
        0.25,
    ]
    with pytest.raises(ValueError, match="runs × tasks"):
        stats.stratified_bootstrap_ci(np.ones(3), np.mean)
    with pytest.raises(ValueError, match="kind"):
        stats.normalized_score(_fake_result("ppo", 0, [0.0, 1.0], [0.0, 1.0]), "FrozenLake", kind="best")


def _fake_grid_run(out, env, setting, arm, seed, returns, variants=(), cpu_s=36.0, reused=False):
    result = _fake_result(arm, seed, returns, range(len(returns)))
    for row in result["rows"]:
        row["cpu_time"] = float(row["round"])
    result["config"].update(env=env, setting=setting, rounds=len(returns) - 1, variants=list(variants))
    result["total_cpu_time"] = 0.0 if reused else cpu_s
    if reused:
        result["reused_from"] = os.path.relpath(bench.result_path(out, env, setting, arm, seed), out)
    bench.write_json(bench.result_path(out, env, setting, arm, seed, variants), result)


def test_docs_page_marks_incomplete_cells(tmp_path):
    pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench.page import generate_page

    out, legacy = str(tmp_path / "grid"), str(tmp_path / "legacy")
    curves = {"ppo": [0.0, 0.2, 0.5, 0.9], "iif": [0.0, 0.5, 0.9, 0.9], "random": [0.0, 0.1, 0.4, 0.8]}
    for seed in (0, 1):
        for arm, returns in curves.items():
            _fake_grid_run(out, "FrozenLake", "sgd", arm, seed, returns)
            if seed == 0:
                _fake_grid_run(out, "Acrobot", "sgd", arm, seed, [-500.0 + 100 * r for r in returns])
    template = tmp_path / "page.md.in"
    template.write_text(
        "\n\n".join(
            [
                "# T",
                *(
                    "{{" + name + "}}"
                    for name in ("status", "results", "incomplete", "paper", "aggregate", "reading", "one_record_collapses")
                ),
            ]
        )
    )
    output = tmp_path / "docs" / "page.md"
    output.parent.mkdir()
    report = generate_page(str(template), str(output), str(tmp_path / "docs" / "fig"), out, legacy, seeds=(0, 1))
    text = output.read_text()
    assert report["complete"] == ["FrozenLake sgd"] and "Acrobot sgd" in report["incomplete"]
    assert report["cpu_hours"] == pytest.approx(9 * 36.0 / 3600)
    assert "| FrozenLake sgd | iif | **faster** |" in text
    assert "| Acrobot sgd | iif | incomplete (1/2 seeds): no reading yet |" in text
    assert "| Acrobot sgd | — | incomplete (1/2 seeds)" in text
    # iif-aware does not apply to the SGD setting: not a column to fill there
    assert "| FrozenLake | sgd | 50 | 2/2 | 2/2 | 2/2 | — | — | — | 0.06 | complete |" in text
    assert "| highway | sgd | 100 | 0/2 | 0/2 | 0/2 | — | — | — | 0.00 | not started |" in text
    assert "| MiniGrid | adam1e-3 | 40 | 0/2 | 0/2 | 0/2 | 0/2 | — | — | 0.00 | not started |" in text
    assert "![grid, curve score](fig/aggregate_curve.png)" in text and (tmp_path / "docs/fig/aggregate_curve.png").exists()
    assert "| FrozenLake sgd | iif | 0 of 0 | 0 of 6 | — |" in text
    assert "Generated by `sb3-influence bench docs`" in text and "{{" not in text
    template.write_text("{{results}} {{tables}}")
    with pytest.raises(ValueError, match="unknown blocks \\['tables'\\]"):
        generate_page(str(template), str(output), str(tmp_path / "fig"), out, legacy)


def test_reading_flags_a_curve_score_that_disagrees_with_se_ave(tmp_path):
    # PPO reaches its best sooner and then collapses; IIF reaches it later and holds it (MiniGrid under SB3's Adam)
    pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench.page import generate_page

    out = str(tmp_path / "grid")
    for seed in (0, 1, 2):
        bump = 0.01 * seed
        curves = {
            "ppo": [0.0, 0.9 + bump, 0.0, 0.0, 0.0],
            "iif": [0.0, 0.5, 0.95, 0.95, 0.95 - bump],
            "random": [0.0, 0.1, 0.2, 0.3, 0.3],
        }
        for arm, returns in curves.items():
            _fake_grid_run(out, "FrozenLake", "sgd", arm, seed, returns)
            # Acrobot: IIF sooner and higher, both readings agree
            acrobot = {
                "ppo": [-500, -400, -300, -200, -200],
                "iif": [-500, -300, -200, -150, -150 + seed],
                "random": [-500] * 5,
            }
            _fake_grid_run(out, "Acrobot", "sgd", arm, seed, [float(r) for r in acrobot[arm]])
    template = tmp_path / "page.md.in"
    template.write_text("# T\n\n{{reading}}")
    output = tmp_path / "page.md"
    generate_page(str(template), str(output), str(tmp_path / "fig"), out, str(tmp_path / "legacy"), seeds=(0, 1, 2))
    lines = output.read_text().splitlines()
    frozen = next(line for line in lines if line.startswith("| FrozenLake sgd | iif |"))
    assert "| **slower** |" in frozen and "| 1.00 [1.00, 1.00] | **ahead: disagrees with SE_ave** |" in frozen
    acrobot = next(line for line in lines if line.startswith("| Acrobot sgd | iif |"))
    assert "| **faster** |" in acrobot and "| ahead |" in acrobot and "disagrees" not in acrobot


def test_iif_aware_arm_runs_only_in_the_adam_settings(capsys):
    adam = ("adam3e-4", "adam1e-3", "sb3")
    assert bench.ARMS["iif-aware"].settings == adam and bench.ARMS["iif-aware"].iif_kwargs == {"optimizer_aware": True}
    assert bench.arms_for("sgd", env="Acrobot") == ("ppo", "iif", "random")
    # A variant cell compares IIF's variant with PPO; another arm runs there only when named
    assert bench.arms_for("sgd+drop-partial", env="Acrobot") == bench.VARIANT_ARMS == ("ppo", "iif")
    assert bench.arms_for("sgd+drop-partial", ["random"], env="Acrobot") == ("random",)
    assert [j.arm for j in bench.grid(["Acrobot"], seeds=[0], settings=["sgd"], variants=["drop-partial"])] == ["ppo", "iif"]
    for setting in adam:
        assert bench.arms_for(setting, env="MiniGrid") == ("ppo", "iif", "random", "iif-aware")
    assert bench.arms_for("sb3", ["iif-aware", "ppo"]) == ("ppo", "iif-aware") and bench.arms_for("sgd", ["iif-aware"]) == ()
    for arm in bench.ARMS.values():
        assert set(arm.versus) <= set(bench.ARMS) and (arm.settings is None or set(arm.settings) <= set(bench.SETTINGS))
        assert arm.envs is None or set(arm.envs) <= set(bench.ENVS)
        assert hasattr(sb3_influence, arm.filter_class)
    # Every arm by default, each where it applies: no iif-aware job in the SGD cell, the trajectory arms only there
    jobs = bench.grid(["MiniGrid"], seeds=[0, 1])
    per_cell = {s: [(j.arm, j.seed) for j in jobs if j.setting == s] for s in ("sgd", "adam1e-3", "sb3")}
    assert per_cell["sgd"] == [("ppo", 0), ("iif", 0), ("iif-trajectory", 0), ("dtv-loo", 0),
                               ("ppo", 1), ("iif", 1), ("iif-trajectory", 1), ("dtv-loo", 1),
                               ("random", 0), ("random", 1)]  # fmt: skip
    for setting in ("adam1e-3", "sb3"):
        # Paired with PPO: with it and IIF, seed by seed, before the random filter
        assert per_cell[setting] == [("ppo", 0), ("iif", 0), ("iif-aware", 0), ("ppo", 1), ("iif", 1), ("iif-aware", 1),
                                     ("random", 0), ("random", 1)]  # fmt: skip
    assert len(jobs) == 10 + 8 + 8
    # Asked for in a mix of settings: only where it applies
    mixed = bench.grid(["CartPole"], ["ppo", "iif-aware"], [0], settings=["sgd", "sb3"])
    assert [(j.setting, j.arm) for j in mixed] == [("sgd", "ppo"), ("sb3", "ppo"), ("sb3", "iif-aware")]
    # Asked for explicitly where it applies nowhere: an error naming the arm, the settings asked and its settings
    with pytest.raises(ValueError, match=r"arm 'iif-aware' applies to none of the cells asked for \(settings sgd of "
                       r"CartPole\): it runs in settings adam3e-4, adam1e-3, sb3 only"):  # fmt: skip
        bench.grid(["CartPole"], ["ppo", "iif-aware"], [0], settings=["sgd"])
    with pytest.raises(ValueError, match=r"iif-aware.*--settings"):
        bench.grid(["FrozenLake"], ["iif-aware"], [0])  # FrozenLake's protocol is SGD only
    with pytest.raises(ValueError, match="applies to none"):
        bench.main(["run", "--envs", "FrozenLake", "--arms", "iif-aware", "--out", "/nonexistent"])
    # ... and by the harness, which every run goes through
    with pytest.raises(ValueError, match="arm 'iif-aware' does not apply to setting 'sgd'"):
        bench.run_config("CartPole", "sgd", "iif-aware", 0)
    with pytest.raises(ValueError, match="does not apply"):
        bench.run_one("CartPole", "iif-aware", 0, "/nonexistent", "sgd")
    with pytest.raises(ValueError, match="unknown arm 'aware'"):
        bench.arms_for("sb3", ["aware"])
    # The default --arms is every arm, each where it applies (the CLI default reaches grid() as None)
    assert bench._parser().parse_args(["run"]).arms is None


def test_new_arm_leaves_the_finished_runs_of_the_other_arms_valid():
    # The committed FrozenLake runs: their configs (and so the grid's "finished") do not change with a new arm
    grid_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "grid")
    folder = os.path.join(grid_dir, "FrozenLake", "sgd")
    if not os.path.isdir(folder):
        pytest.skip("the committed grid results are not in this checkout")
    jobs = bench.grid(["FrozenLake"])
    assert {job.arm for job in jobs} == {"ppo", "iif", "random"} and len(jobs) == 15
    for job in jobs:
        with open(job.path(grid_dir)) as file:
            stored = json.load(file)["config"]
        config = bench.run_config(job.env, job.setting, job.arm, job.seed)
        assert config == stored and "iif_kwargs" not in config, job.describe()
        assert job.finished(grid_dir), job.describe()
    assert not bench.missing(jobs, grid_dir)
    # The new arm records what makes it different
    aware = bench.run_config("Acrobot", "sb3", "iif-aware", 0)
    assert aware["iif_kwargs"] == {"optimizer_aware": True} and aware["rule"] == "neg-bottom"
    assert {k: v for k, v in aware.items() if k not in ("arm", "iif_kwargs")} == {
        k: v for k, v in bench.run_config("Acrobot", "sb3", "iif", 0).items() if k != "arm"
    }


def test_every_committed_finished_run_is_still_finished_for_the_grid():
    # A change to run_config (a new key, another default) makes `bench run` train the runs it no longer recognises
    # again, hours of CPU each: such a change needs its result files migrated (benchmarks/add_early_evaluations.py)
    # or the cell deliberately rerun
    import glob

    grid_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "grid")
    paths = sorted(glob.glob(os.path.join(grid_dir, "*", "*", "*.json")))
    if not paths:
        pytest.skip("the committed grid results are not in this checkout")
    finished = 0
    for path in paths:
        with open(path) as file:
            result = json.load(file)
        if not result.get("complete"):
            continue
        config = result["config"]
        job = bench.Job(config["env"], config["setting"], config["arm"], config["seed"], tuple(config["variants"]))
        assert os.path.samefile(job.path(grid_dir), path), path
        assert job.finished(grid_dir), f"{path} would be run again: its config is not run_config's any more"
        finished += 1
    assert finished >= 100


def test_iif_aware_arm_filters_with_the_optimizer_aware_score(tmp_path):
    out = str(tmp_path)
    result = bench.run_one("CartPole", "iif-aware", 4, out, "sb3", rounds=1, eval_episodes=1)
    assert result["config"]["iif_kwargs"] == {"optimizer_aware": True} and result["config"]["optimizer"] == "adam"
    assert 0.5 < result["rows"][1]["kept_fraction"] < 1.0
    assert os.path.exists(bench.result_path(out, "CartPole", "sb3", "iif-aware", 4))
    assert bench.Job("CartPole", "sb3", "iif-aware", 4, rounds=1, eval_episodes=1).finished(out)
    # Same seed, same first rollout: the proxy and the optimizer-aware score rank its records differently under Adam
    drops = {}
    for arm in ("iif", "iif-aware"):
        model = bench.make_model(bench.ENVS["CartPole"], 4, "sb3", n_steps=256)
        callback = bench.make_callback(arm, 0.5)
        assert callback.request.optimizer_aware is (arm == "iif-aware")
        model.learn(256, callback=callback)
        drops[arm] = callback.last_drop.ravel()
        assert drops[arm].any()
    assert not np.array_equal(drops["iif"], drops["iif-aware"])


def test_docs_page_with_an_arm_that_applies_to_some_cells(tmp_path):
    pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench.page import generate_page

    out, legacy = str(tmp_path / "grid"), str(tmp_path / "legacy")
    curves = {"ppo": [0.0, 0.2, 0.5, 0.9], "iif": [0.0, 0.5, 0.9, 0.9], "random": [0.0, 0.1, 0.4, 0.8]}
    aware = [0.0, 0.6, 0.9, 1.0]
    for seed in (0, 1):
        for arm, returns in curves.items():
            for setting in ("sgd", "adam1e-3", "sb3"):
                _fake_grid_run(out, "MiniGrid", setting, arm, seed, [r + 0.01 * seed for r in returns])
        _fake_grid_run(out, "MiniGrid", "adam1e-3", "iif-aware", seed, aware)
        # The trajectory arms run in the SGD cell only
        _fake_grid_run(out, "MiniGrid", "sgd", "iif-trajectory", seed, [0.0, 0.3, 0.6, 0.9])
        _fake_grid_run(out, "MiniGrid", "sgd", "dtv-loo", seed, [0.0, 0.1, 0.2, 0.3])
    # The iif-aware and DTV-Loo runs cost more: their cost factor's worth
    for seed in (0, 1):
        for setting, arm in (("adam1e-3", "iif-aware"), ("sgd", "dtv-loo")):
            path = bench.result_path(out, "MiniGrid", setting, arm, seed)
            with open(path) as file:
                result = json.load(file)
            bench.write_json(path, {**result, "total_cpu_time": 36.0 * bench.ARMS[arm].cost})
    template = tmp_path / "page.md.in"
    names = ("status", "cost", "results", "aggregate", "reading", "curves")
    template.write_text("\n\n".join(["# T", *("{{" + name + "}}" for name in names)]))
    output = tmp_path / "docs" / "page.md"
    output.parent.mkdir()
    report = generate_page(str(template), str(output), str(tmp_path / "docs" / "fig"), out, legacy, seeds=(0, 1))
    text = output.read_text()
    # The SGD cell is complete without iif-aware; the sb3 cell, where it applies, is not
    assert report["complete"] == ["MiniGrid sgd", "MiniGrid adam1e-3"] and "MiniGrid sb3" in report["incomplete"]
    assert "| MiniGrid | sgd | 40 | 2/2 | 2/2 | 2/2 | — | 2/2 | 2/2 | 0.11 | complete |" in text
    assert "| MiniGrid | adam1e-3 | 40 | 2/2 | 2/2 | 2/2 | 2/2 | — | — | " in text
    assert "| MiniGrid | sb3 | 40 | 2/2 | 2/2 | 2/2 | 0/2 | — | — | 0.06 | incomplete |" in text
    # Cost: 4 arms in the Adam cells, iif-aware counting as its cost's worth of runs of 0.01 CPU h
    cost = bench.ARMS["iif-aware"].cost
    assert (
        f"| MiniGrid | sgd | 0.01 | 5 (dtv-loo ×1.5) | {0.01 * 5.5 * 2:.1f} | 0.0 | measured, mean of 10 finished runs |"
        in text
    )
    assert f"| MiniGrid | adam1e-3 | 0.01 | 4 (iif-aware ×{cost:g}) | {0.01 * (3 + cost) * 2:.1f} | 0.0 | measured" in text
    # Results and reading: iif-aware against PPO where it ran
    assert "| MiniGrid adam1e-3 | iif-aware | 2 |" in text and "| MiniGrid sgd | iif-aware" not in text
    assert "| MiniGrid adam1e-3 | iif-aware | **" in text and "| MiniGrid sb3 | iif-aware | incomplete (0/2 seeds)" in text
    # The iif-aware runs still missing in the sb3 cell do not hold back IIF's own reading there
    assert "| MiniGrid sb3 | iif | **" in text
    # Aggregates: the three arms over every cell where they are complete (the sb3 cell too), then iif-aware over
    # the complete cell where it applies
    start = text.index("Tasks: MiniGrid sgd, MiniGrid adam1e-3, MiniGrid sb3 (2 seeds each).")
    aggregate = text[start : text.index("| cell | arm | reading")]
    common, restricted = aggregate.split("iif-aware (only where it applies). Tasks: MiniGrid adam1e-3 (2 seeds each).")
    assert "| curve | iif > ppo |" in common and "| curve | iif > random |" in common and "iif-aware" not in common
    assert "| curve | iif-aware |" in restricted and "| curve | iif > ppo |" not in restricted
    # aware beats every seed of iif and PPO on the final score in that cell
    assert "| final | iif-aware > iif | 1.00 [1.00, 1.00] | MiniGrid adam1e-3 1.00 |" in restricted
    assert "| final | iif-aware > ppo | 1.00 [1.00, 1.00] |" in restricted
    # The trajectory arms: their own task set, the SGD cell, against PPO and IIF
    trajectory = restricted[
        restricted.index("iif-trajectory, dtv-loo (only where they apply). Tasks: MiniGrid sgd (2 seeds each).") :
    ]
    assert "| final | iif-trajectory > iif | 0.00 [0.00, 0.00] |" in trajectory
    assert "| final | dtv-loo > ppo | 0.00 [0.00, 0.00] |" in trajectory
    assert "| MiniGrid sgd | dtv-loo | **slower** |" in text
    assert (tmp_path / "docs/fig/aggregate_iif-aware_final.png").exists()
    assert (tmp_path / "docs/fig/grid_MiniGrid_adam1e-3.png").exists()


def test_variant_cell_needs_ppo_and_iif_and_joins_another_arm_once_it_ran(tmp_path):
    pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench.page import generate_page

    out, legacy = str(tmp_path / "grid"), str(tmp_path / "legacy")
    curves = {"ppo": [-200.0, -100.0, 0.0, 100.0], "iif": [-200.0, -50.0, 50.0, 100.0]}
    for seed in (0, 1):
        for arm, returns in curves.items():
            reused = arm == "ppo"
            _fake_grid_run(out, "LunarLander", "sgd", arm, seed, returns, ["drop-partial"], cpu_s=3600.0, reused=reused)
    template = tmp_path / "page.md.in"
    template.write_text("{{status}}\n\n{{cost}}\n\n{{reading}}\n\n{{variants}}\n\n{{aggregate}}")
    output = tmp_path / "page.md"

    def page():
        report = generate_page(str(template), str(output), str(tmp_path / "fig"), out, legacy, seeds=(0, 1))
        return report, output.read_text()

    report, text = page()
    assert "LunarLander sgd+drop-partial" in report["complete"]
    # Against IIF without the variant: no reading until that cell has the seeds too
    assert "| LunarLander sgd+drop-partial | iif | incomplete (with it 2/2, without 0/2 seeds)" in text
    for seed in (0, 1):
        # Without the variant IIF is slower on the curve than with it, and ends lower
        _fake_grid_run(out, "LunarLander", "sgd", "iif", seed, [-200.0, -150.0, -50.0, 50.0 + seed])
    report, text = page()
    assert "| LunarLander sgd+drop-partial | iif | 1.00 [1.00, 1.00] | ahead | 1.00 [1.00, 1.00] | ahead |" in text
    assert "| LunarLander | sgd+drop-partial | 150 | 2/2 | 2/2 | — | — | — | — | 2.00 | complete |" in text
    # PPO's runs there are the cell's without the variant: its cost counts IIF's runs only
    assert "| LunarLander | sgd+drop-partial | 1.00 | 2 (ppo reused) | 2.0 | 0.0 | measured, mean of 2 finished runs |" in text
    assert bench.reuses_unfiltered("ppo", ["drop-partial"]) and not bench.reuses_unfiltered("ppo", ["clip0.5"])
    assert not bench.reuses_unfiltered("iif", ["drop-partial"]) and not bench.reuses_unfiltered("ppo", [])
    with pytest.raises(ValueError, match="unknown variant 'bogus'"):
        bench.arms_for("sgd+bogus")
    # A random run in the variant cell joins it as a column, and the cell stays complete without its other seed
    _fake_grid_run(
        out, "LunarLander", "sgd", "random", 0, [-200.0, -150.0, -100.0, 0.0], variants=["drop-partial"], cpu_s=3600.0
    )
    report, text = page()
    assert "LunarLander sgd+drop-partial" in report["complete"]
    assert "| LunarLander | sgd+drop-partial | 150 | 2/2 | 2/2 | 1/2 | — | — | — | 3.00 | complete |" in text
    # Both cells complete in every arm: the aggregate has one task per environment × setting, not the variant cell
    for seed in (0, 1):
        for arm, returns in {"ppo": [-200.0, -100.0, 0.0, 100.0], "random": [-200.0, -180.0, -90.0, 0.0]}.items():
            _fake_grid_run(out, "LunarLander", "sgd", arm, seed, [r + seed for r in returns])
            _fake_grid_run(out, "LunarLander", "sgd", arm, seed, [r + seed for r in returns], variants=["drop-partial"])
    report, text = page()
    assert {"LunarLander sgd", "LunarLander sgd+drop-partial"} <= set(report["complete"])
    assert "Tasks: LunarLander sgd (2 seeds each)." in text and "Tasks: LunarLander sgd, " not in text
    # PPO trained in the variant cell (its base run started from other weights) counts in the cost
    assert "| LunarLander | sgd+drop-partial | 0.34 | 3 | 2.0 | 0.0 | measured, mean of 6 finished runs |" in text
    # A variant that changes PPO too (clip0.5) compares PPO with PPO without it as well
    for seed in (0, 1):
        for arm, returns in curves.items():
            _fake_grid_run(out, "LunarLander", "sgd", arm, seed, [r - 10.0 for r in returns], variants=["clip0.5"])
    report, text = page()
    assert "| LunarLander sgd+clip0.5 | ppo | 0.00 [0.00, 0.00] | behind | 0.00 [0.00, 0.00] | behind |" in text
    assert "| LunarLander sgd+clip0.5 | iif |" in text and "| LunarLander sgd+drop-partial | ppo |" not in text


def _cell_with_an_unfinished_run(out):
    """LunarLander adam1e-3 at 1 CPU h per run: PPO seeds 0 and 1 and IIF seed 0 finished, IIF seed 1 unfinished at
    round 55 of its 150 with a round-50 checkpoint (100/150 of a run left). Returns the checkpoint's path."""
    from sb3_influence.bench.harness import checkpoint_path

    cell = ("LunarLander", "adam1e-3")
    for arm, seed in (("ppo", 0), ("ppo", 1), ("iif", 0)):
        _fake_grid_run(out, *cell, arm, seed, [-200.0, -100.0, 0.0, 100.0 + seed], cpu_s=3600.0)
        # Of the protocol's config, as a finished run of the grid is (``bench run`` skips it)
        with open(bench.result_path(out, *cell, arm, seed)) as file:
            bench.write_json(file.name, {**json.load(file), "config": bench.run_config(*cell, arm, seed)})
    config = bench.run_config(*cell, "iif", 1)
    unfinished = {"config": config, "complete": False, "checkpoint_round": 50, "total_cpu_time": 1200.0,
                  "rows": [dict(round=r, eval_return=0.0) for r in range(56)]}  # fmt: skip
    bench.write_json(bench.result_path(out, *cell, "iif", 1), unfinished)
    checkpoint = checkpoint_path(out, *cell, "iif", 1)
    os.makedirs(os.path.dirname(checkpoint))
    open(checkpoint, "wb").close()
    return checkpoint


def test_cost_table_counts_what_is_left_from_each_unfinished_runs_checkpoint(tmp_path):
    pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench.page import generate_page

    out, legacy = str(tmp_path / "grid"), str(tmp_path / "legacy")
    cell = ("LunarLander", "adam1e-3")
    checkpoint = _cell_with_an_unfinished_run(out)
    template = tmp_path / "page.md.in"
    template.write_text("{{cost}}")
    output = tmp_path / "page.md"

    def row():
        generate_page(str(template), str(output), str(tmp_path / "fig"), out, legacy, seeds=(0, 1))
        return next(line for line in output.read_text().splitlines() if line.startswith("| LunarLander | adam1e-3 |"))

    aware = bench.ARMS["iif-aware"].cost
    start = f"| LunarLander | adam1e-3 | 1.00 | 4 (iif-aware ×{aware:g}) | {(3 + aware) * 2:.1f} |"
    # Left: two thirds of IIF seed 1, both random seeds and both iif-aware seeds at their cost
    assert row() == f"{start} {2 / 3 + 2 + 2 * aware:.1f} | measured, mean of 3 finished runs |"
    # Without its checkpoint the run starts again from round 1: all of it is left
    os.remove(checkpoint)
    assert row() == f"{start} {3 + 2 * aware:.1f} | measured, mean of 3 finished runs |"
    # Once every needed run finished nothing is left, though an opt-in arm that joined the cell has a seed to go
    for arm, seed in itertools.product(("iif", "random", "iif-aware"), (0, 1)):
        _fake_grid_run(out, *cell, arm, seed, [-200.0, -100.0, 0.0, 50.0], cpu_s=3600.0 * bench.ARMS[arm].cost)
    _fake_grid_run(out, *cell, "iif-smoothed", 0, [-200.0, -100.0, 0.0, 50.0], cpu_s=3600.0 * 6)
    assert "| 0.0 | measured, mean of 9 finished runs |" in row()


def test_bench_run_says_how_many_cpu_hours_its_runs_still_need(tmp_path, monkeypatch, capsys):
    from sb3_influence.bench.page import hours_left

    out = str(tmp_path / "grid")
    checkpoint = _cell_with_an_unfinished_run(out)
    cell = (["LunarLander"], ["adam1e-3"])
    aware = bench.ARMS["iif-aware"].cost
    # The cost table's count for the jobs asked for: two thirds of IIF seed 1, the random and iif-aware seeds
    assert hours_left(bench.grid(cell[0], seeds=[0, 1], settings=cell[1]), out) == pytest.approx(2 / 3 + 2 + 2 * aware)
    assert hours_left(bench.grid(cell[0], ["iif"], [0, 1], cell[1]), out) == pytest.approx(2 / 3)
    # Twice the protocol's rounds is another config: the run starts again and is two runs long
    assert hours_left(bench.grid(cell[0], ["iif"], [0, 1], cell[1], rounds=300), out) == pytest.approx(4)
    os.remove(checkpoint)
    assert hours_left(bench.grid(cell[0], ["iif"], [0, 1], cell[1]), out) == pytest.approx(1)
    # A cell no run of which has a cost yet
    assert np.isnan(hours_left(bench.grid(["BipedalWalker"], ["ppo"], [0], ["adam3e-4"]), out))

    ran = []
    monkeypatch.setattr(bench, "run_grid", lambda jobs, *args, **kwargs: ran.append(jobs))
    args = ["run", "--envs", "LunarLander", "--settings", "adam1e-3", "--arms", "iif", "random", "--seeds", "0", "1"]
    assert bench.main([*args, "--out", out]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("CPU time the 3 runs to do still need: about 3.0 CPU h")
    assert len(ran[0]) == 4
    assert bench.main(["run", "--envs", "BipedalWalker", "--arms", "ppo", "--seeds", "0", "--out", out]) == 0
    assert "not known yet" in capsys.readouterr().out


def test_opt_in_arm_runs_only_where_named_and_joins_the_page_once_it_ran(tmp_path):
    pytest.importorskip("rliable.metrics", reason="install the bench extra: pip install -e '.[bench]'")
    from sb3_influence.bench.page import generate_page

    spec = bench.ARMS["iif-smoothed"]
    assert spec.opt_in and spec.iif_kwargs == {"optimizer_aware": "unrolled", "clip_smoothing": 3e-2, "n_orders": 4}
    # Not in the default grid, nor in a cell's arms; where named, only in the settings it applies to
    assert "iif-smoothed" not in bench.arms_for("sb3", env="MiniGrid")
    assert not any(job.arm == "iif-smoothed" for job in bench.grid(["MiniGrid"], seeds=[0]))
    assert bench.arms_for("sb3", ["ppo", "iif-smoothed"]) == ("ppo", "iif-smoothed")
    assert bench.arms_for("sgd", ["iif-smoothed"]) == ()
    assert [j.arm for j in bench.grid(["CartPole"], ["iif-smoothed"], [0], settings=["sb3"])] == ["iif-smoothed"]
    request = bench.make_callback("iif-smoothed", 0.5).request
    assert (request.optimizer_aware, request.clip_smoothing, request.n_orders) == ("unrolled", 3e-2, 4)

    out, legacy = str(tmp_path / "grid"), str(tmp_path / "legacy")
    curves = {"ppo": [0.0, 0.2, 0.5, 0.9], "iif": [0.0, 0.5, 0.9, 0.9], "random": [0.0, 0.1, 0.4, 0.8]}
    curves["iif-aware"] = [0.0, 0.4, 0.8, 0.9]
    for seed in (0, 1):
        for arm, returns in curves.items():
            _fake_grid_run(out, "MiniGrid", "sb3", arm, seed, [r + 0.01 * seed for r in returns])
    template = tmp_path / "page.md.in"
    template.write_text("\n\n".join(["# T", *("{{" + name + "}}" for name in ("status", "aggregate", "reading"))]))
    output = tmp_path / "page.md"

    def page():
        report = generate_page(str(template), str(output), str(tmp_path / "fig"), out, legacy, seeds=(0, 1))
        return report, output.read_text()

    # Without a run of it, the cell is complete and the page has no trace of the arm
    report, text = page()
    assert "MiniGrid sb3" in report["complete"] and "iif-smoothed" not in text
    # A run under way: a column with its progress
    _fake_grid_run(out, "MiniGrid", "sb3", "iif-smoothed", 0, [0.0, 0.7])
    path = bench.result_path(out, "MiniGrid", "sb3", "iif-smoothed", 0)
    with open(path) as file:
        partial = json.load(file)
    bench.write_json(path, {**partial, "complete": False, "config": {**partial["config"], "rounds": 3}})
    report, text = page()
    assert "MiniGrid sb3" in report["complete"] and "| 0/2 (seed 0 at round 1/3) |" in text
    # One finished seed: its count, and the cell stays complete (it does not need the arm)
    _fake_grid_run(out, "MiniGrid", "sb3", "iif-smoothed", 0, [0.0, 0.7, 0.9, 1.0])
    report, text = page()
    assert "MiniGrid sb3" in report["complete"] and "| iif-smoothed seeds done |" in text
    assert "| MiniGrid | sb3 | 40 | 2/2 | 2/2 | 2/2 | 2/2 | 1/2 | — | — | " in text
    assert "| MiniGrid sb3 | iif-smoothed | incomplete (1/2 seeds)" in text and "iif-smoothed >" not in text
    # Every seed: its reading and its own statistics against IIF and PPO
    _fake_grid_run(out, "MiniGrid", "sb3", "iif-smoothed", 1, [0.0, 0.7, 0.9, 1.0])
    report, text = page()
    assert "| MiniGrid sb3 | iif-smoothed | **" in text and "| final | iif-smoothed > iif |" in text


def test_env_kwargs_reach_gym_as_plain_dicts():
    """The protocol's read-only configs (MappingProxyType) are copied to dicts, which the env can pickle."""
    import pickle

    from sb3_influence.bench import ENVS
    from sb3_influence.bench.harness import _plain

    kwargs = _plain(ENVS["highway"].env_kwargs)
    assert type(kwargs["config"]) is dict and kwargs["config"]["vehicles_count"] == 10
    assert pickle.loads(pickle.dumps(kwargs)) == kwargs
    with pytest.raises(TypeError):
        pickle.dumps(ENVS["highway"].env_kwargs["config"])  # why the copy is needed
