"""The unrolled (hypergradient) influence: its replay lands where the real update lands; its gradient is right."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch as th
from test_optimizer_aware import float64_model

from sb3_influence import ReturnTarget
from sb3_influence.analysis.intervention import target_value
from sb3_influence.common.scoring.unrolled import (
    _target_value,
    _Wrapped,
    unrolled_influence,
    unrolled_order_seeds,
    unrolled_replay,
)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "sgd-nesterov", "adam", "adamw", "adam-l2", "rmsprop"])
def test_replay_with_unit_weights_is_the_update(optimizer):
    model = float64_model(optimizer, max_grad_norm=0.3, clip_range=0.05)
    theta = unrolled_replay(model)
    model.update()
    for name, param in model.policy.named_parameters():
        th.testing.assert_close(theta[name].detach(), param.detach(), rtol=1e-9, atol=1e-12, msg=name)


def _f_of_weights(model, weights, order_seed=None, clip_smoothing=0.0):
    theta = unrolled_replay(model, weights, order_seed=order_seed, clip_smoothing=clip_smoothing)
    evaluate = _Wrapped(model, _target_value)
    with model.influence_engine.eval_mode():
        params = {f"policy.{k}": v for k, v in theta.items()}
        return float(th.func.functional_call(evaluate, params, (ReturnTarget(), 4096), tie_weights=False))


def test_hypergradient_matches_finite_differences():
    model = float64_model("adam", max_grad_norm=0.3)
    scores = model.rollout_buffer.to_flat(model.compute_influence(optimizer_aware="unrolled"))
    n = model.rollout_buffer.n_records
    for record in (0, 17, n - 1):
        step = np.zeros(n)
        step[record] = 1e-4
        up = _f_of_weights(model, th.as_tensor(1 + step))
        down = _f_of_weights(model, th.as_tensor(1 - step))
        assert (up - down) / 2e-4 == pytest.approx(scores[record], rel=1e-4, abs=1e-10)
    # And the replay at w = 1 evaluates the same target the real update reaches
    value = _f_of_weights(model, th.ones(n, dtype=th.float64))
    model.train()
    assert value == pytest.approx(target_value(model), rel=1e-9)


def test_smoothed_clip_is_the_hard_clip_in_the_limit_and_bounded_by_tau_log2():
    model = float64_model("adam", clip_range=0.05)
    buffer = model.rollout_buffer
    samples = buffer.samples(np.arange(buffer.n_records))
    advantages = samples.advantages
    # Ratios spread across both clip boundaries
    with th.no_grad():
        for param in model.policy.parameters():
            param.add_(0.3 * th.randn_like(param))
    hard = model.record_losses(samples, advantages, 0.05, None)
    ratio = th.exp(
        model.policy.evaluate_actions(samples.observations, samples.actions.long().flatten())[1] - samples.old_log_prob
    )
    assert bool(((ratio > 1.05) | (ratio < 0.95)).any()) and bool(((ratio < 1.05) & (ratio > 0.95)).any())
    for tau in (1e-2, 1e-4):
        soft = model.record_losses(samples, advantages, 0.05, None, clip_smoothing=tau)
        gap = (soft - hard).abs()
        assert float(gap.max()) <= tau * np.log(2) * float(advantages.abs().max()) + 1e-12
    assert float((soft - hard).abs().max()) < 1e-4 * float(advantages.abs().max())


def test_smoothed_and_order_averaged_scores_are_derivatives_of_their_replays():
    model = float64_model("adam", max_grad_norm=0.3, clip_range=0.05)
    n = model.rollout_buffer.n_records
    seeds = unrolled_order_seeds(model, 3)
    assert seeds[0] is None and len(set(seeds)) == 3 and seeds == unrolled_order_seeds(model, 3)
    state = np.random.get_state()
    scores = model.rollout_buffer.to_flat(model.compute_influence(optimizer_aware="unrolled", n_orders=3, clip_smoothing=1e-2))
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state()[1:3], state[1:3], strict=True))
    for record in (0, 17, n - 1):
        step = np.zeros(n)
        step[record] = 1e-4
        brute = []
        for seed in seeds:
            up = _f_of_weights(model, th.as_tensor(1 + step), seed, clip_smoothing=1e-2)
            down = _f_of_weights(model, th.as_tensor(1 - step), seed, clip_smoothing=1e-2)
            brute.append((up - down) / 2e-4)
        assert np.mean(brute) == pytest.approx(scores[record], rel=1e-4, abs=1e-10)
    # Each option changes the score: the smoothing alone, and the orders alone
    exact = model.compute_influence(optimizer_aware="unrolled")
    assert not np.allclose(exact, model.compute_influence(optimizer_aware="unrolled", clip_smoothing=1e-2))
    assert not np.allclose(exact, model.compute_influence(optimizer_aware="unrolled", n_orders=2))


def test_one_small_step_agrees_with_the_in_run_score():
    # One full-batch SGD step with a small learning rate: curvature is negligible, both scores agree to first order
    model = float64_model("sgd", n_epochs=1, batch_size=48, max_grad_norm=1e9, learning_rate=1e-4)
    unrolled = model.compute_influence(optimizer_aware="unrolled")
    in_run = model.compute_influence(optimizer_aware=True)
    np.testing.assert_allclose(unrolled, in_run, rtol=1e-3, atol=1e-6 * np.abs(in_run).max())


def test_errors():
    model = float64_model("adam")
    with pytest.raises(ValueError, match="optimizer_aware must be"):
        model.compute_influence(optimizer_aware="yes")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="n_orders must be"):
            model.compute_influence(optimizer_aware="unrolled", n_orders=bad)
    for bad in (-1e-3, float("nan"), float("inf"), "1e-3"):
        with pytest.raises(ValueError, match="clip_smoothing must be"):
            model.compute_influence(optimizer_aware="unrolled", clip_smoothing=bad)
    with pytest.raises(ValueError, match="pass optimizer_aware='unrolled'"):
        model.compute_influence(optimizer_aware=True, n_orders=2)
    with pytest.raises(ValueError, match="pass optimizer_aware='unrolled'"):
        model.compute_influence(clip_smoothing=1e-3)
    model.target_kl = 0.01
    with pytest.raises(ValueError, match="target_kl"):
        unrolled_influence(model, ReturnTarget(), 64)


def test_callbacks_take_the_unrolled_score(tmp_path):
    from sb3_influence import AttributionCallback, IIFCallback, InfluencePPO, load_snapshots

    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[8])
    )
    iif = IIFCallback(fraction=0.5, optimizer_aware="unrolled")
    model.learn(128, callback=[iif, AttributionCallback(save_dir=str(tmp_path), optimizer_aware="unrolled")])
    frame = load_snapshots(str(tmp_path))
    assert len(frame) == 128 and not frame["keep"].all()
    with pytest.raises(ValueError, match="optimizer_aware must be"):
        AttributionCallback(optimizer_aware="yes")


@pytest.mark.parametrize("bad", [1, 0, 1.0, "True", "in-run", None])
def test_optimizer_aware_takes_only_its_three_values(bad):
    # 1 == True and 0 == False: a membership test would let them through and pick a scorer by accident
    from sb3_influence import AttributionCallback, IIFCallback
    from sb3_influence.common.round import ScoreRequest

    model = float64_model("adam")
    for make in (
        lambda: model.compute_influence(optimizer_aware=bad),
        lambda: AttributionCallback(optimizer_aware=bad),
        lambda: IIFCallback(optimizer_aware=bad),
        lambda: ScoreRequest(ReturnTarget(), "multi", optimizer_aware=bad),
    ):
        with pytest.raises(ValueError, match=r"optimizer_aware must be False .* True .* or 'unrolled'"):
            make()


def test_a_numpy_bool_is_read_as_a_bool():
    from sb3_influence import AttributionCallback, IIFCallback

    for flag in (np.True_, np.False_):
        for callback in (AttributionCallback(optimizer_aware=flag), IIFCallback(optimizer_aware=flag)):
            assert callback.optimizer_aware is bool(flag)
    assert AttributionCallback(optimizer_aware=np.True_).score_requests(SimpleNamespace(index=0))[0].in_run
    model = float64_model("adam")
    np.testing.assert_array_equal(
        model.compute_influence(optimizer_aware=np.True_), model.compute_influence(optimizer_aware=True)
    )


def test_cached_scores_are_kept_apart_by_the_unrolled_options():
    from sb3_influence import InfluencePPO
    from sb3_influence.common import sb3_compat

    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[8])
    )
    sb3_compat.collect_rollout(model)
    exact = model.compute_influence(optimizer_aware="unrolled", cache=True)
    smoothed = model.compute_influence(optimizer_aware="unrolled", clip_smoothing=np.float32(1e-2), cache=True)
    averaged = model.compute_influence(optimizer_aware="unrolled", n_orders=2, cache=True)
    # Another request is computed afresh (a key that ignored an option would return the cached array itself; at
    # round 0 few ratios reach the clip, so the smoothing changes the scores only in their last digits)
    for one, other in ((exact, smoothed), (exact, averaged), (smoothed, averaged)):
        assert not np.array_equal(one, other)
    assert np.abs(exact - averaged).max() > 0.1 * np.abs(exact).max()
    # Each request hits its own cache entry: the same numbers again, not another request's
    np.testing.assert_array_equal(model.compute_influence(optimizer_aware="unrolled", cache=True), exact)
    again = model.compute_influence(optimizer_aware="unrolled", clip_smoothing=1e-2, cache=True)
    np.testing.assert_array_equal(again, smoothed)


def test_attribution_snapshots_hold_the_smoothed_score_and_name_it(tmp_path):
    from sb3_influence import AttributionCallback, InfluencePPO
    from sb3_influence.common.snapshots import load_snapshot

    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[8])
    )
    options = dict(optimizer_aware="unrolled", n_orders=2, clip_smoothing=1e-2)
    model.learn(64, callback=AttributionCallback(save_dir=str(tmp_path), **options))
    (path,) = sorted(tmp_path.glob("*.npz"))
    snapshot = load_snapshot(str(path))
    assert snapshot.metadata["scorer"] == options
    # The snapshot was written before the update, at θ(k): compute_influence (cache=False by default, so computed
    # afresh) scores the same round there
    np.testing.assert_array_equal(snapshot.arrays["influence/return"], model.compute_influence(**options))
    assert not np.allclose(snapshot.arrays["influence/return"], model.compute_influence(optimizer_aware="unrolled"))
    # The same run, resumed into the same folder with another scorer: refused (the column would mix two scores);
    # with the same scorer it continues
    with pytest.raises(ValueError, match="this run with another layout"):
        model.learn(64, callback=AttributionCallback(save_dir=str(tmp_path)), reset_num_timesteps=False)
    model.learn(64, callback=AttributionCallback(save_dir=str(tmp_path), **options), reset_num_timesteps=False)
    assert len(sorted(tmp_path.glob("*.npz"))) == 2
    with pytest.raises(ValueError, match="AttributionCallback: n_orders and clip_smoothing change the unrolled"):
        AttributionCallback(optimizer_aware=True, n_orders=2)
    with pytest.raises(ValueError, match="AttributionCallback: clip_smoothing must be"):
        AttributionCallback(optimizer_aware="unrolled", clip_smoothing=-1.0)


def test_iif_ranks_by_the_smoothed_order_averaged_score():
    from sb3_influence import IIFCallback, InfluencePPO
    from sb3_influence.common.filters import DROP_RULES

    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[8])
    )
    options = dict(optimizer_aware="unrolled", n_orders=2, clip_smoothing=1e-2)
    iif = IIFCallback(fraction=0.5, **options)
    assert iif.settings["n_orders"] == 2 and iif.settings["clip_smoothing"] == 1e-2
    model.learn(64, callback=iif)
    # After learn(), compute_influence scores the last round at θ(k); with every record kept again (the replay walks
    # the kept ones), these are the scores the filter ranked
    model.rollout_buffer.keep[...] = True
    scores = model.rollout_buffer.to_flat(model.compute_influence(**options))
    exact = model.rollout_buffer.to_flat(model.compute_influence(optimizer_aware="unrolled"))
    assert not np.allclose(scores, exact)
    expected = DROP_RULES["neg-bottom"](scores, 0.5, np.random.default_rng(0))
    np.testing.assert_array_equal(model.rollout_buffer.to_flat(iif.last_drop), expected)
    with pytest.raises(ValueError, match="IIFCallback: n_orders and clip_smoothing change the unrolled scorer only"):
        IIFCallback(optimizer_aware=True, clip_smoothing=1e-3)
    with pytest.raises(ValueError, match="IIFCallback: n_orders must be"):
        IIFCallback(optimizer_aware="unrolled", n_orders=0)
