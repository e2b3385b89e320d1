"""The three applications: diagnosis, behaviour formation, intervention (sb3_influence.analysis)."""

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3.common.callbacks import BaseCallback

from sb3_influence import ActionTarget, InfluencePPO
from sb3_influence.common import sb3_compat
from sb3_influence.common.snapshots import save_snapshot
from sb3_influence.analysis import (
    DiagnosisCallback,
    InterventionCallback,
    advantage_correlation,
    behaviour_formation,
    drop_mask,
    graph_roughness,
    intervene,
    monte_carlo_advantages,
    monte_carlo_returns,
    plot_phases,
    state_embeddings,
    tabular_true_advantages,
    target_value,
    top_bottom_records,
)


def frozen_lake() -> gym.Env:
    return gym.make("FrozenLake-v1", map_name="4x4", is_slippery=False)


def record_snapshot(model: InfluencePPO, targets: dict) -> dict[str, np.ndarray]:
    """A snapshot of the current round in the documented format (what AttributionCallback writes)."""
    buffer = model.rollout_buffer
    arrays = {f"influence/{name}": model.compute_influence(target) for name, target in targets.items()}
    arrays["obs"] = buffer.to_records(np.asarray(buffer.flat_field("observations")))
    arrays["action"] = buffer.to_records(np.asarray(buffer.flat_field("actions")))
    for name, field in (("reward", "rewards"), ("advantage", "advantages"), ("return", "returns"), ("value", "values")):
        arrays[name] = buffer.to_records(np.asarray(buffer.flat_field(field)).reshape(-1))
    arrays["episode_start"] = buffer.to_records(buffer.flat_field("episode_starts").reshape(-1)).astype(bool)
    arrays["training_advantage"] = model.training_advantages()
    arrays["keep"] = buffer.keep.copy()
    steps, envs = np.indices(buffer.keep.shape)
    arrays["step"], arrays["env"] = steps, envs
    arrays["round"] = np.array(model.num_timesteps // (model.n_steps * model.n_envs) - 1)
    arrays["num_timesteps"] = np.array(model.num_timesteps)
    return arrays


class SnapshotRecorder(BaseCallback):
    def __init__(self, targets: dict):
        super().__init__()
        self.targets = targets
        self.snapshots: list[dict[str, np.ndarray]] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self.snapshots.append(record_snapshot(self.model, self.targets))


@pytest.fixture(scope="module")
def cartpole_snapshots():
    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=1, policy_kwargs=dict(net_arch=[16])
    )
    recorder = SnapshotRecorder({"return": "return"})
    model.learn(64 * 3, callback=recorder)
    return recorder.snapshots


# ------------------------------------------------------------------ diagnosis
def test_top_bottom_records(cartpole_snapshots):
    arrays = cartpole_snapshots[-1]
    scores = arrays["influence/return"]
    table = top_bottom_records(arrays, k=5)
    top, bottom = table[table.group == "top"], table[table.group == "bottom"]
    assert len(top) == len(bottom) == 5
    expected_top = np.sort(scores.reshape(-1))[::-1][:5]
    np.testing.assert_array_equal(top.influence.to_numpy(), expected_top)
    np.testing.assert_array_equal(bottom.influence.to_numpy(), np.sort(scores.reshape(-1))[:5])
    for row in table.itertuples():
        assert scores[row.step, row.env] == row.influence
        assert row.advantage == arrays["advantage"][row.step, row.env]
        assert row.training_advantage == arrays["training_advantage"][row.step, row.env]
        assert row.record_id == row.env * scores.shape[0] + row.step
        np.testing.assert_array_equal(row.obs, arrays["obs"][row.step, row.env])


def test_top_bottom_records_bad_input(cartpole_snapshots):
    with pytest.raises(ValueError, match="k must be"):
        top_bottom_records(cartpole_snapshots[0], k=0)
    with pytest.raises(ValueError, match="not in this snapshot"):
        top_bottom_records(cartpole_snapshots[0], target="nope")
    with pytest.raises(TypeError, match="snapshot must be"):
        top_bottom_records(42)


