"""InfluencePPO as a drop-in PPO: equivalence, the keep mask, save/load, spaces and bad inputs."""

import json
import zipfile

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from conftest import ACTION_SPACES, OBSERVATION_SPACES, SpaceEnv, collect_rollout, make_env, params_equal, policy_for, requires
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import SubprocVecEnv, VecCheckNan

from sb3_influence import ActionTarget, InfluenceDictRolloutBuffer, InfluencePPO, InfluenceRolloutBuffer


class OnRollout(BaseCallback):
    """Runs ``fn(model)`` at the end of every rollout (before the update)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self.fn(self.model)


def build(cls, obs="box", action="discrete", n_envs=2, seed=1, **kwargs):
    policy, policy_kwargs = policy_for(obs)
    env = make_vec_env(lambda: make_env(obs, action), n_envs=n_envs, seed=seed)
    params = dict(n_steps=32, batch_size=16, n_epochs=2, seed=seed, policy_kwargs=policy_kwargs)
    params.update(kwargs)
    return cls(policy, env, **params)


@pytest.mark.parametrize(
    "obs, action, kwargs",
    [
        ("box", "discrete", {}),
        ("dict", "box", {"normalize_advantage": False}),
        ("image", "multidiscrete", {"batch_size": 24}),  # truncated last minibatch
        ("box", "box", {"use_sde": True, "clip_range_vf": 0.1, "learning_rate": lambda p: 1e-3 * p}),
        ("box", "multibinary", {"target_kl": 0.001, "clip_range": lambda p: 0.1 + 0.1 * p, "max_grad_norm": 0.05}),
    ],
)
def test_bit_identical_to_ppo(obs, action, kwargs):
    ppo = build(PPO, obs, action, **kwargs).learn(128)
    influence_ppo = build(InfluencePPO, obs, action, **kwargs).learn(128)
    assert params_equal(ppo, influence_ppo)
    assert ppo.policy.optimizer.state_dict()["state"].keys() == influence_ppo.policy.optimizer.state_dict()["state"].keys()


def test_scoring_every_round_keeps_training_bit_identical():
    """Scoring draws the first epoch's permutation early: the update must not notice."""
    scores = []
    ppo = build(PPO).learn(128)
    model = build(InfluencePPO).learn(128, callback=OnRollout(lambda m: scores.append(m.compute_influence())))
    assert len(scores) == 2 and all(np.isfinite(s).all() for s in scores)
    assert params_equal(ppo, model)


def test_keep_mask_shape_and_reset():
    model = build(InfluencePPO)
    seen = []

    def drop_some(m):
        assert m.rollout_buffer.keep.shape == (m.n_steps, m.n_envs) and m.rollout_buffer.keep.all()
        m.rollout_buffer.keep[:5, 0] = False
        seen.append(m.rollout_buffer.flat_keep.sum())

    model.learn(192, callback=OnRollout(drop_some))
    assert seen == [model.n_steps * model.n_envs - 5] * 3
    np.testing.assert_array_equal(model.rollout_buffer.record_ids[3, 1], 1 * model.n_steps + 3)


def test_dropped_records_have_no_effect():
    dropped = [(0, 0), (7, 1), (31, 0)]

    def drop(scramble):
        def fn(m):
            buffer = m.rollout_buffer
            for step, env in dropped:
                buffer.keep[step, env] = False
                if scramble:
                    buffer.observations[step, env] = 1e3
                    buffer.advantages[step, env] = -1e6
                    buffer.returns[step, env] = 1e6
                    buffer.values[step, env] = 42.0
                    buffer.log_probs[step, env] = -1e3
                    buffer.actions[step, env] = 1

        return fn

    clean = build(InfluencePPO).learn(96, callback=OnRollout(drop(False)))
    scrambled = build(InfluencePPO).learn(96, callback=OnRollout(drop(True)))
    assert params_equal(clean, scrambled)
    # ... and dropping changes the update
    assert not params_equal(clean, build(InfluencePPO).learn(96))


def test_fewer_records_fewer_optimizer_steps():
    steps = []
    model = build(InfluencePPO, n_envs=1, n_steps=64, batch_size=16, n_epochs=1)
    original_step = model.policy.optimizer.step

    def counting_step(*args, **kwargs):
        steps.append(1)
        return original_step(*args, **kwargs)

    model.policy.optimizer.step = counting_step

    def drop_half(m):
        m.rollout_buffer.keep[::2] = False

    model.learn(64, callback=OnRollout(drop_half))
    assert len(steps) == 2  # 32 kept records / batch 16


