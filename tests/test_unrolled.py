"""The unrolled (hypergradient) influence: its replay lands where the real update lands; its gradient is right."""

import numpy as np
import pytest
import torch as th
from test_optimizer_aware import float64_model

from sb3_influence import ReturnTarget
from sb3_influence.analysis.intervention import target_value
from sb3_influence.common.scoring.unrolled import _target_value, _Wrapped, unrolled_influence, unrolled_replay


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "sgd-nesterov", "adam", "adamw", "adam-l2", "rmsprop"])
def test_replay_with_unit_weights_is_the_update(optimizer):
    model = float64_model(optimizer, max_grad_norm=0.3, clip_range=0.05)
    theta = unrolled_replay(model)
    model.update()
    for name, param in model.policy.named_parameters():
        th.testing.assert_close(theta[name].detach(), param.detach(), rtol=1e-9, atol=1e-12, msg=name)


def _f_of_weights(model, weights):
    theta = unrolled_replay(model, weights)
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
