"""Exactness of the influence engine against brute-force per-record gradients (float64, every action and observation space)."""

import copy

import numpy as np
import pytest
import torch as th
from conftest import (
    buffer_tensors,
    collect_rollout,
    make_env,
    policy_for,
    reference_influence,
    reference_log_prob,
    reference_return_target,
)
from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import ActionTarget, InfluencePPO, ReturnTarget

CASES = {
    # name: (observation space, action space, extra kwargs)
    "mlp": ("box", "discrete", {}),
    "cnn": ("image", "discrete", {}),
    "gaussian": ("box", "box", {}),
    "dict": ("dict", "multidiscrete", {}),
    "multibinary": ("discrete", "multibinary", {}),
    "gsde": ("box", "box", {"use_sde": True}),
    "odd-layers": ("sequence", "box", {}),
}


def make_model(case: str, method: str = "ghost", n_envs: int = 2, seed: int = 0, **kwargs) -> InfluencePPO:
    obs, action, extra = CASES[case]
    policy, policy_kwargs = policy_for(obs)
    env = make_vec_env(lambda: make_env(obs, action), n_envs=n_envs, seed=seed)
    params = dict(n_steps=24, batch_size=16, n_epochs=2, seed=seed, policy_kwargs=policy_kwargs, influence_method=method)
    params.update(extra)
    params.update(kwargs)
    return InfluencePPO(policy, env, **params)


