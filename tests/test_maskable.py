"""InfluenceMaskablePPO: bit-identical to MaskablePPO, masks in log π exactly as the loss uses them, callbacks."""

import copy

import numpy as np
import pytest
import torch as th
from conftest import (
    buffer_tensors,
    collect_rollout,
    make_env,
    make_masked_env,
    params_equal,
    policy_for,
    reference_log_prob_grads,
    reference_training_advantages,
)
from gymnasium import spaces
from sb3_contrib import MaskablePPO
from stable_baselines3.common.env_util import make_vec_env
from test_optimizer_aware import brute_force as optimizer_aware_brute_force
from test_optimizer_aware import float64_model, return_target

from sb3_influence import AttributionCallback, IIFCallback, InfluenceMaskablePPO, InfluenceRolloutBuffer, load_snapshot
from sb3_influence.analysis.intervention import target_value
from sb3_influence.common import sb3_compat
from sb3_influence.common.snapshots import load_snapshots
from sb3_influence.maskable import InfluenceMaskableDictRolloutBuffer, InfluenceMaskableRolloutBuffer


def build(cls, obs="box", action="discrete", n_envs=2, seed=1, **kwargs):
    policy, policy_kwargs = policy_for(obs)
    env = make_vec_env(lambda: make_masked_env(obs, action), n_envs=n_envs, seed=seed)
    params = dict(n_steps=32, batch_size=16, n_epochs=2, seed=seed, policy_kwargs=policy_kwargs)
    params.update(kwargs)
    return cls(policy, env, **params)


@pytest.mark.parametrize(
    "obs, action, kwargs",
    [
        ("box", "discrete", {}),
        ("dict", "multidiscrete", {"normalize_advantage": False}),
        ("image", "multibinary", {"batch_size": 24}),  # truncated last minibatch
        ("box", "multidiscrete", {"batch_size": None, "clip_range_vf": 0.1, "learning_rate": lambda p: 1e-3 * p}),
        ("discrete", "discrete", {"target_kl": 0.001, "max_grad_norm": 0.05}),
    ],
)
def test_bit_identical_to_maskable_ppo(obs, action, kwargs):
    # Built and trained one after the other: constructing a model seeds numpy's global RNG
    reference = build(MaskablePPO, obs, action, **kwargs).learn(128)
    model = build(InfluenceMaskablePPO, obs, action, **kwargs).learn(128)
    assert params_equal(reference, model)
    assert reference.policy.optimizer.state_dict()["state"].keys() == model.policy.optimizer.state_dict()["state"].keys()


def test_bit_identical_without_masking_and_with_nothing_dropped(tmp_path):
    reference = build(MaskablePPO).learn(128, use_masking=False)
    model = build(InfluenceMaskablePPO).learn(128, use_masking=False)
    assert params_equal(reference, model)
    # IIF with fraction 0 and a snapshot writer: still MaskablePPO
    reference = build(MaskablePPO).learn(128)
    model = build(InfluenceMaskablePPO).learn(
        128, callback=[IIFCallback(fraction=0.0), AttributionCallback(save_dir=str(tmp_path))]
    )
    assert params_equal(reference, model)


def double_rollout(obs, action, method="ghost", **kwargs) -> InfluenceMaskablePPO:
    model = build(InfluenceMaskablePPO, obs, action, n_steps=24, influence_method=method, **kwargs)
    collect_rollout(model)
    # Move away from the initialisation (near-zero action head): masks then change every record's gradient
    with th.no_grad():
        for param in model.policy.parameters():
            param.add_(0.3 * th.randn_like(param))
    model.policy.double()
    return model


def brute_force(model, use_masks=True) -> np.ndarray:
    """I_i = Â_i ⟨∇log π_i, ∇f⟩ with f = mean_j A_j log π_j, from one autograd gradient per record."""
    grads = reference_log_prob_grads(model, use_masks=use_masks)
    raw = th.as_tensor(model.rollout_buffer.flat_field("advantages").astype(np.float64))
    v = raw @ grads / len(raw)
    return reference_training_advantages(model) * (grads @ v).numpy()


@pytest.mark.parametrize("method", ["ghost", "jvp"])
@pytest.mark.parametrize(
    "obs, action", [("box", "discrete"), ("dict", "multidiscrete"), ("image", "multibinary"), ("sequence", "discrete")]
)
def test_exact_against_brute_force_with_masks(obs, action, method):
    model = double_rollout(obs, action, method)
    buffer = model.rollout_buffer
    masks = buffer.record_action_masks(np.arange(buffer.n_records))
    assert (masks == 0).any(), "the test env must mask some actions"
    expected = brute_force(model)
    scores = buffer.to_flat(model.compute_influence("return"))
    assert np.abs(expected).max() > 1e-6
    np.testing.assert_allclose(scores, expected, rtol=1e-8, atol=1e-10 * np.abs(expected).max())
    # Chunked scoring (and the non-fused target path) gives the same scores
    np.testing.assert_allclose(buffer.to_flat(model.compute_influence(batch_size=7)), expected, rtol=1e-8, atol=1e-12)
    # The masks matter: without them the scores are different
    unmasked = brute_force(model, use_masks=False)
    assert np.abs(unmasked - expected).max() > 1e-3 * np.abs(expected).max()


