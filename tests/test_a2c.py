"""InfluenceA2C: bit-identical to A2C, one optimiser step per round, exact single-checkpoint scores."""

import numpy as np
import pytest
import torch as th
from conftest import (
    collect_rollout,
    make_env,
    params_equal,
    policy_for,
    reference_log_prob,
    reference_log_prob_grads,
    requires,
)
from stable_baselines3 import A2C
from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import IIFCallback, InfluenceA2C


def build(cls, obs="box", action="discrete", n_envs=2, seed=1, **kwargs):
    policy, policy_kwargs = policy_for(obs)
    env = make_vec_env(lambda: make_env(obs, action), n_envs=n_envs, seed=seed)
    params = dict(n_steps=8, seed=seed, policy_kwargs=policy_kwargs)
    params.update(kwargs)
    return cls(policy, env, **params)


@pytest.mark.parametrize(
    "obs, action, kwargs",
    [
        ("box", "discrete", {}),
        ("dict", "box", {"normalize_advantage": True}),
        ("image", "multidiscrete", {"use_rms_prop": False}),
        ("box", "box", {"use_sde": True, "learning_rate": lambda p: 1e-3 * p}),
        ("discrete", "multibinary", {"max_grad_norm": 0.05, "ent_coef": 0.01, "gae_lambda": 0.9}),
    ],
)
def test_bit_identical_to_a2c(obs, action, kwargs):
    # Built and trained one after the other: constructing a model seeds numpy's global RNG
    reference = build(A2C, obs, action, **kwargs).learn(80)
    model = build(InfluenceA2C, obs, action, **kwargs).learn(80)
    assert params_equal(reference, model)
    assert model.n_rounds == 5
    assert reference.policy.optimizer.state_dict()["state"].keys() == model.policy.optimizer.state_dict()["state"].keys()


def test_bit_identical_with_nothing_dropped():
    reference = build(A2C, normalize_advantage=True).learn(48)
    model = build(InfluenceA2C, normalize_advantage=True).learn(48, callback=IIFCallback(fraction=0.0))
    assert params_equal(reference, model)
    # ... and dropping changes the update
    dropped = build(InfluenceA2C, normalize_advantage=True).learn(48, callback=IIFCallback(fraction=1.0, rule="neg"))
    assert not params_equal(reference, dropped)


def whole_buffer_advantages(model) -> np.ndarray:
    raw = model.rollout_buffer.flat_field("advantages").astype(np.float64)
    if not model.normalize_advantage:
        return raw
    return (raw - raw.mean()) / (raw.std(ddof=1) + 1e-8)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("obs, action", [("box", "discrete"), ("box", "box"), ("dict", "multidiscrete")])
def test_exact_against_brute_force(obs, action, normalize):
    model = build(InfluenceA2C, obs, action, n_steps=24, normalize_advantage=normalize)
    collect_rollout(model)
    with th.no_grad():
        for param in model.policy.parameters():
            param.add_(0.3 * th.randn_like(param))
    model.policy.double()
    grads = reference_log_prob_grads(model)
    raw = th.as_tensor(model.rollout_buffer.flat_field("advantages").astype(np.float64))
    expected = whole_buffer_advantages(model) * (grads @ (raw @ grads / len(raw))).numpy()
    scores = model.rollout_buffer.to_flat(model.compute_influence())
    assert np.abs(expected).max() > 1e-6
    np.testing.assert_allclose(scores, expected, rtol=1e-8, atol=1e-10 * np.abs(expected).max())
    np.testing.assert_allclose(model.training_advantages(), model.rollout_buffer.to_records(whole_buffer_advantages(model)))


def test_one_step_hook_ratio_one_no_clip():
    model = build(InfluenceA2C, normalize_advantage=True)
    collect_rollout(model)
    model.rollout_buffer.keep[:3, 0] = False
    infos = []
    model.update(step_hooks=[infos.append])
    assert len(infos) == 1
    info = infos[0]
    round_ = model.current_round()
    kept = model.rollout_buffer.flat_keep
    np.testing.assert_array_equal(info.record_ids, round_.first_permutation[kept[round_.first_permutation]])
    assert info.epoch == 0 and info.step == 0 and len(info.record_ids) == 16 - 3
    assert th.equal(info.ratio, th.ones_like(info.advantages)) and not info.clipped.any()
    assert 0 < info.clip_coef <= 1