def _iterative_policy_evaluation(table, pi, gamma, n_iter=2000):
    n_states, n_actions = pi.shape
    v = np.zeros(n_states)
    for _ in range(n_iter):
        q = np.zeros((n_states, n_actions))
        for s in range(n_states):
            for a in range(n_actions):
                q[s, a] = sum(p * (r + gamma * v[s2] * (not done)) for p, s2, r, done in table[s][a])
        v = (pi * q).sum(1)
    return v, q


@pytest.mark.parametrize("slippery", [False, True])
def test_tabular_true_advantages_match_iterative_evaluation(slippery):
    env = gym.make("FrozenLake-v1", map_name="4x4", is_slippery=slippery)
    model = InfluencePPO("MlpPolicy", env, n_steps=32, batch_size=32, seed=0, gamma=0.9, policy_kwargs=dict(net_arch=[8]))
    values = tabular_true_advantages(model)
    np.testing.assert_allclose(values.policy.sum(1), 1.0, rtol=1e-6)
    v, q = _iterative_policy_evaluation(env.unwrapped.P, values.policy, 0.9)
    np.testing.assert_allclose(values.v, v, atol=1e-10)
    np.testing.assert_allclose(values.q, q, atol=1e-10)
    # Advantages average to zero under the policy; terminal states have no value
    np.testing.assert_allclose((values.policy * values.advantage).sum(1), 0.0, atol=1e-12)
    assert values.v[15] == 0.0 and values.v[5] == 0.0
    if not slippery:
        assert values.q[14, 2] == pytest.approx(1.0)  # right of state 14 reaches the goal


def test_tabular_true_advantages_bad_input():
    model = InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, seed=0)
    with pytest.raises(ValueError, match="transition table"):
        tabular_true_advantages(model)
    lake = InfluencePPO("MlpPolicy", frozen_lake(), n_steps=32, batch_size=32, seed=0)
    with pytest.raises(ValueError, match="gamma"):
        tabular_true_advantages(lake, gamma=1.0)


def test_advantage_correlation():
    rng = np.random.default_rng(0)
    true, estimated = rng.normal(size=50), rng.normal(size=50)
    rho, p_value = advantage_correlation(-((true * estimated) ** 3), true, estimated)
    assert rho == pytest.approx(-1.0) and p_value < 1e-6
    rho, _ = advantage_correlation(rng.normal(size=50), true, estimated)
    assert -0.5 < rho < 0.5
    assert np.isnan(advantage_correlation(np.ones(50), true, estimated)[0])
    with pytest.raises(ValueError, match="same records"):
        advantage_correlation(np.ones(3), true, estimated)


def test_diagnosis_callback_on_frozen_lake():
    env = frozen_lake()
    model = InfluencePPO("MlpPolicy", env, n_steps=128, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[16]))
    callback = DiagnosisCallback(rounds=[1, 2], estimated="advantage")
    model.learn(128 * 3, callback=callback)
    assert [r["round"] for r in callback.results] == [1, 2]
    result = callback.results[-1]
    assert result["influence"].shape == (128, 1)
    # The recorded true advantages are the exact ones of the policy at θ(k) of the diagnosed states/actions
    assert set(np.unique(result["state"])) <= set(range(16))
    assert np.isfinite(result["spearman"])
    rho, _ = advantage_correlation(result["influence"], result["true_advantage"], result["estimated_advantage"])
    assert rho == result["spearman"]
    with pytest.raises(ValueError, match="rounds"):
        DiagnosisCallback(rounds=[-1])
    with pytest.raises(ValueError, match="estimated"):
        DiagnosisCallback(estimated="wrong")


def test_diagnose_uses_policy_at_round_start():
    """The true advantages are those of θ(k): recompute them in a callback that runs before the diagnosis."""
    from sb3_influence.analysis import diagnose_tabular

    class Check(BaseCallback):
        def _on_step(self):
            return True

        def _on_rollout_end(self):
            values = tabular_true_advantages(self.model)
            result = diagnose_tabular(self.model)
            np.testing.assert_array_equal(result["true_advantage"], values.advantage[result["state"], result["action"]])
            np.testing.assert_array_equal(
                result["estimated_advantage"],
                self.model.rollout_buffer.to_records(self.model.rollout_buffer.flat_field("advantages")),
            )
            self.calls = getattr(self, "calls", 0) + 1

    check = Check()
    model = InfluencePPO(
        "MlpPolicy", frozen_lake(), n_steps=64, batch_size=32, n_epochs=1, seed=2, policy_kwargs=dict(net_arch=[8])
    )
    model.learn(128, callback=check)
    assert check.calls == 2