def test_engine_log_prob_matches_evaluate_actions_with_masks():
    model = build(InfluenceMaskablePPO, "dict", "multidiscrete")
    collect_rollout(model)
    obs, actions = buffer_tensors(model)
    ids = np.arange(model.rollout_buffer.n_records)
    masks = model.influence_engine.action_masks(ids)
    _, expected, _ = model.policy.evaluate_actions(obs, actions, action_masks=masks)
    th.testing.assert_close(model.influence_engine.log_prob(obs, actions, masks), expected)
    # ... and they differ from the unmasked log-probabilities
    assert not th.allclose(model.influence_engine.log_prob(obs, actions), expected)


def test_masks_stored_with_the_records():
    model = build(InfluenceMaskablePPO, "box", "discrete")
    collect_rollout(model)
    buffer = model.rollout_buffer
    assert isinstance(buffer, InfluenceMaskableRolloutBuffer)
    before = buffer.record_action_masks(np.arange(buffer.n_records)).copy()
    # Sample order: the samples tuple carries each record's mask (after get()'s flattening too)
    ids = np.array([5, 0, 40])
    np.testing.assert_array_equal(buffer.samples(ids).action_masks.numpy(), before[ids])
    np.testing.assert_array_equal(buffer.record_action_masks(np.arange(buffer.n_records)), before)
    # record id = env * n_steps + step
    np.testing.assert_array_equal(before[1 * 32 + 3], np.asarray(buffer.action_masks).reshape(2, 32, -1)[1, 3])
    dict_model = build(InfluenceMaskablePPO, "dict", "discrete")
    assert isinstance(dict_model.rollout_buffer, InfluenceMaskableDictRolloutBuffer)


def test_iif_attribution_and_snapshots(tmp_path):
    model = build(InfluenceMaskablePPO, "box", "multidiscrete")
    attribution = AttributionCallback(save_dir=str(tmp_path))
    model.learn(128, callback=[IIFCallback(fraction=0.5), attribution])
    snapshot = load_snapshot(attribution.last_path)
    assert snapshot.arrays["action_mask"].shape == (32, 2, 5) and snapshot.arrays["action_mask"].dtype == bool
    assert not snapshot.arrays["action_mask"].all()
    assert not snapshot.arrays["keep"].all()
    frame = load_snapshots(str(tmp_path))
    assert len(frame) == 2 * 64 and "action_mask" in frame.columns and "trajectory_id" in frame.columns
    assert frame.attrs["metadata"][0]["config"]["algo"] == "InfluenceMaskablePPO"


def test_save_load_round_trip(tmp_path):
    model = build(InfluenceMaskablePPO, influence_batch_size=17).learn(128)
    model.save(tmp_path / "model")
    loaded = InfluenceMaskablePPO.load(tmp_path / "model")
    assert params_equal(model, loaded)
    assert loaded.influence_batch_size == 17 and loaded.n_rounds == model.n_rounds == 2
    assert isinstance(loaded.rollout_buffer, InfluenceMaskableRolloutBuffer)


def test_bad_settings():
    env = make_vec_env(lambda: make_masked_env("box", "discrete"), n_envs=1)
    with pytest.raises(ValueError, match="action space"):
        InfluenceMaskablePPO("MlpPolicy", make_vec_env(lambda: make_env("box", "box"), n_envs=1))
    with pytest.raises(TypeError, match="rollout_buffer_class"):
        InfluenceMaskablePPO("MlpPolicy", env, rollout_buffer_class=InfluenceRolloutBuffer)
    with pytest.raises(ValueError, match="batch_size"):
        InfluenceMaskablePPO("MlpPolicy", env, batch_size=0)
    with pytest.raises(ValueError, match="influence_method"):
        InfluenceMaskablePPO("MlpPolicy", env, influence_method="exact")
    model = InfluenceMaskablePPO("MlpPolicy", make_vec_env(lambda: make_env("box", "discrete"), n_envs=1), n_steps=16)
    with pytest.raises(ValueError, match="action masking"):
        model.learn(16)


def test_optimizer_aware_scores_and_training_unchanged():
    scores = {}

    class Replay(AttributionCallback):
        def on_round(self, round_):
            scores.setdefault("replay", []).append(self.model.compute_influence(optimizer_aware=True))

    reference = build(MaskablePPO).learn(64)
    model = build(InfluenceMaskablePPO).learn(64, callback=[Replay(), IIFCallback(fraction=0.0, optimizer_aware=True)])
    assert params_equal(reference, model)
    assert np.isfinite(scores["replay"][0]).all() and np.abs(scores["replay"][0]).max() > 0


