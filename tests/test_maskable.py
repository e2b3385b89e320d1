"""InfluenceMaskablePPO: bit-identical to MaskablePPO, masks in log π exactly as the loss uses them, callbacks."""

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
from sb3_contrib import MaskablePPO
from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import AttributionCallback, IIFCallback, InfluenceMaskablePPO, InfluenceRolloutBuffer, load_snapshot
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