def test_monte_carlo_advantages_hand_computed():
    """Two episodes in one env, gamma 0.5: every number below is worked out by hand."""
    # Episode 1: (s0, a0, r=0) -> (s1, a1, r=1) -> done.  Episode 2: (s0, a1, r=0) -> (s1, a1, r=0), cut by the buffer.
    states = np.array([0, 1, 0, 1]).reshape(4, 1, 1)
    actions = np.array([0, 1, 1, 1]).reshape(4, 1)
    rewards = np.array([0.0, 1.0, 0.0, 0.0]).reshape(4, 1)
    starts = np.array([True, False, True, False]).reshape(4, 1)
    returns = monte_carlo_returns(rewards, starts, 0.5)
    np.testing.assert_array_equal(returns[:, 0], [0.5, 1.0, 0.0, 0.0])
    advantage = monte_carlo_advantages(states, actions, rewards, starts, 0.5)
    # V(s0) = (0.5 + 0)/2, Q(s0,a0) = 0.5, Q(s0,a1) = 0; V(s1) = Q(s1,a1) = (1 + 0)/2
    np.testing.assert_array_equal(advantage[:, 0], [0.25, 0.0, -0.25, 0.0])


def test_monte_carlo_advantages_match_a_loop_over_visits():
    """Several envs, repeated states: Ā equals an explicit every-visit average written with Python loops."""
    rng = np.random.default_rng(3)
    n_steps, n_envs, gamma = 40, 3, 0.9
    states = rng.integers(0, 4, size=(n_steps, n_envs, 2)).astype(np.float32)
    actions = rng.integers(0, 2, size=(n_steps, n_envs))
    rewards = rng.normal(size=(n_steps, n_envs))
    starts = rng.random((n_steps, n_envs)) < 0.2
    advantage = monte_carlo_advantages(states, actions, rewards, starts, gamma)
    returns = {}
    for env in range(n_envs):
        g = 0.0
        for step in reversed(range(n_steps)):
            ends = step + 1 == n_steps or starts[step + 1, env]
            g = rewards[step, env] + (0.0 if ends else gamma * g)
            returns[step, env] = g
    for (step, env), _ in returns.items():
        key = tuple(states[step, env])
        same_state = [returns[i] for i in returns if tuple(states[i]) == key]
        same_pair = [returns[i] for i in returns if tuple(states[i]) == key and actions[i] == actions[step, env]]
        assert advantage[step, env] == pytest.approx(np.mean(same_pair) - np.mean(same_state), abs=1e-12)


def test_monte_carlo_advantages_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        monte_carlo_returns(np.zeros((4, 1)), np.zeros((3, 1)), 0.9)
    with pytest.raises(ValueError, match="gamma"):
        monte_carlo_returns(np.zeros(4), np.zeros(4), 1.5)
    with pytest.raises(ValueError, match="actions must start"):
        monte_carlo_advantages(np.zeros((4, 1, 1)), np.zeros((3, 1)), np.zeros((4, 1)), np.zeros((4, 1)), 0.9)
    with pytest.raises(ValueError, match="true_advantage"):
        DiagnosisCallback(true_advantage="mc")


def test_diagnosis_with_monte_carlo_advantage():
    """The in-buffer estimate is computed from the round's own records, and needs no transition table."""
    from sb3_influence.analysis import diagnose_tabular

    class Check(BaseCallback):
        def _on_step(self):
            return True

        def _on_rollout_end(self):
            buffer = self.model.rollout_buffer
            result = diagnose_tabular(self.model, true_advantage="monte_carlo")
            expected = monte_carlo_advantages(
                buffer.observations, buffer.actions, buffer.rewards, buffer.episode_starts, self.model.gamma
            )
            np.testing.assert_array_equal(result["true_advantage"], expected)
            assert result["true_advantage_kind"] == "monte_carlo"
            # A round that reached the goal gives a non-trivial estimate (repeated states, different actions)
            rewarded = buffer.rewards.sum() > 0
            assert (np.ptp(result["true_advantage"]) > 0) == rewarded
            self.rewarded = getattr(self, "rewarded", 0) + int(rewarded)
            self.calls = getattr(self, "calls", 0) + 1

    check = Check()
    model = InfluencePPO(
        "MlpPolicy", frozen_lake(), n_steps=256, batch_size=64, n_epochs=1, seed=0, policy_kwargs=dict(net_arch=[8])
    )
    model.learn(512, callback=check)
    assert check.calls == 2 and check.rewarded >= 1