# ---------------------------------------------------------------------- optimizer-aware scores, against brute force
def maskable_loss(model, samples, advantages, clip_range, clip_range_vf, use_masks=True):
    """MaskablePPO.train's loss per record, through sb3-contrib's ``evaluate_actions`` with each record's stored mask."""
    actions = samples.actions.long().flatten() if isinstance(model.action_space, spaces.Discrete) else samples.actions
    masks = samples.action_masks if use_masks else None
    values, log_prob, entropy = model.policy.evaluate_actions(samples.observations, actions, action_masks=masks)
    ratio = th.exp(log_prob - samples.old_log_prob)
    policy_loss = -th.min(advantages * ratio, advantages * th.clamp(ratio, 1 - clip_range, 1 + clip_range))
    values = values.flatten()
    if clip_range_vf is not None:
        values = samples.old_values + th.clamp(values - samples.old_values, -clip_range_vf, clip_range_vf)
    return policy_loss - model.ent_coef * entropy + model.vf_coef * (samples.returns - values) ** 2


def masked_float64_model(optimizer, action, **kwargs) -> InfluenceMaskablePPO:
    model = float64_model(optimizer, algo=InfluenceMaskablePPO, env=make_masked_env("box", action), **kwargs)
    buffer = model.rollout_buffer
    assert not buffer.record_action_masks(np.arange(buffer.n_records)).all(), "the env must mask some actions"
    return model


CLIPPED = dict(max_grad_norm=0.05, clip_range=0.05, clip_range_vf=0.1)  # every step clipped, ratios leave the region


# Layer scorers None: ghost dot products of the update's own passes; (): forward mode of record_losses for every parameter
@pytest.mark.parametrize(
    "optimizer, action, layer_scorers, kwargs",
    [
        ("sgd", "discrete", None, {}),
        ("sgd", "multidiscrete", (), CLIPPED),
        ("adam", "discrete", (), {"max_grad_norm": 1e9}),
        ("adam", "multidiscrete", None, CLIPPED),
        ("sgd-momentum", "multibinary", None, CLIPPED),
    ],
)
def test_optimizer_aware_matches_brute_force_replay_with_masks(optimizer, action, layer_scorers, kwargs):
    # (the default max_grad_norm=0.5 clips every step here; CLIPPED also activates the ratio and value clips)
    model = masked_float64_model(optimizer, action, influence_layer_scorers=layer_scorers, **kwargs)
    scores = model.compute_influence(optimizer_aware=True)
    expected = optimizer_aware_brute_force(model, record_losses=maskable_loss)
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())
    # The masks matter: a replay that leaves them out of log π scores differently
    unmasked = optimizer_aware_brute_force(model, record_losses=lambda *args: maskable_loss(*args, use_masks=False))
    assert np.abs(unmasked - expected).max() > 1e-3 * np.abs(expected).max()


def weighted_update_target(model, weights: np.ndarray) -> float:
    """f after the real update (torch's optimizer, its clipping) on loss mean(w_i ℓ_i), ℓ_i from ``maskable_loss``."""
    replay = copy.deepcopy(model)
    params = list(replay.policy.parameters())
    clip_range_vf = None if replay.clip_range_vf is None else replay.clip_range_vf(sb3_compat.progress_remaining(replay))
    weights = th.as_tensor(weights)

    def reweight(info):
        losses = maskable_loss(replay, info.samples, info.advantages, info.clip_range, clip_range_vf)
        grads = th.autograd.grad((weights[info.record_ids] * losses).mean(), params, allow_unused=True)
        for param, grad in zip(params, grads, strict=True):
            param.grad = th.zeros_like(param) if grad is None else grad
        th.nn.utils.clip_grad_norm_(params, replay.max_grad_norm)

    state = np.random.get_state()  # every replay draws the same later-epoch permutations
    replay.update(step_hooks=[reweight])
    np.random.set_state(state)
    with th.no_grad():
        return float(return_target(replay))


@pytest.mark.parametrize("optimizer, kwargs", [("sgd", {}), ("adam", CLIPPED)])
def test_unrolled_matches_finite_differences_of_the_weighted_update_with_masks(optimizer, kwargs):
    model = masked_float64_model(optimizer, "multidiscrete", **kwargs)
    scores = model.rollout_buffer.to_flat(model.compute_influence(optimizer_aware="unrolled"))
    n = model.rollout_buffer.n_records
    # At w = 1 the reference loss is the update's: the real update reaches the same target value (the package's f)
    reference, state = copy.deepcopy(model), np.random.get_state()
    reference.update()
    np.random.set_state(state)
    assert weighted_update_target(model, np.ones(n)) == pytest.approx(target_value(reference), rel=1e-10)
    for record in (0, 17, n - 1):
        step = np.zeros(n)
        step[record] = 1e-4
        slope = (weighted_update_target(model, 1 + step) - weighted_update_target(model, 1 - step)) / 2e-4
        assert slope == pytest.approx(scores[record], rel=1e-4, abs=1e-10 * np.abs(scores).max())
