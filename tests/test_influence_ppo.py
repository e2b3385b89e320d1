"""InfluencePPO as a drop-in PPO: equivalence, the keep mask, save/load, spaces and bad inputs."""

import json
import zipfile

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from conftest import ACTION_SPACES, OBSERVATION_SPACES, SpaceEnv, collect_rollout, make_env, params_equal, policy_for
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecCheckNan

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