def test_multi_checkpoint_equals_single_checkpoint():
    model = build(InfluenceA2C, n_steps=16, normalize_advantage=True)
    collect_rollout(model)
    single = model.compute_influence()
    multi = model.compute_influence(checkpoints="multi")
    np.testing.assert_allclose(multi, single, rtol=1e-5, atol=1e-7 * np.abs(single).max())


def test_scores_are_the_first_order_effect_of_the_round():
    """With plain SGD, the round's update changes f by ≈ (η/n) Σ_i I_i (the value loss does not touch log π)."""
    lr = 1e-3
    model = build(
        InfluenceA2C,
        n_steps=32,
        learning_rate=lr,
        max_grad_norm=1e9,
        policy_kwargs=dict(net_arch=[8, 8], optimizer_class=th.optim.SGD),
    )
    collect_rollout(model)
    model.policy.double()
    scores = model.compute_influence()
    buffer = model.rollout_buffer
    obs = th.as_tensor(buffer.flat_field("observations"))
    actions = th.as_tensor(buffer.flat_field("actions").astype(np.float32))
    raw = th.as_tensor(buffer.flat_field("advantages").astype(np.float64))

    def f() -> float:
        with th.no_grad():
            return float((raw * reference_log_prob(model.policy, obs, actions)).mean())

    before = f()
    model.policy.float()
    model.update()
    model.policy.double()
    change = f() - before
    predicted = lr / buffer.n_records * scores.sum()
    assert change == pytest.approx(predicted, rel=2e-2)


def test_save_load_round_trip(tmp_path):
    model = build(InfluenceA2C, influence_method="jvp").learn(32)
    model.save(tmp_path / "a2c")
    loaded = InfluenceA2C.load(tmp_path / "a2c")
    assert params_equal(model, loaded)
    assert loaded.influence_method == "jvp" and loaded.n_rounds == 2
    assert isinstance(loaded.policy.optimizer, th.optim.RMSprop)


@requires("yaml", extra="zoo")
def test_zoo_config_keys_are_parameters():
    import inspect

    import yaml

    from sb3_influence.zoo.launcher import hyperparams_path

    path = hyperparams_path("influence_a2c")
    with open(path) as file:
        config = yaml.safe_load(file)
    zoo_keys = {"n_envs", "n_timesteps", "policy", "normalize", "callback", "env_wrapper", "env_kwargs"}
    parameters = set(inspect.signature(InfluenceA2C.__init__).parameters)
    for env_id, entry in config.items():
        assert set(entry) - zoo_keys <= parameters, env_id
        for item in entry.get("callback", []):
            ((name, kwargs),) = item.items()
            assert name == "sb3_influence.IIFCallback"
            IIFCallback(**kwargs)


@pytest.mark.parametrize("optimizer", ["rmsprop", "sgd"])
def test_optimizer_aware_matches_brute_force_replay(optimizer):
    """The optimizer-aware scorer on A2C's one-step update (record_losses, RMSprop's update map) vs per-record autograd."""
    from test_optimizer_aware import OPTIMIZERS, Float64Flatten, brute_force

    optimizer_class, optimizer_kwargs = OPTIMIZERS[optimizer]
    model = InfluenceA2C(
        "MlpPolicy",
        make_env("box", "discrete"),
        n_steps=32,
        ent_coef=0.01,
        normalize_advantage=True,
        learning_rate=optimizer_kwargs["lr"],
        seed=0,
        policy_kwargs=dict(net_arch=[8], features_extractor_class=Float64Flatten),
    )
    model.policy.to(th.float64)
    model.policy.optimizer = optimizer_class(model.policy.parameters(), **optimizer_kwargs)
    collect_rollout(model)
    model.train()  # a round that is not the optimizer's first
    collect_rollout(model)
    expected = brute_force(model)
    scores = model.compute_influence(optimizer_aware=True)
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(scores, expected, rtol=1e-7, atol=1e-9 * np.abs(expected).max())


def test_unrolled_is_refused_with_a_clear_error():
    """The unrolled score replays PPO's loop: A2C says so before training, not with an AttributeError mid-run."""
    from sb3_influence import AttributionCallback

    model = InfluenceA2C("MlpPolicy", "CartPole-v1", n_steps=8, seed=0)
    for callback in (IIFCallback(fraction=0.1, optimizer_aware="unrolled"), AttributionCallback(optimizer_aware="unrolled")):
        with pytest.raises(ValueError, match="optimizer_aware=True"):
            model.learn(16, callback=callback)
    model.learn(8)
    with pytest.raises(ValueError, match="unrolled"):
        model.compute_influence("return", optimizer_aware="unrolled")
    assert np.isfinite(model.compute_influence("return", optimizer_aware=True)).all()
