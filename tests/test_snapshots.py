"""Attribution snapshots: round trip through load_snapshots / load_snapshot, atomic writes, loading errors."""

import json
import os

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import AttributionCallback, IIFCallback, InfluencePPO, load_snapshot, load_snapshots
from sb3_influence.common import snapshots
from sb3_influence.common.callbacks import RoundCallback
from sb3_influence.common.snapshots.records import jsonable

TINY = dict(n_steps=32, batch_size=16, n_epochs=1, policy_kwargs=dict(net_arch=[8]))


class BufferCopy(RoundCallback):
    """Copies, after the other callbacks, what the buffer holds at the end of each rollout."""

    def __init__(self, attribution: AttributionCallback):
        super().__init__()
        self.attribution = attribution
        self.rounds: list[dict[str, np.ndarray]] = []

    def on_round(self, round_) -> None:
        buffer = self.model.rollout_buffer
        self.rounds.append(
            {
                "influence": self.attribution.scores["return"].copy(),
                "reward": buffer.rewards.copy(),
                "advantage": buffer.to_records(buffer.flat_field("advantages")),
                "obs": buffer.to_records(buffer.flat_field("observations")),
                "action": buffer.to_records(buffer.flat_field("actions")),
                "keep": buffer.keep.copy(),
                "training_advantage": self.model.training_advantages(),
            }
        )


def test_round_trip_through_load_snapshots(tmp_path):
    env = make_vec_env("CartPole-v1", n_envs=2, seed=0)
    model = InfluencePPO("MlpPolicy", env, seed=0, **TINY)
    attribution = AttributionCallback(save_dir=str(tmp_path))
    copy = BufferCopy(attribution)
    model.learn(3 * 64, callback=[IIFCallback(fraction=0.5), attribution, copy])

    frame = load_snapshots(str(tmp_path))
    n_steps, n_envs = 32, 2
    assert len(frame) == 3 * n_steps * n_envs
    expected_columns = [
        "round", "num_timesteps", "env", "step", "record_id", "trajectory_id", "reward", "advantage", "training_advantage",
        "return", "value", "log_prob", "episode_start", "keep", "influence_return", "action", "obs",
    ]  # fmt: skip
    assert list(frame.columns) == expected_columns
    assert list(frame["num_timesteps"].unique()) == [64, 128, 192]
    assert list(frame["round"].unique()) == [0, 1, 2]
    for round_, saved in enumerate(copy.rounds):
        rows = frame[frame["round"] == round_]
        np.testing.assert_array_equal(rows["record_id"], np.arange(n_steps * n_envs))
        np.testing.assert_array_equal(rows["record_id"], rows["env"] * n_steps + rows["step"])
        for name in ("influence", "reward", "advantage", "keep", "training_advantage"):
            column = "influence_return" if name == "influence" else name
            np.testing.assert_array_equal(rows[column].to_numpy(), saved[name].swapaxes(0, 1).ravel(), err_msg=name)
        np.testing.assert_array_equal(rows["action"].to_numpy(), saved["action"].swapaxes(0, 1).ravel().astype(np.int64))
        np.testing.assert_array_equal(np.stack(rows["obs"].to_list()), saved["obs"].swapaxes(0, 1).reshape(-1, 4))
        assert not rows["keep"].all()

    snapshot = load_snapshot(str(tmp_path / "snapshot_round000002_192_steps.npz"))
    assert snapshot.targets == ["return"] and snapshot.num_timesteps == 192
    np.testing.assert_array_equal(snapshot.arrays["influence/return"], copy.rounds[-1]["influence"])
    assert snapshot.arrays["obs"].shape == (n_steps, n_envs, 4)
    assert snapshot.arrays["keep"].dtype == bool
    metadata = snapshot.metadata
    assert metadata["seed"] == 0 and metadata["env_id"] == "CartPole-v1" and metadata["targets"] == ["return"]
    assert metadata["config"]["n_steps"] == n_steps and metadata["config"]["batch_size"] == 16
    assert metadata["versions"]["stable_baselines3"]
    assert metadata["vec_normalize"] is None
    assert frame.attrs["metadata"][0]["config"]["algo"] == "InfluencePPO"
    # A single file loads too
    assert len(load_snapshots(str(tmp_path / "snapshot_round000000_64_steps.npz"))) == n_steps * n_envs


class DictEnv(gym.Env):
    observation_space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "flag": spaces.Discrete(3)})
    action_space = spaces.Box(-1, 1, (2,))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        self._t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self._t += 1
        return self.observation_space.sample(), float(-np.abs(action).sum()), self._t >= 10, False, {}


def test_dict_observations_and_box_actions(tmp_path):
    model = InfluencePPO("MultiInputPolicy", DictEnv(), seed=0, **TINY)
    model.learn(32, callback=AttributionCallback(save_dir=str(tmp_path)))
    frame = load_snapshots(str(tmp_path))
    assert {"obs/pos", "obs/flag"} <= set(frame.columns) and "obs" not in frame.columns
    assert np.stack(frame["obs/pos"].to_list()).shape == (32, 2)
    assert np.stack(frame["action"].to_list()).shape == (32, 2)
    assert np.isfinite(frame["influence_return"]).all()