def test_dropping_every_record_skips_the_update_with_a_warning():
    model = build(InfluencePPO)
    before = [p.detach().clone() for p in model.policy.parameters()]

    def drop_all(m):
        m.rollout_buffer.keep[:] = False

    with pytest.warns(UserWarning, match="Every record of this rollout was dropped"):
        model.learn(64, callback=OnRollout(drop_all))
    assert all(th.equal(p, q) for p, q in zip(model.policy.parameters(), before, strict=True))


def test_replacing_keep_with_wrong_shape_is_an_error():
    model = build(InfluencePPO)

    def replace(m):
        m.rollout_buffer.keep = np.ones(3, dtype=bool)

    with pytest.raises(ValueError, match=r"rollout_buffer\.keep must be a boolean array of shape"):
        model.learn(64, callback=OnRollout(replace))


def test_save_load_round_trip(tmp_path):
    model = build(InfluencePPO, "dict", "box", influence_batch_size=7, influence_method="jvp", learning_rate=1e-3)
    model.learn(64)
    path = tmp_path / "model.zip"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        data = json.loads(archive.read("data"))
    assert "_influence_engine" not in data and "_influence_cache" not in data
    assert data["influence_batch_size"] == 7 and data["influence_method"] == "jvp"

    loaded = InfluencePPO.load(path)
    assert loaded.influence_batch_size == 7 and loaded.influence_method == "jvp"
    assert loaded.influence_engine.method == "jvp"
    assert isinstance(loaded.rollout_buffer, InfluenceDictRolloutBuffer)
    assert params_equal(model, loaded)
    saved_state, loaded_state = model.policy.optimizer.state_dict(), loaded.policy.optimizer.state_dict()
    assert saved_state["param_groups"] == loaded_state["param_groups"]
    for key, state in saved_state["state"].items():
        for name, value in state.items():
            assert th.equal(th.as_tensor(value), th.as_tensor(loaded_state["state"][key][name]))

    # The loaded model scores as soon as it has a rollout again
    loaded.set_env(model.get_env())
    loaded.learn(64, reset_num_timesteps=False)
    assert np.isfinite(loaded.compute_influence()).all()


@requires("tensorboard", extra="tensorboard")
def test_tb_log_name_default(tmp_path):
    model = build(InfluencePPO, tensorboard_log=str(tmp_path))
    model.learn(64)
    assert [p.name for p in tmp_path.iterdir()] == ["InfluencePPO_1"]


@pytest.mark.parametrize("action", list(ACTION_SPACES))
@pytest.mark.parametrize("obs", list(OBSERVATION_SPACES))
def test_every_space_trains_and_scores(obs, action):
    model = build(InfluencePPO, obs, action)
    expected_buffer = InfluenceDictRolloutBuffer if obs == "dict" else InfluenceRolloutBuffer
    assert type(model.rollout_buffer) is expected_buffer
    model.learn(64, callback=OnRollout(lambda m: m.rollout_buffer.keep.__setitem__((0, 0), False)))
    ghost = model.compute_influence()
    model.influence_engine.method = "jvp"
    jvp = model.compute_influence()
    assert ghost.shape == (32, 2) and np.isfinite(ghost).all() and np.abs(ghost).max() > 0
    np.testing.assert_allclose(ghost, jvp, rtol=1e-4, atol=1e-6 * np.abs(ghost).max())


def test_natural_cnn_policy_scores():
    env = SpaceEnv(spaces.Box(0, 255, (3, 36, 36), dtype=np.uint8), spaces.Discrete(2))
    model = InfluencePPO("CnnPolicy", env, n_steps=16, batch_size=8, n_epochs=1, seed=0, policy_kwargs=dict(net_arch=[]))
    collect_rollout(model)
    assert np.isfinite(model.compute_influence()).all()


def test_training_under_vec_check_nan():
    env = VecCheckNan(make_vec_env(lambda: make_env("box", "box"), n_envs=2, seed=0), raise_exception=True)
    model = InfluencePPO("MlpPolicy", env, n_steps=32, batch_size=16, n_epochs=1, seed=0)

    def zero_some_advantages(m):
        m.rollout_buffer.advantages[:4] = 0.0
        assert np.isfinite(m.compute_influence()).all()

    model.learn(64, callback=OnRollout(zero_some_advantages))


class TupleEnv(gym.Env):
    observation_space = spaces.Tuple((spaces.Discrete(2), spaces.Discrete(3)))
    action_space = spaces.Discrete(2)