# ------------------------------------------------------------------ behaviour formation
def test_graph_roughness_known_values():
    embeddings = np.array([[0.0], [1.0]])
    # Two positive records, one edge: (1 - 0.5)² = 0.25 whatever the weight
    assert graph_roughness(np.array([2.0, 1.0]), embeddings) == pytest.approx(0.25)
    # Constant scores: 0
    rng = np.random.default_rng(0)
    points = rng.normal(size=(60, 2))
    assert graph_roughness(np.full(60, 3.0), points) == 0.0
    # Negative records are left out
    assert graph_roughness(np.array([2.0, 1.0, -5.0]), np.array([[0.0], [1.0], [0.5]])) == pytest.approx(0.25)
    assert graph_roughness(np.array([2.0, 1.0, -5.0]), np.array([[0.0], [1.0], [0.5]]), positive_only=False) > 0.25
    # Hand computation with three records, sigma 1, every pair connected
    scores, points3 = np.array([1.0, 0.5, 0.25]), np.array([[0.0], [1.0], [3.0]])
    w = {(0, 1): np.exp(-1.0), (0, 2): np.exp(-9.0), (1, 2): np.exp(-4.0)}
    expected = sum(wij * (scores[i] - scores[j]) ** 2 for (i, j), wij in w.items()) / sum(w.values())
    assert graph_roughness(scores, points3, sigma=1.0) == pytest.approx(expected)
    # Only nearest neighbours: with u=1, the 0-2 pair (far apart) is no edge
    w.pop((0, 2))
    expected = sum(wij * (scores[i] - scores[j]) ** 2 for (i, j), wij in w.items()) / sum(w.values())
    assert graph_roughness(scores, points3, sigma=1.0, n_neighbors=1) == pytest.approx(expected)


def test_graph_roughness_smooth_beats_random():
    rng = np.random.default_rng(1)
    points = rng.uniform(size=(200, 2))
    smooth = 1.0 + points[:, 0] + points[:, 1]
    shuffled = rng.permutation(smooth)
    assert graph_roughness(smooth, points) < 0.2 * graph_roughness(shuffled, points)
    assert np.isnan(graph_roughness(-np.ones(5), rng.normal(size=(5, 2))))
    with pytest.raises(ValueError, match="embeddings"):
        graph_roughness(np.ones(3), np.ones((4, 2)))
    with pytest.raises(ValueError, match="n_neighbors"):
        graph_roughness(np.ones(3), np.ones((3, 2)), n_neighbors=0)