def test_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "snapshot_10_steps.npz")
    arrays = {"keep": np.ones((2, 1), dtype=bool), "round": np.array(0), "num_timesteps": np.array(10)}
    snapshots.save_snapshot(path, arrays, {"a": 1})
    before = open(path, "rb").read()

    def crash(file, **payload):
        file.write(b"partial garbage")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(np, "savez_compressed", crash)
    with pytest.raises(KeyboardInterrupt):
        snapshots.save_snapshot(path, {**arrays, "round": np.array(1)}, {"a": 2})
    # The previous file is intact and no temporary file is left behind
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["snapshot_10_steps.npz"]
    assert load_snapshot(path).metadata == {"a": 1}


def test_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No snapshot file or folder"):
        load_snapshots(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"No snapshot \(\*\.npz\)"):
        load_snapshots(str(tmp_path))
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an attribution snapshot"):
        load_snapshot(str(tmp_path / "other.npz"))
    with pytest.raises(ValueError, match="metadata"):
        snapshots.save_snapshot(str(tmp_path / "x.npz"), {"metadata": np.zeros(1)}, {})


def test_metadata_is_plain_json(tmp_path):
    # Schedules, classes and numpy values end up as JSON, never as pickles
    metadata = jsonable({"f": np.float32(0.5), "cls": InfluencePPO, "arr": np.arange(3), "t": (1, 2)})
    assert json.loads(json.dumps(metadata)) == {
        "f": 0.5,
        "cls": "sb3_influence.influence_ppo.influence_ppo.InfluencePPO",
        "arr": [0, 1, 2],
        "t": [1, 2],
    }


def test_one_reader_for_paths_snapshots_and_dicts(tmp_path):
    model = InfluencePPO("MlpPolicy", "CartPole-v1", seed=0, **TINY)
    model.learn(32, callback=AttributionCallback(save_dir=str(tmp_path)))
    path = str(tmp_path / "snapshot_round000000_32_steps.npz")
    loaded = load_snapshot(path)
    for given in (path, loaded, dict(loaded.arrays)):
        snapshot = snapshots.as_snapshot(given)
        assert snapshot.metadata == loaded.metadata and snapshot.metadata["seed"] == 0
        np.testing.assert_array_equal(snapshot.scores(), loaded.scores("return"))
    with pytest.raises(TypeError, match="snapshot must be"):
        snapshots.as_snapshot(3)


def test_old_file_names_load_and_order_comes_from_the_stored_round(tmp_path):
    model = InfluencePPO("MlpPolicy", "CartPole-v1", seed=0, **TINY)
    model.learn(3 * 32, callback=AttributionCallback(save_dir=str(tmp_path / "new")))
    (tmp_path / "old").mkdir()
    for snapshot in snapshots.load_all(str(tmp_path / "new")):
        # The earlier naming scheme, <prefix>_<num_timesteps>_steps.npz: "100" sorts before "32" by name
        name = f"snapshot_{snapshot.num_timesteps + (1000 if snapshot.round == 0 else 0)}_steps.npz"
        os.replace(snapshot.path, tmp_path / "old" / name)
    assert [s.round for s in snapshots.load_all(str(tmp_path / "old"))] == [0, 1, 2]
    assert list(load_snapshots(str(tmp_path / "old"))["round"].unique()) == [0, 1, 2]


def test_record_order_is_the_same_in_dataframe_analysis_and_report(tmp_path):
    """n_envs = 3: load_snapshots, the analysis functions and the report map each record to the same (step, env)."""
    from sb3_influence.analysis import top_bottom_records
    from sb3_influence.analysis.report import round_summary

    env = make_vec_env("CartPole-v1", n_envs=3, seed=0)
    model = InfluencePPO("MlpPolicy", env, seed=0, **TINY)
    model.learn(96, callback=AttributionCallback(save_dir=str(tmp_path)))
    snapshot = snapshots.load_all(str(tmp_path))[0]
    scores = snapshot.arrays["influence/return"]  # (n_steps, n_envs), the buffer's layout
    assert scores.shape == (32, 3)
    frame = load_snapshots(str(tmp_path))
    for _, row in frame.iterrows():
        assert row["influence_return"] == scores[row["step"], row["env"]]
        assert row["record_id"] == row["env"] * 32 + row["step"]
    table = top_bottom_records(snapshot, k=5)
    for _, row in table.iterrows():
        assert row["influence"] == scores[row["step"], row["env"]]
        assert row["record_id"] == row["env"] * 32 + row["step"]
        assert row["advantage"] == snapshot.arrays["advantage"][row["step"], row["env"]]
    assert list(table["rank"][:5]) == [1, 2, 3, 4, 5]
    # The report's Spearman(I, A) pairs each record's score with its own advantage
    from sb3_influence.common.stats import spearman

    summary = round_summary([snapshot])
    assert summary["spearman_advantage"][0] == pytest.approx(spearman(scores.ravel(), snapshot.arrays["advantage"].ravel()))