def double_rollout(case: str, method: str = "ghost", **kwargs) -> InfluencePPO:
    model = make_model(case, method, **kwargs)
    collect_rollout(model)
    if case != "mlp":
        # Move away from the initialisation (zero action head): exercise every layer
        with th.no_grad():
            for param in model.policy.parameters():
                param.add_(0.3 * th.randn_like(param))
    model.policy.double()
    return model


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize("method", ["ghost", "jvp"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_against_brute_force(case, method):
    model = double_rollout(case, method)
    scores = model.compute_influence("return")
    expected = model.rollout_buffer.to_records(reference_influence(model, reference_return_target(model)))
    assert scores.shape == (model.n_steps, model.n_envs)
    assert np.abs(expected).max() > 1e-6
    assert relative_error(scores, expected) < 1e-8


@pytest.mark.parametrize("case", ["mlp", "cnn", "gaussian"])
def test_exact_with_zero_and_tiny_target_weights(case):
    # One backward gives ∇f and every record's layer-output gradient scaled by its target weight A_j / n, which the
    # engine divides out: records whose raw advantage is zero or tiny (their normalised advantage is not) are
    # scored again without the scale, and must match the brute force like the others
    model = double_rollout(case)
    advantages = model.rollout_buffer.advantages
    advantages[::3] = 0.0
    advantages[1::5] *= 1e-12
    scores = model.compute_influence("return")
    expected = model.rollout_buffer.to_records(reference_influence(model, reference_return_target(model)))
    assert np.isfinite(scores).all()
    assert np.abs(scores[::3]).min() > 0
    assert relative_error(scores, expected) < 1e-8


def test_all_weights_tiny_in_float32_match_the_chunked_path():
    # Every raw advantage ~1e-20 (the normalised ones are unchanged): w_j g_j would underflow in float32, so every
    # record must be rescored unscaled; the chunked path (one chunk per 16 records) never scales
    model = make_model("mlp")
    collect_rollout(model)
    model.rollout_buffer.advantages[:] *= 1e-20
    fused = model.compute_influence("return")
    chunked = model.compute_influence("return", batch_size=16)
    assert np.abs(chunked).max() > 0
    np.testing.assert_allclose(fused, chunked, rtol=1e-4, atol=1e-6 * np.abs(chunked).max())


@pytest.mark.parametrize("case", ["mlp", "cnn"])
def test_frozen_first_layer_exact(case):
    # A frozen layer's output needs no gradient: it has nothing to score, and the fused backward must skip it
    model = double_rollout(case)
    policy = model.policy
    first = policy.features_extractor.cnn[0] if case == "cnn" else policy.mlp_extractor.policy_net[0]
    first.requires_grad_(False)
    scores = model.compute_influence("return")
    expected = model.rollout_buffer.to_records(reference_influence(model, reference_return_target(model)))
    assert relative_error(scores, expected) < 1e-8
    np.testing.assert_allclose(model.compute_influence("return", batch_size=16), scores, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("case", ["mlp", "gaussian", "dict"])
def test_action_target_exact(case):
    model = double_rollout(case, normalize_advantage=False)
    obs, actions = buffer_tensors(model)
    pick = np.array([1, 5, 7])
    target_obs = {k: v[pick].numpy() for k, v in obs.items()} if isinstance(obs, dict) else obs[pick].numpy()
    target_actions = actions[pick].numpy()
    if case == "mlp":
        target_actions = target_actions.reshape(-1)
    scores = model.compute_influence(ActionTarget(target_obs, target_actions))

    def target_fn(policy, _obs, _actions):
        t_obs = (
            {k: th.as_tensor(v) for k, v in target_obs.items()} if isinstance(target_obs, dict) else th.as_tensor(target_obs)
        )
        return reference_log_prob(policy, t_obs, th.as_tensor(target_actions)).mean()

    expected = model.rollout_buffer.to_records(reference_influence(model, target_fn))
    assert relative_error(scores, expected) < 1e-8


@pytest.mark.parametrize("case", ["cnn", "gaussian", "dict"])
def test_chunk_size_invariance(case):
    model = double_rollout(case)
    full = model.compute_influence(batch_size=10_000)
    for batch_size in (1, 7, 16):
        np.testing.assert_allclose(model.compute_influence(batch_size=batch_size), full, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("case", ["mlp", "gaussian"])
def test_additivity(case):
    """Σ_i I_i = −⟨∇Σ_i ℓ_i, ∇f⟩ from two ordinary backward passes."""
    model = double_rollout(case)
    scores = model.compute_influence("return")
    policy = model.policy
    obs, actions = buffer_tensors(model)
    adv = th.as_tensor(model.rollout_buffer.to_flat(model.training_advantages()))
    params = [p for p in policy.parameters() if p.requires_grad]
    policy.zero_grad()
    (-(adv * reference_log_prob(policy, obs, actions)).sum()).backward()
    loss_grad = [p.grad.clone() if p.grad is not None else th.zeros_like(p) for p in params]
    policy.zero_grad()
    reference_return_target(model)(policy, obs, actions).backward()
    target_grad = [p.grad.clone() if p.grad is not None else th.zeros_like(p) for p in params]
    expected = -sum((a * b).sum() for a, b in zip(loss_grad, target_grad, strict=True)).item()
    assert scores.sum() == pytest.approx(expected, rel=1e-9)


def test_first_order_sgd_step():
    """One SGD step of size η on ℓ_i alone changes f by ≈ η·I_i (Pearson > 0.99 over 100 records)."""
    model = make_model("gaussian", n_envs=2, n_steps=50)
    collect_rollout(model)
    model.policy.double()
    scores = model.rollout_buffer.to_flat(model.compute_influence("return"))
    policy = model.policy
    obs, actions = buffer_tensors(model)
    adv = th.as_tensor(model.rollout_buffer.to_flat(model.training_advantages()))
    target = reference_return_target(model)
    params = [p for p in policy.parameters() if p.requires_grad]
    original = [p.detach().clone() for p in params]
    eta = 1e-4
    with th.no_grad():
        f0 = target(policy, obs, actions).item()
    changes = []
    for i in range(100):
        loss_i = -(
            adv[i]
            * reference_log_prob(
                policy,
                {k: v[i : i + 1] for k, v in obs.items()} if isinstance(obs, dict) else obs[i : i + 1],
                actions[i : i + 1],
            )
        ).sum()
        grads = th.autograd.grad(loss_i, params, allow_unused=True)
        with th.no_grad():
            for p, g in zip(params, grads, strict=True):
                if g is not None:
                    p.sub_(eta * g)
            changes.append(target(policy, obs, actions).item() - f0)
            for p, p0 in zip(params, original, strict=True):
                p.copy_(p0)
    changes = np.array(changes)
    assert np.corrcoef(changes, eta * scores[:100])[0, 1] > 0.99
    np.testing.assert_allclose(changes, eta * scores[:100], atol=1e-3 * np.abs(eta * scores).max())


def test_float32_matches_float64():
    model = make_model("cnn")
    collect_rollout(model)
    scores32 = model.compute_influence()
    model.policy.double()
    scores64 = model.compute_influence()
    np.testing.assert_allclose(scores32, scores64, rtol=1e-3, atol=1e-5 * np.abs(scores64).max())


def test_log_prob_matches_sb3_evaluate_actions():
    for case in CASES:
        model = make_model(case)
        collect_rollout(model)
        obs, actions = buffer_tensors(model)
        sb3_actions = actions.long().flatten() if case in ("mlp", "cnn") else actions
        _, expected, _ = model.policy.evaluate_actions(obs, sb3_actions)
        th.testing.assert_close(model.influence_engine.log_prob(obs, actions), expected)


@pytest.mark.parametrize("method", ["ghost", "jvp"])
@pytest.mark.parametrize("case", ["gaussian", "cnn"])
def test_scoring_leaves_policy_and_optimizer_alone(case, method):
    model = make_model(case, method)
    collect_rollout(model)
    for training in (True, False):
        model.policy.set_training_mode(training)
        params = [p.detach().clone() for p in model.policy.parameters()]
        optimizer_state = copy.deepcopy(model.policy.optimizer.state_dict())
        model.compute_influence("return")
        assert model.policy.training is training
        assert all(p.grad is None for p in model.policy.parameters())
        assert all(th.equal(p, q) for p, q in zip(model.policy.parameters(), params, strict=True))
        # Every parameter is still the module's own Parameter (a shared extractor is reachable under 3 names)
        assert all(isinstance(p, th.nn.Parameter) and p.requires_grad for p in model.policy.parameters())
        assert model.policy.optimizer.state_dict() == optimizer_state
        # No hook is left behind on any module, and the model can still be deep-copied
        assert all(not m._forward_hooks for m in model.policy.modules())
        copy.deepcopy(model.policy)


def test_zero_advantages_give_zero_finite_scores():
    model = make_model("gaussian")
    collect_rollout(model)
    model.rollout_buffer.advantages[:] = 0.0
    scores = model.compute_influence()
    assert np.isfinite(scores).all() and not scores.any()


def test_seeded_runs_give_identical_scores():
    runs = []
    for _ in range(2):
        model = make_model("dict", seed=3)
        model.learn(48)
        runs.append(model.compute_influence())
    np.testing.assert_array_equal(runs[0], runs[1])


def test_raw_advantages_when_not_normalized():
    model = make_model("mlp", normalize_advantage=False)
    collect_rollout(model)
    np.testing.assert_array_equal(model.training_advantages(), model.rollout_buffer.advantages.astype(np.float64))


def test_return_target_equals_string_target():
    model = make_model("mlp")
    collect_rollout(model)
    np.testing.assert_array_equal(model.compute_influence("return"), model.compute_influence(ReturnTarget()))


def test_multi_checkpoint_with_one_step_equals_single_checkpoint():
    # The replay runs PPO.train, which feeds float32 observations: float32 here, float32 tolerances
    model = make_model("gaussian", n_epochs=1, batch_size=48)
    collect_rollout(model)
    single = model.compute_influence(checkpoints="single")
    np.testing.assert_allclose(
        model.compute_influence(checkpoints="multi"), single, rtol=1e-4, atol=1e-6 * np.abs(single).max()
    )


def test_multi_checkpoint_sums_over_the_round_steps():
    """Reference: snapshot θ_j and the minibatch at every step of a real update, brute-force each step's scores."""
    model = make_model("mlp", n_epochs=2, batch_size=16)
    collect_rollout(model)
    scores = model.rollout_buffer.to_flat(model.compute_influence(checkpoints="multi"))

    snapshots = []
    reference_model = copy.deepcopy(model)
    # The update's own per-step hook gives the minibatch; the parameters are copied before the optimizer moves them
    model.update(
        step_hooks=[lambda info: snapshots.append((copy.deepcopy(model.policy.state_dict()), info.record_ids.copy()))]
    )
    assert len(snapshots) == 6  # 48 records / 16, two epochs

    expected = np.zeros_like(scores)
    for state, ids in snapshots:
        reference_model.policy.load_state_dict(state)
        raw = reference_model.rollout_buffer.flat_field("advantages").astype(np.float64)
        adv = (raw[ids] - raw[ids].mean()) / (raw[ids].std(ddof=1) + 1e-8)
        step_advantages = np.zeros_like(raw)
        step_advantages[ids] = adv
        full = reference_influence(reference_model, reference_return_target(reference_model), step_advantages)
        expected[ids] += full[ids]
    assert relative_error(scores, expected) < 1e-4


def test_multi_checkpoint_leaves_the_update_unchanged():
    plain = make_model("mlp")
    collect_rollout(plain)
    plain.train()
    scored = make_model("mlp")
    collect_rollout(scored)
    scored.compute_influence(checkpoints="multi")
    scored.train()
    assert all(th.equal(p, q) for p, q in zip(plain.policy.parameters(), scored.policy.parameters(), strict=True))
    with pytest.raises(ValueError, match="checkpoints"):
        scored.compute_influence(checkpoints="all")