def test_state_embeddings():
    model = InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, seed=0, policy_kwargs=dict(net_arch=[7, 5]))
    obs = np.stack([model.observation_space.sample() for _ in range(4)])
    latent = state_embeddings(model, obs)
    assert latent.shape == (4, 5)
    with th.no_grad():
        expected = model.policy.mlp_extractor.forward_actor(th.as_tensor(obs))
    np.testing.assert_allclose(latent, expected.numpy(), rtol=1e-6)
    np.testing.assert_allclose(state_embeddings(model, obs, kind="obs"), obs, rtol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        state_embeddings(model, obs, kind="bad")


def test_behaviour_formation_rounds(tmp_path):
    env = frozen_lake()
    # The behaviour "go right in the start state"
    target = ActionTarget(np.array([0]), np.array([2]), name="right_at_start")
    model = InfluencePPO("MlpPolicy", env, n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[8]))
    recorder = SnapshotRecorder({"right_at_start": target})
    model.learn(64 * 3, callback=recorder)
    for i, arrays in enumerate(recorder.snapshots):
        save_snapshot(str(tmp_path / f"snapshot_{int(arrays['num_timesteps'])}_steps.npz"), arrays, {})
        assert i == int(arrays["round"])

    def coordinates(obs):
        return np.stack([obs[:, 0] // 4, obs[:, 0] % 4], axis=1)

    formation = behaviour_formation(tmp_path, target="right_at_start", embed=coordinates, n_neighbors=5)
    assert list(formation["round"]) == [0, 1, 2]
    last = recorder.snapshots[-1]
    scores = last["influence/right_at_start"].reshape(-1)
    assert formation["scale"].iloc[-1] == np.abs(scores).max()
    assert formation["positive_fraction"].iloc[-1] == (scores > 0).mean()
    expected = graph_roughness(scores, coordinates(last["obs"].reshape(-1, 1).astype(float)), n_neighbors=5)
    assert formation["roughness"].iloc[-1] == pytest.approx(expected, nan_ok=True)
    with pytest.raises(ValueError, match="not in this snapshot"):
        behaviour_formation(tmp_path, target="return")
    pytest.importorskip("matplotlib", reason="the plot: install the analysis extra, pip install -e '.[analysis]'")
    figure = plot_phases(formation, title="right at start")
    assert len(figure.axes) == 3
    with pytest.raises(ValueError, match="lacks the columns"):
        plot_phases(formation.drop(columns=["roughness"]))


def test_behaviour_formation_action_association():
    # Two envs of 6 steps; influence = advantage signed by "took action 1": action_association is exactly 1
    rng = np.random.default_rng(0)
    advantage = rng.normal(size=(6, 2))
    action = rng.integers(0, 3, size=(6, 2))
    scores = np.where(action == 1, advantage, -advantage)
    arrays = {
        "influence/behaviour": scores,
        "training_advantage": advantage,
        "action": action,
        "obs": rng.normal(size=(6, 2, 3)),
        "round": np.array(0),
        "num_timesteps": np.array(12),
    }
    formation = behaviour_formation([arrays], target="behaviour", action=1, n_neighbors=3)
    assert formation["action_association"].iloc[0] == pytest.approx(1.0)
    assert formation["association"].iloc[0] < 0.99
    # Another action: the signed advantage is wrong for every record of actions 1 and 2
    assert behaviour_formation([arrays], target="behaviour", action=0)["action_association"].iloc[0] < 0.99
    assert "action_association" not in behaviour_formation([arrays], target="behaviour").columns
    with pytest.raises(TypeError, match="action must be"):
        behaviour_formation([arrays], target="behaviour", action=1.0)
    with pytest.raises(ValueError, match="needs Discrete actions"):
        behaviour_formation([{**arrays, "action": rng.normal(size=(6, 2, 2))}], target="behaviour", action=1)


# ------------------------------------------------------------------ intervention
def test_drop_mask():
    scores = np.array([[-3.0, 1.0], [-1.0, 2.0], [0.5, -0.2], [4.0, 0.1], [0.3, 0.2]])
    assert drop_mask(scores, "negatives").sum() == 3
    np.testing.assert_array_equal(drop_mask(scores, "negatives"), scores < 0)
    bottom = drop_mask(scores, "bottom", fraction=0.2)
    assert set(scores[bottom]) == {-3.0, -1.0}
    assert set(scores[drop_mask(scores, "top", fraction=0.2)]) == {4.0, 2.0}
    assert drop_mask(scores, "random", rng=np.random.default_rng(1)).sum() == 3
    assert drop_mask(scores, "random_negatives", fraction=0.3).sum() == 3
    with pytest.raises(ValueError, match="arm must be"):
        drop_mask(scores, "worst")
    with pytest.raises(ValueError, match="fraction"):
        drop_mask(scores, "top", fraction=1.5)


def _make_cartpole(seed=3):
    return InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=128, batch_size=32, n_epochs=2, seed=seed, policy_kwargs=dict(net_arch=[16])
    )


def test_intervention_leaves_the_model_unchanged():
    callback = InterventionCallback(rounds=[1], eval_env=gym.make("CartPole-v1"), n_eval_episodes=2, fraction=0.1)
    with_intervention = _make_cartpole().learn(128 * 3, callback=callback)
    plain = _make_cartpole().learn(128 * 3)
    for (name, a), b in zip(with_intervention.policy.state_dict().items(), plain.policy.state_dict().values(), strict=True):
        assert th.equal(a, b), name
    opt_a, opt_b = with_intervention.policy.optimizer.state_dict(), plain.policy.optimizer.state_dict()
    for key in opt_a["state"]:
        for field, value in opt_a["state"][key].items():
            assert th.equal(th.as_tensor(value), th.as_tensor(opt_b["state"][key][field]))
    assert sb3_compat.n_updates(with_intervention) == sb3_compat.n_updates(plain)
    assert len(callback.results) == 1
    table = callback.results[0]
    assert list(table["arm"]) == ["none", "negatives", "random", "bottom", "top"]
    assert table["round"].iloc[0] == 1
    assert table.loc[0, "delta_target"] == 0.0 and table.loc[0, "n_dropped"] == 0
    assert table.set_index("arm").loc["negatives", "n_dropped"] == table.set_index("arm").loc["random", "n_dropped"]
    assert table.set_index("arm").loc["bottom", "n_dropped"] == int(0.1 * 128)
    assert np.isfinite(table["test_return"]).all()


def test_intervene_measures_the_retrained_target():
    """Retraining on every record reproduces the real update; dropping the top records helps the target less."""
    seen = {}

    class Probe(BaseCallback):
        def _on_step(self):
            return True

        def _on_rollout_end(self):
            if self.model.num_timesteps == 384:  # the last round
                seen["table"] = intervene(self.model, arms=["bottom", "top"], fraction=0.1)

    model = _make_cartpole(seed=4)
    model.learn(128 * 3, callback=Probe())
    seen["after"] = target_value(model)  # θ(k+1) of the real update, on the same buffer
    table = seen["table"].set_index("arm")
    assert table.loc["none", "target_after"] == pytest.approx(seen["after"], rel=1e-6)
    assert table.loc["bottom", "target_after"] > table.loc["top", "target_after"]
    assert np.isnan(table["test_return"]).all()  # no eval_env given


def test_intervene_evaluator_sees_the_start_and_every_retrain():
    """An evaluator that returns the target shows where it is called: at θ(k), then after each arm's retrain."""
    seen = {}

    class Probe(BaseCallback):
        def _on_step(self):
            return True

        def _on_rollout_end(self):
            if self.model.num_timesteps == 256:
                seen["table"] = intervene(self.model, arms=["negatives", "random"], evaluator=target_value)
                with pytest.raises(ValueError, match="not both"):
                    intervene(self.model, evaluator=target_value, eval_env=gym.make("CartPole-v1"))
                with pytest.raises(TypeError, match="evaluator"):
                    intervene(self.model, evaluator=1.0)

    _make_cartpole(seed=1).learn(128 * 2, callback=Probe())
    table = seen["table"]
    np.testing.assert_array_equal(table["test_return_start"], table["target_before"])
    np.testing.assert_array_equal(table["test_return"], table["target_after"])
    assert table.loc[0, "test_return"] != table.loc[0, "test_return_start"]  # the update moved the parameters


def test_intervene_custom_arm_and_bad_input():
    model = _make_cartpole()
    with pytest.raises(RuntimeError, match="full rollout buffer"):
        intervene(model)
    results = {}

    class Custom(BaseCallback):
        def _on_step(self):
            return True

        def _on_rollout_end(self):
            keep = self.model.rollout_buffer.keep
            first_half = np.zeros(keep.shape, dtype=bool)
            first_half[:64] = True
            results["table"] = intervene(self.model, arms={"first_half": first_half})
            for bad, error in (
                ("negatives", TypeError),
                ({"x": np.zeros(3, dtype=bool)}, ValueError),
                ({"none": first_half}, ValueError),
            ):
                with pytest.raises(error):
                    intervene(self.model, arms=bad)
            with pytest.raises(ValueError, match="n_eval_episodes"):
                intervene(self.model, n_eval_episodes=0)

    model.learn(128, callback=Custom())
    table = results["table"]
    assert list(table["arm"]) == ["none", "first_half"] and table.loc[1, "n_dropped"] == 64


def test_snapshot_diagnosis_equals_the_live_diagnosis_with_two_envs(tmp_path):
    """From the snapshot alone, the same Ā and correlation as the live diagnosis (record order checked, n_envs=2)."""
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_influence import AttributionCallback, load_snapshot
    from sb3_influence.analysis import snapshot_diagnosis

    env = make_vec_env("FrozenLake-v1", n_envs=2, seed=0, env_kwargs=dict(is_slippery=False))
    model = InfluencePPO("MlpPolicy", env, n_steps=256, batch_size=64, n_epochs=1, seed=0, policy_kwargs=dict(net_arch=[8]))
    live = DiagnosisCallback(true_advantage="monte_carlo")
    model.learn(512 * 2, callback=[live, AttributionCallback(save_dir=str(tmp_path))])
    snapshots = sorted((load_snapshot(str(p)) for p in tmp_path.glob("*.npz")), key=lambda s: s.round)
    compared = 0
    for result, snapshot in zip(live.results, snapshots, strict=True):
        offline = snapshot_diagnosis(snapshot)
        assert offline["round"] == result["round"]
        if np.isfinite(result["spearman"]):
            assert offline["spearman"] == pytest.approx(result["spearman"], abs=1e-12)
            compared += 1
        flips = result["true_advantage"] * result["estimated_advantage"] < 0
        assert offline["sign_flips"] == pytest.approx(flips.mean())
        assert 0.0 < offline["revisited"] <= 1.0
    assert compared >= 1
    with pytest.raises(ValueError, match="gamma"):
        snapshot_diagnosis({key: value for key, value in snapshots[0].arrays.items() if key != "metadata"})


def test_snapshot_diagnosis_sign_flips_of_a_hand_built_two_env_round(tmp_path):
    """
    sign_flips_bottom by hand, n_envs = 2: the two most harmful records are in env 1, at record ids 1 · 20 + 3 = 23
    and 1 · 20 + 7 = 27 (env-major), and only they flip; read step-major, ids 23 and 27 would be other records.
    """
    from sb3_influence.analysis import snapshot_diagnosis

    n_steps, n_envs = 20, 2
    steps, envs = np.indices((n_steps, n_envs))
    obs = (steps * n_envs + envs).astype(np.float32)[..., None]  # every state seen once (Ā = 0)...
    action = np.zeros((n_steps, n_envs), dtype=np.int64)
    reward = np.zeros((n_steps, n_envs), dtype=np.float32)
    advantage = np.full((n_steps, n_envs), 0.5, dtype=np.float32)
    influence = 1.0 + np.arange(n_steps * n_envs, dtype=np.float64).reshape(n_steps, n_envs)
    # ...but state 100, taken at steps 3 and 7 of both envs. gamma = 0: the return-to-go is the reward, so
    # Q̄(100, 0) = 1, Q̄(100, 1) = 0, V̄(100) = 0.5: Ā = +0.5 for action 0, -0.5 for action 1
    for (step, env), (a, a_hat, score) in {
        (3, 0): (0, 1.0, 5.0),  # Ā·Â = +0.5
        (7, 0): (1, -1.0, 6.0),  # Ā·Â = +0.5
        (3, 1): (1, 1.0, -2.0),  # Ā·Â = -0.5: a flip, the most harmful record
        (7, 1): (0, -2.0, -1.0),  # Ā·Â = -1.0: a flip, the second most harmful
    }.items():
        obs[step, env], action[step, env], advantage[step, env], influence[step, env] = 100.0, a, a_hat, score
        reward[step, env] = float(a == 0)
    arrays = {
        "obs": obs,
        "action": action,
        "reward": reward,
        "episode_start": np.zeros((n_steps, n_envs), dtype=bool),
        "advantage": advantage,
        "influence/return": influence,
        "keep": np.ones((n_steps, n_envs), dtype=bool),
        "round": np.array(4),
    }
    path = save_snapshot(str(tmp_path / "snapshot_round000004_40_steps.npz"), arrays, {"config": {"gamma": 0.0}})
    for snapshot, gamma in ((path, None), (arrays, 0.0)):
        result = snapshot_diagnosis(snapshot, gamma=gamma)
        assert result["round"] == 4
        assert result["sign_flips_bottom"] == 1.0  # the 5 % most harmful: 2 records of 40, both flips
        assert result["sign_flips"] == pytest.approx(2 / 40)
        assert result["revisited"] == pytest.approx(4 / 40)  # state 100 is taken with two actions