class TupleActionEnv(gym.Env):
    observation_space = spaces.Box(-1, 1, (2,))
    action_space = spaces.Tuple((spaces.Discrete(2), spaces.Discrete(3)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(influence_batch_size=0), ValueError, "influence_batch_size"),
        (dict(influence_batch_size=2.5), TypeError, "influence_batch_size"),
        (dict(influence_method="exact"), ValueError, "influence_method"),
        (dict(rollout_buffer_class=RolloutBuffer), TypeError, "rollout_buffer_class"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        InfluencePPO("MlpPolicy", "CartPole-v1", **kwargs)


def test_unsupported_spaces_fail_at_construction():
    with pytest.raises(ValueError, match="observation space Tuple"):
        InfluencePPO("MlpPolicy", TupleEnv())
    with pytest.raises(ValueError, match="action space Tuple"):
        InfluencePPO("MlpPolicy", TupleActionEnv())
    nested = spaces.Dict({"inner": spaces.Dict({"x": spaces.Discrete(2)})})
    with pytest.raises(ValueError, match="under Dict key 'inner'"):
        InfluencePPO("MultiInputPolicy", SpaceEnv(nested, spaces.Discrete(2)))


def test_compute_influence_bad_inputs():
    model = build(InfluencePPO)
    with pytest.raises(RuntimeError, match="needs a full rollout buffer"):
        model.compute_influence()
    collect_rollout(model)
    with pytest.raises(ValueError, match="Unknown target 'value'"):
        model.compute_influence("value")
    with pytest.raises(TypeError, match="Target protocol"):
        model.compute_influence(42)
    with pytest.raises(ValueError, match="batch_size"):
        model.compute_influence(batch_size=0)
    obs = np.zeros((4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="`actions` must have shape"):
        model.compute_influence(ActionTarget(obs, np.zeros(3)))
    with pytest.raises(ValueError, match="`observations` must have shape"):
        model.compute_influence(ActionTarget(np.zeros((4, 5)), np.zeros(4)))
    # A single (observation, action) pair is fine
    assert np.isfinite(model.compute_influence(ActionTarget(obs[0], 1))).all()


def test_custom_target_protocol():
    class FirstRecords:
        name = "first"

        def terms(self, engine, batch_size):
            _, obs, actions, _ = next(engine.buffer_batches(4))
            yield engine.log_prob(obs, actions).mean()

    model = build(InfluencePPO)
    collect_rollout(model)
    buffer = model.rollout_buffer
    obs, actions = buffer.flat_field("observations")[:4], buffer.flat_field("actions")[:4].reshape(-1)
    np.testing.assert_allclose(
        model.compute_influence(FirstRecords()), model.compute_influence(ActionTarget(obs, actions)), rtol=1e-6
    )


def test_cache_is_shared_within_a_round_only():
    model = build(InfluencePPO)
    collect_rollout(model)
    first = model.compute_influence(cache=True)
    model.rollout_buffer.advantages[:] *= 2.0
    assert np.array_equal(model.compute_influence(cache=True), first)  # same round: cached
    assert not np.array_equal(model.compute_influence(), first)  # no cache: recomputed
    collect_rollout(model)
    assert not np.array_equal(model.compute_influence(cache=True), first)  # next rollout: recomputed


def test_bit_identical_with_subproc_vec_env():
    def build_subproc(cls):
        env = make_vec_env(lambda: make_env("box", "discrete"), n_envs=2, seed=3, vec_env_cls=SubprocVecEnv,
                           vec_env_kwargs=dict(start_method="fork"))  # fmt: skip
        return cls("MlpPolicy", env, n_steps=32, batch_size=16, n_epochs=2, seed=3, policy_kwargs=dict(net_arch=[8]))

    # Build and train one after the other: construction seeds numpy's global RNG, which the updates draw from
    ppo = build_subproc(PPO)
    try:
        ppo.learn(128)
        model = build_subproc(InfluencePPO)
        try:
            model.learn(128)
            assert params_equal(ppo, model)
        finally:
            model.env.close()
    finally:
        ppo.env.close()


def test_compute_influence_after_learn_scores_theta_k_and_keeps_training_bit_identical():
    """learn(); compute_influence(); learn(reset_num_timesteps=False) is PPO bit for bit, and the scores are θ(k)'s."""
    at_theta_k = []
    probe = build(InfluencePPO)
    probe.learn(64, callback=OnRollout(lambda m: at_theta_k.append(m.compute_influence())))
    ppo = build(PPO)
    ppo.learn(64)
    ppo.learn(64, reset_num_timesteps=False)
    model = build(InfluencePPO)
    model.learn(64)
    after = model.compute_influence()
    multi = model.compute_influence(checkpoints="multi")
    assert model.last_round is not None and model.last_round.index == 0
    model.learn(64, reset_num_timesteps=False)
    assert params_equal(ppo, model)
    # The parameters had moved: the scores are still those of θ(k), the round's starting point
    np.testing.assert_array_equal(after, at_theta_k[0])
    assert np.isfinite(multi).all() and not np.array_equal(multi, after)


def test_two_models_trained_alternately_keep_their_own_filters():
    from sb3_influence import IIFCallback

    a, b = build(InfluencePPO, seed=1), build(InfluencePPO, seed=1)
    iif_a, iif_b = IIFCallback(fraction=1.0, rule="bottom"), IIFCallback(fraction=0.25, rule="bottom")
    kept = {"a": [], "b": []}
    for _ in range(2):
        a.learn(64, callback=[iif_a, OnRollout(lambda m: None)], reset_num_timesteps=False)
        kept["a"].append(a.rollout_buffer.keep.mean())
        b.learn(64, callback=iif_b, reset_num_timesteps=False)
        kept["b"].append(b.rollout_buffer.keep.mean())
    assert kept["a"] == [0.0, 0.0]
    assert kept["b"] == [0.75, 0.75]
    # And a model trained with no callback after them is plain PPO: nothing of theirs leaks in
    c = build(InfluencePPO, seed=1)
    c.learn(64)
    assert c.rollout_buffer.keep.all()


def test_filter_of_a_learn_that_raised_does_not_act_later():
    from sb3_influence import IIFCallback

    class Boom(BaseCallback):
        def _on_step(self) -> bool:
            raise RuntimeError("boom")

    model = build(InfluencePPO)
    with pytest.raises(RuntimeError, match="boom"):
        model.learn(64, callback=[IIFCallback(fraction=1.0, rule="bottom"), Boom()])
    model.learn(64)
    assert model.rollout_buffer.keep.all()


def test_round_numbers_continue_across_learn_calls_and_save_load(tmp_path):
    model = build(InfluencePPO)
    model.learn(64)
    model.learn(64)  # reset_num_timesteps=True: num_timesteps restarts, rounds do not
    assert model.num_timesteps == 64 and model.n_rounds == 2 and model.last_round.index == 1
    model.save(tmp_path / "m.zip")
    loaded = InfluencePPO.load(tmp_path / "m.zip", env=model.get_env())
    assert loaded.n_rounds == 2
    loaded.learn(64)
    assert loaded.last_round.index == 2


def test_step_hook_reports_the_clip_mask_and_the_clip_coefficient():
    model = build(InfluencePPO, n_epochs=3, max_grad_norm=0.01, clip_range=0.05, learning_rate=0.05)
    collect_rollout(model)
    infos = []

    def check(info):
        # θ_j: the parameters have not moved yet, the gradient is the clipped one
        grads = [p.grad for p in model.policy.parameters() if p.grad is not None]
        norm = th.linalg.vector_norm(th.stack([th.linalg.vector_norm(g) for g in grads]))
        infos.append((info, float(norm)))

    model.update(step_hooks=[check])
    assert [info.step for info, _ in infos] == list(range(len(infos))) and len(infos) == 3 * 4
    for info, clipped_norm in infos:
        assert 0 < info.clip_coef <= 1
        # After clipping, the gradient norm is max_grad_norm whenever the coefficient is below one
        if info.clip_coef < 1:
            assert clipped_norm == pytest.approx(0.01, rel=1e-4)
        expected = ((info.advantages > 0) & (info.ratio > 1.05)) | ((info.advantages < 0) & (info.ratio < 0.95))
        assert th.equal(info.clipped, expected)
        assert len(info.record_ids) == len(info.advantages) == 16
    assert any(info.clipped.any() for info, _ in infos[4:])  # later epochs move far enough to clip
    assert infos[0][0].epoch == 0 and infos[-1][0].epoch == 2


def test_one_record_minibatch_after_filtering_joins_the_previous_one():
    model = build(InfluencePPO, n_envs=1, n_steps=64, batch_size=16)
    collect_rollout(model)
    model.rollout_buffer.keep[:15] = False  # 49 kept = 3 * 16 + 1
    sizes = []
    model.update(step_hooks=[lambda info: sizes.append(len(info.record_ids))])
    assert sizes == [16, 16, 17] * 2


def test_multi_checkpoint_on_a_fully_dropped_round_is_zero():
    model = build(InfluencePPO)
    collect_rollout(model)
    model.rollout_buffer.keep[...] = False
    np.testing.assert_array_equal(model.compute_influence(checkpoints="multi"), np.zeros((32, 2)))
