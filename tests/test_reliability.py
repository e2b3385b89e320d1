"""
Bad data is never silent: every bad input names the argument and the fix (API and command line), runs that cannot
mix are refused, damaged files say what is wrong, NaN/inf data stops at the round it appears, and snapshot folders
survive a SIGKILL and a full disk.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import zipfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from sb3_influence import ActionTarget, AttributionCallback, IIFCallback, InfluencePPO, load_snapshot, load_snapshots
from sb3_influence.analysis.report import build_report
from sb3_influence.cli import main as cli_main
from sb3_influence.common import snapshots
from sb3_influence.common.snapshots import SnapshotError

from conftest import collect_rollout, make_env

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(n_steps=32, batch_size=16, n_epochs=1, policy_kwargs=dict(net_arch=[8]))


def _model(env="CartPole-v1", n_envs: int = 1, seed: int = 0, **kwargs) -> InfluencePPO:
    if n_envs > 1:
        env = make_vec_env(env, n_envs=n_envs, seed=seed)
    return InfluencePPO("MlpPolicy", env, seed=seed, **{**TINY, **kwargs})


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """Two rounds of one run."""
    path = tmp_path_factory.mktemp("run")
    _model().learn(64, callback=AttributionCallback(save_dir=str(path)))
    return path


# ---------------------------------------------------------------------------------------------- bad inputs: the API
def _discrete_model():
    model = _model()
    collect_rollout(model)
    return model


def _space_model(action: str):
    model = InfluencePPO("MlpPolicy", make_env("box", action), seed=0, **TINY)
    collect_rollout(model)
    return model


OBS = np.zeros((1, 4), dtype=np.float32)


def _existing_file(tmp_path: Path) -> str:
    (tmp_path / "file.txt").write_text("x")
    return str(tmp_path / "file.txt")


API_CASES = {
    # name: (call(tmp_path), error type, fragment naming the argument)
    "save_dir is a file": (lambda t: AttributionCallback(save_dir=_existing_file(t)), ValueError, "save_dir .* is a file"),
    "save_dir under a file": (
        lambda t: AttributionCallback(save_dir=os.path.join(_existing_file(t), "sub")),
        ValueError,
        "save_dir .* cannot be created",
    ),
    "overwrite not a bool": (lambda t: AttributionCallback(overwrite="yes"), TypeError, "overwrite"),
    "NaN action": (lambda t: ActionTarget(OBS, [np.nan]), ValueError, "`actions` holds 1 NaN"),
    "text action": (lambda t: ActionTarget(OBS, ["left"]), TypeError, "`actions` must be an array of numbers"),
    "no action": (lambda t: ActionTarget(OBS, []), ValueError, "`actions` is empty"),
    "inf observation": (lambda t: ActionTarget(np.full((1, 4), np.inf), [0]), ValueError, "`observations` holds 4 NaN or inf"),
    "empty name": (lambda t: ActionTarget(OBS, [0], name=""), ValueError, "name must be"),
    "fractional Discrete action": (
        lambda t: _discrete_model().compute_influence(ActionTarget(OBS, [0.7])),
        ValueError,
        r"`actions` must hold whole numbers .* got 0\.7",
    ),
    "Discrete action out of range": (
        lambda t: _discrete_model().compute_influence(ActionTarget(OBS, [2])),
        ValueError,
        r"`actions` must lie in \[0, 1\]",
    ),
    "negative Discrete action": (
        lambda t: _discrete_model().compute_influence(ActionTarget(OBS, [-1])),
        ValueError,
        "`actions` must lie in",
    ),
    "MultiDiscrete action out of range": (
        lambda t: _space_model("multidiscrete").compute_influence(ActionTarget(np.zeros((1, 3)), [[1, 2]])),
        ValueError,
        r"`actions` must lie in .* MultiDiscrete",
    ),
    "MultiBinary action 2": (
        lambda t: _space_model("multibinary").compute_influence(ActionTarget(np.zeros((1, 3)), [[0, 2, 1]])),
        ValueError,
        "`actions` must lie in",
    ),
    "action shape": (
        lambda t: _space_model("box").compute_influence(ActionTarget(np.zeros((1, 3)), [[0.1, 0.2, 0.3]])),
        ValueError,
        "`actions` must have shape",
    ),
    "observation shape": (
        lambda t: _discrete_model().compute_influence(ActionTarget(np.zeros((1, 3)), [0])),
        ValueError,
        "`observations` must have shape",
    ),
    "bad target at _init_callback": (
        lambda t: _model().learn(32, callback=IIFCallback(target=ActionTarget(OBS, [0.5]))),
        ValueError,
        "`actions` must hold whole numbers",
    ),
    "on_error": (lambda t: load_snapshots(str(t), on_error="ignore"), ValueError, "on_error must be one of"),
}


@pytest.mark.parametrize("name", list(API_CASES))
def test_api_bad_input(name, tmp_path):
    call, error, fragment = API_CASES[name]
    with pytest.raises(error, match=fragment):
        call(tmp_path)


def test_unwritable_save_dir_is_refused_at_construction(tmp_path, monkeypatch):
    # As root every folder is writable: stand in for a read-only parent
    monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) != str(tmp_path))
    with pytest.raises(PermissionError, match=r"save_dir .*/new/sub' is not writable \(.* denies writing\)"):
        AttributionCallback(save_dir=str(tmp_path / "new" / "sub"))


def test_bad_target_is_refused_before_any_training():
    model = _model()
    with pytest.raises(ValueError, match="whole numbers"):
        model.learn(64, callback=AttributionCallback(targets=[ActionTarget(OBS, [0.7])]))
    assert model.num_timesteps == 0


def test_integral_float_actions_are_accepted():
    # The rollout buffer stores Discrete actions as floats: its own actions make a valid target
    model = _discrete_model()
    observations = model.rollout_buffer.flat_field("observations")[:5]
    actions = model.rollout_buffer.flat_field("actions")[:5].astype(np.float32)
    assert np.isfinite(model.compute_influence(ActionTarget(observations, actions))).all()


# ---------------------------------------------------------------------------------------------- bad inputs: the CLI
def _mixed_folder(tmp_path: Path, run_folder: Path) -> Path:
    mixed = tmp_path / "mixed"
    shutil.copytree(run_folder, mixed / "a")
    _model(n_envs=2).learn(64, callback=AttributionCallback(save_dir=str(mixed / "b"), name_prefix="other"))
    return mixed


def _damaged_folder(tmp_path: Path, run_folder: Path) -> Path:
    damaged = tmp_path / "damaged"
    shutil.copytree(run_folder, damaged)
    file = sorted(damaged.glob("*.npz"))[-1]
    file.write_bytes(file.read_bytes()[:100])
    return damaged


CLI_CASES = {
    # name: (argv(tmp_path, run_folder), fragment)
    "unknown command": (lambda t, r: ["train"], "unknown command 'train'"),
    "fraction": (lambda t, r: ["run", "--fraction", "1.5"], "--fraction: must be in"),
    "timesteps not a number": (lambda t, r: ["run", "--timesteps", "many"], "--timesteps: must be a positive int"),
    "rule": (lambda t, r: ["run", "--rule", "worst"], "--rule: invalid choice"),
    "eval episodes": (lambda t, r: ["run", "--eval-episodes", "-1"], "--eval-episodes"),
    "save dir is a file": (lambda t, r: ["run", "--save-dir", _existing_file(t)], "save_dir .* is a file"),
    "save dir of another run": (
        lambda t, r: ["run", "--timesteps", "32", "--save-dir", str(shutil.copytree(r, t / "other"))],
        "already holds 2 snapshot.* of another run .*overwrite",
    ),
    "unknown env": (lambda t, r: ["run", "--env", "NoSuchEnv-v0", "--timesteps", "32"], "NoSuchEnv"),
    "report missing folder": (lambda t, r: ["report", str(t / "missing")], "does not exist"),
    "report empty folder": (lambda t, r: ["report", str(t)], r"No snapshot \(\*\.npz\)"),
    "report damaged file": (
        lambda t, r: ["report", str(_damaged_folder(t, r))],
        r"snapshot_round000001_64_steps\.npz: is damaged",
    ),
    "report mixed runs": (lambda t, r: ["report", str(_mixed_folder(t, r))], "2 different runs.* run_id="),
    "report unknown run": (lambda t, r: ["report", str(r), "--run-id", "nope"], "run_id='nope' matches none"),
    "report top": (lambda t, r: ["report", str(r), "--top", "0"], "top_k must be a positive int"),
    "report target": (lambda t, r: ["report", str(r), "--target", "value"], "target 'value' is not in this snapshot"),
    "report option": (lambda t, r: ["report", str(r), "--colour"], "unrecognized arguments: --colour"),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_bad_input_is_one_line(name, tmp_path, run_folder, capsys):
    argv, fragment = CLI_CASES[name]
    argv = argv(tmp_path, run_folder)
    capsys.readouterr()
    try:
        status = cli_main(argv)
    except SystemExit as exit_:  # argparse's exit, as the console script would see it
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    import re

    assert re.search(fragment, lines[0]), lines[0]


def test_cli_process_prints_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "sb3_influence.cli", "report", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------- damaged files
def _flip_a_byte(data: bytes, arrays: dict) -> bytes:
    with zipfile.ZipFile(__import__("io").BytesIO(data)) as archive:
        info = archive.getinfo("influence/return.npy")
    # Inside the member's compressed data (after its 30-byte local header and its name)
    position = info.header_offset + 30 + len(info.filename) + info.compress_size // 2
    return data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1 :]


def _without(arrays: dict, *keys: str) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **{k: v for k, v in arrays.items() if k not in keys})
    return buffer.getvalue()


DAMAGE = {
    # name: (damage(original bytes, arrays), fragment)
    "empty": (lambda data, arrays: b"", "empty"),
    "truncated": (lambda data, arrays: data[: len(data) // 2], "is damaged"),
    "bit flip": (_flip_a_byte, "is damaged"),
    "not a zip": (lambda data, arrays: b"hello, not a snapshot\n" * 10, "is damaged"),
    "foreign npz": (lambda data, arrays: _without({"x": np.zeros(3)}), "is not an attribution snapshot"),
    "npy array": (lambda data, arrays: _npy(), "single .npy array"),
    "missing keep": (lambda data, arrays: _without(arrays, "keep"), r"the array\(s\) \['keep'\] are missing"),
    "bad metadata": (lambda data, arrays: _without({**arrays, "metadata": np.array("{not json")}), "not valid JSON"),
    "bad layout": (lambda data, arrays: _without({**arrays, "reward": np.zeros(3)}), "not the round's layout"),
}


def _npy() -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.zeros(3))
    return buffer.getvalue()


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_file_names_itself(kind, tmp_path, run_folder):
    shutil.copytree(run_folder, tmp_path / "run")
    good, bad = sorted((tmp_path / "run").glob("*.npz"))
    damage, fragment = DAMAGE[kind]
    arrays = dict(load_snapshot(bad).arrays)
    bad.write_bytes(damage(bad.read_bytes(), arrays))
    with pytest.raises(SnapshotError, match=fragment) as error:
        load_snapshot(bad)
    assert error.value.path == str(bad) and bad.name in str(error.value)
    if DAMAGE[kind][1] in ("is not an attribution snapshot", "single .npy array"):
        # A readable .npz that is not a snapshot (evaluations.npz...) is skipped with a warning, whatever on_error
        with pytest.warns(UserWarning, match=bad.name):
            assert len(load_snapshots(str(tmp_path / "run"))) == 32
        return
    with pytest.raises(SnapshotError, match=bad.name):
        load_snapshots(str(tmp_path / "run"))
    # One bad file does not make the folder unreadable
    with pytest.warns(UserWarning, match=f"Skipping an unreadable snapshot: .*{bad.name}"):
        frame = load_snapshots(str(tmp_path / "run"), on_error="skip")
    assert list(frame["round"].unique()) == [0]
    assert snapshots.load_all(str(tmp_path / "run"), on_error="skip")[0].path == str(good)


def test_files_get_the_users_umask(tmp_path):
    arrays = {"keep": np.ones((2, 1), dtype=bool)}
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            path = snapshots.save_snapshot(str(tmp_path / f"s{umask}.npz"), arrays, {})
        finally:
            os.umask(old)
        assert os.stat(path).st_mode & 0o777 == mode


def test_orphaned_temp_files_are_removed_at_the_next_run_and_never_read(tmp_path):
    old, fresh = tmp_path / ".tmp_killed.npz", tmp_path / ".tmp_writing.npz"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    model = _model()
    model.learn(32, callback=AttributionCallback(save_dir=str(tmp_path)))
    assert not old.exists() and fresh.exists()  # a fresh one may belong to a writer still running
    assert len(load_snapshots(str(tmp_path))) == 32


# ---------------------------------------------------------------------------------------------- runs
def test_another_run_in_the_same_save_dir_is_refused_then_overwritten(tmp_path):
    first = _model(seed=1)
    first.learn(64, callback=AttributionCallback(save_dir=str(tmp_path)))
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.npz")}
    second = _model(seed=2)
    with pytest.raises(
        ValueError, match=r"save_dir .* already holds 2 snapshot\(s\) of another run .*overwrite=True"
    ) as error:
        second.learn(64, callback=AttributionCallback(save_dir=str(tmp_path)))
    assert first.run_id in str(error.value) and second.num_timesteps == 0
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.npz")} == before  # nothing touched
    (tmp_path / "notes.txt").write_text("mine")
    third = _model(seed=3)
    third.learn(32, callback=AttributionCallback(save_dir=str(tmp_path), overwrite=True))
    loaded = snapshots.load_all(str(tmp_path))
    assert [(s.round, s.metadata["run_id"], s.metadata["seed"]) for s in loaded] == [(0, third.run_id, 3)]
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only snapshot files are deleted


@pytest.mark.parametrize("reset_num_timesteps", [True, False])
def test_resuming_continues_the_run(tmp_path, reset_num_timesteps):
    model = _model(n_envs=2)
    model.learn(128, callback=AttributionCallback(save_dir=str(tmp_path / "snap")))
    model.save(tmp_path / "model.zip")
    loaded = InfluencePPO.load(tmp_path / "model.zip", env=make_vec_env("CartPole-v1", n_envs=2, seed=1))
    assert loaded.run_id == model.run_id
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "snap").glob("*.npz")}
    loaded.learn(128, callback=AttributionCallback(save_dir=str(tmp_path / "snap")), reset_num_timesteps=reset_num_timesteps)
    frame = load_snapshots(str(tmp_path / "snap"))
    assert sorted(frame["round"].unique()) == [0, 1, 2, 3]
    assert not frame.duplicated(["round", "record_id"]).any()
    # Earlier snapshots are untouched
    assert {name: (tmp_path / "snap" / name).stat().st_mtime_ns for name in written} == written
    assert len(list((tmp_path / "snap").glob("*.npz"))) == 4
    assert {m["run_id"] for m in frame.attrs["metadata"]} == {model.run_id}


def test_resuming_with_another_n_envs_or_from_an_older_save_is_refused(tmp_path):
    model = _model(n_envs=2)
    model.learn(64, callback=AttributionCallback(save_dir=str(tmp_path / "snap")))
    model.save(tmp_path / "round1.zip")
    model.learn(64, callback=AttributionCallback(save_dir=str(tmp_path / "snap")), reset_num_timesteps=False)
    other_layout = InfluencePPO.load(tmp_path / "round1.zip", env=make_vec_env("CartPole-v1", n_envs=4))
    with pytest.raises(ValueError, match=r"already holds 2 snapshot\(s\) of this run with another layout"):
        other_layout.learn(128, callback=AttributionCallback(save_dir=str(tmp_path / "snap")))
    older = InfluencePPO.load(tmp_path / "round1.zip", env=make_vec_env("CartPole-v1", n_envs=2))
    with pytest.raises(ValueError, match=r"already holds round\(s\) \[1\] of this run, which this model has not reached"):
        older.learn(64, callback=AttributionCallback(save_dir=str(tmp_path / "snap")))
    assert older.num_timesteps == 0 and len(load_snapshots(str(tmp_path / "snap"))) == 2 * 64
    # overwrite=True: the older branch's later rounds are replaced
    older.learn(64, callback=AttributionCallback(save_dir=str(tmp_path / "snap"), overwrite=True))
    assert [s.num_timesteps for s in snapshots.load_all(str(tmp_path / "snap"))] == [64, 64]


def test_mixed_runs_are_refused_unless_chosen(tmp_path, run_folder):
    mixed = _mixed_folder(tmp_path, run_folder)
    with pytest.raises(SnapshotError, match="2 different runs") as error:
        load_snapshots(str(mixed))
    run_ids = {s.metadata["run_id"] for s in snapshots.load_all(str(mixed), allow_mixed=True)}
    for run_id in run_ids:
        assert run_id in str(error.value)
    with pytest.raises(SnapshotError):
        build_report(mixed)  # refused before any figure is drawn
    for run_id in run_ids:
        frame = load_snapshots(str(mixed), run_id=run_id[:8])
        assert {m["run_id"] for m in frame.attrs["metadata"]} == {run_id}
        assert not frame.duplicated(["round", "record_id"]).any()
    frame = load_snapshots(str(mixed), allow_mixed=True)
    assert frame.columns[0] == "run_id" and set(frame["run_id"]) == run_ids
    assert not frame.duplicated(["run_id", "round", "record_id"]).any()
    assert frame.duplicated(["round", "record_id"]).any()
    pytest.importorskip("matplotlib", reason="the report: install the analysis extra, pip install -e '.[analysis]'")
    assert build_report(mixed, run_id=next(iter(run_ids)), out_dir=tmp_path / "report").exists()


def test_duplicate_round_within_a_run_is_refused(tmp_path, run_folder):
    shutil.copytree(run_folder, tmp_path / "run")
    first = sorted((tmp_path / "run").glob("*.npz"))[0]
    shutil.copy(first, tmp_path / "run" / "copy_of_round0.npz")
    with pytest.raises(SnapshotError, match="holds round 0 more than once"):
        load_snapshots(str(tmp_path / "run"))
    # Snapshots of older versions carry no run id: two of them with the same round cannot be told apart
    arrays = {"keep": np.ones((2, 1), dtype=bool), "round": np.array(0), "num_timesteps": np.array(2)}
    (tmp_path / "legacy").mkdir()
    for seed in (1, 2):
        snapshots.save_snapshot(str(tmp_path / "legacy" / f"seed{seed}.npz"), arrays, {"seed": seed})
    with pytest.raises(SnapshotError, match="carry no run id"):
        snapshots.load_all(str(tmp_path / "legacy"))


def test_metadata_carries_the_run_identity(run_folder):
    metadata = snapshots.load_all(str(run_folder))[0].metadata
    assert len(metadata["run_id"]) == 32 and metadata["seed"] == 0
    assert (metadata["n_envs"], metadata["n_steps"], metadata["name_prefix"]) == (1, 32, "snapshot")


# ---------------------------------------------------------------------------------------------- non-finite data
class BadRewardEnv(gym.Env):
    """CartPole-like: the reward at step ``bad_step`` is ``value`` (NaN or inf)."""

    observation_space = spaces.Box(-1, 1, (4,), dtype=np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, value: float, bad_step: int = 5, bad_obs: bool = False):
        self.value, self.bad_step, self.bad_obs, self.t = value, bad_step, bad_obs, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        bad = self.t == self.bad_step
        obs = np.full(4, self.value if bad and self.bad_obs else 0.1, dtype=np.float32)
        reward = self.value if bad and not self.bad_obs else 1.0
        return obs, reward, False, self.t % 10 == 0, {}


@pytest.mark.parametrize("consumer", ["attribution", "iif", "none"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_rewards_stop_at_the_round(consumer, value, tmp_path):
    model = InfluencePPO("MlpPolicy", BadRewardEnv(value, bad_step=40), seed=0, **TINY)
    callback = {
        "attribution": AttributionCallback(save_dir=str(tmp_path)),
        "iif": IIFCallback(fraction=0.5),
        "none": None,
    }[consumer]
    with pytest.raises(ValueError, match=r"Round 1: \d+ of 32 records hold NaN or inf values \(rewards: 1, .*VecCheckNan"):
        model.learn(96, callback=callback)
    assert len(list(tmp_path.glob("*round000001*"))) == 0


def test_non_finite_observations_are_named(tmp_path):
    model = InfluencePPO("MlpPolicy", BadRewardEnv(np.nan, bad_obs=True), seed=0, **TINY)
    with pytest.raises(ValueError, match=r"Round 0: the policy's action distribution is NaN .*NaN or inf observation"):
        model.learn(32, callback=AttributionCallback(save_dir=str(tmp_path)))


def test_policy_that_turned_nan_is_reported_at_its_round():
    # The learning rate turns NaN at the update of round 1 (progress remaining 0.5 of 4 rounds)
    model = _model(learning_rate=lambda progress: 3e-4 if progress > 0.5 else float("nan"))
    with pytest.raises(ValueError, match=r"NaN or inf during the update of round 1: it made them so .*learning rate"):
        model.learn(4 * 32, callback=AttributionCallback())
    assert model.n_rounds == 2


class _NanParametersAtRollout(AttributionCallback):
    """Sets every parameter to NaN after the rollout, before the round opens (as a bad load or a user edit would)."""

    def _on_rollout_end(self) -> None:
        with th.no_grad():
            for parameter in self.model.policy.parameters():
                parameter.fill_(float("nan"))


def test_nan_parameters_before_scoring_are_reported(tmp_path):
    with pytest.raises(ValueError, match=r"NaN or inf at the start of round 0 .*tensor\(s\)"):
        _model().learn(32, callback=_NanParametersAtRollout(save_dir=str(tmp_path)))
    assert not list(tmp_path.glob("*.npz"))


# ---------------------------------------------------------------------------------------------- edge cases
class BatchNormExtractor(BaseFeaturesExtractor):
    def __init__(self, observation_space: spaces.Box, features_dim: int = 8):
        super().__init__(observation_space, features_dim)
        self.net = th.nn.Sequential(th.nn.Linear(observation_space.shape[0], features_dim), th.nn.BatchNorm1d(features_dim))

    def forward(self, observations: th.Tensor) -> th.Tensor:
        return self.net(observations)


def test_batch_norm_with_a_one_record_last_minibatch_trains():
    policy_kwargs = dict(features_extractor_class=BatchNormExtractor, net_arch=[8])
    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=2, seed=0, policy_kwargs=policy_kwargs
    )

    class DropFifteen(IIFCallback):
        def on_round(self, round_) -> None:
            drop = np.zeros_like(self.model.rollout_buffer.keep)
            drop[:15] = True  # 49 kept = 3 * 16 + 1
            self.model.drop_records(drop, source="test")

    sizes: list[int] = []
    model.learn(128, callback=DropFifteen(fraction=0.0))
    collect_rollout(model)
    model.rollout_buffer.keep[:15] = False
    model.update(step_hooks=[lambda info: sizes.append(len(info.record_ids))])
    assert sizes == [16, 16, 17] * 2
    assert all(th.isfinite(p).all() for p in model.policy.parameters())


# ---------------------------------------------------------------------------------------------- kill and disk full
TRAIN_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import gymnasium as gym
    from gymnasium import spaces
    from sb3_influence import AttributionCallback, InfluencePPO

    class Wide(gym.Env):
        # Large random observations: each snapshot takes a while to compress and write
        observation_space = spaces.Box(-1, 1, (1500,), dtype=np.float32)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return self.observation_space.sample(), {}

        def step(self, action):
            return self.observation_space.sample(), float(action), False, False, {}

    model = InfluencePPO("MlpPolicy", Wide(), n_steps=128, batch_size=128, n_epochs=1, seed=0,
                         policy_kwargs=dict(net_arch=[4]))
    model.learn(10**7, callback=AttributionCallback(save_dir=sys.argv[1]))
    """
)


def test_sigkill_mid_run_leaves_a_loadable_folder(tmp_path):
    """Three trainings (run side by side to save time), each SIGKILLed at a random moment after its first snapshot."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rng = random.Random(0)
    folders = [tmp_path / f"run{attempt}" for attempt in range(3)]
    processes = [subprocess.Popen([sys.executable, "-c", TRAIN_SCRIPT, str(folder)], env=env) for folder in folders]
    kill_at: list[float | None] = [None] * len(processes)
    try:
        deadline = time.time() + 240
        while any(process.poll() is None for process in processes):
            assert time.time() < deadline, "no snapshot after 240 s"
            for i, (process, folder) in enumerate(zip(processes, folders, strict=True)):
                if process.poll() is not None:
                    continue
                if kill_at[i] is None and list(folder.glob("snapshot_*.npz")):
                    kill_at[i] = time.time() + rng.uniform(0.0, 2.0)
                if kill_at[i] is not None and time.time() >= kill_at[i]:  # type: ignore[operator]
                    process.send_signal(signal.SIGKILL)
                    process.wait()
            time.sleep(0.01)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, folder in zip(processes, folders, strict=True):
        assert process.returncode == -signal.SIGKILL, "the training process ended before it was killed"
        # Every complete snapshot loads (raise on any damaged file); temporary files of a killed write are never read
        loaded = snapshots.load_all(str(folder))
        assert [s.round for s in loaded] == list(range(len(loaded)))
        assert all(np.isfinite(s.scores()).all() for s in loaded)
        temps = sorted(folder.glob(".tmp_*"))
        for temp in temps:
            os.utime(temp, (0, 0))  # as if long ago: the next run start removes it
        assert snapshots.remove_orphaned_temp_files(folder) == [str(temp) for temp in temps]
        assert not list(folder.glob(".tmp_*"))


def _mount_tiny_tmpfs(path: Path) -> str | None:
    """Mount a 64 KiB tmpfs at ``path``; the reason it cannot, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to mount a tmpfs"
    if shutil.which("mount") is None:
        return "no mount command"
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True, text=True)
    return None if result.returncode == 0 else f"mount failed: {result.stderr.strip()}"


def test_disk_full_is_a_clear_error_and_finished_snapshots_load(tmp_path):
    disk = tmp_path / f"tiny_{uuid.uuid4().hex[:6]}"
    reason = _mount_tiny_tmpfs(disk)
    if reason is not None:
        pytest.skip(reason)
    try:
        model = _model()
        with pytest.raises(OSError, match=r"No space left on the device .* the snapshots already in .* are complete") as error:
            model.learn(10**6, callback=AttributionCallback(save_dir=str(disk)))
        assert error.value.errno == 28  # ENOSPC
        loaded = snapshots.load_all(str(disk))
        assert len(loaded) >= 1 and [s.round for s in loaded] == list(range(len(loaded)))
        assert not list(disk.glob(".tmp_*"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_missing_optional_module_names_its_extra(monkeypatch):
    import pandas as pd

    from sb3_influence.analysis import plot_phases

    # As if matplotlib were not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    formation = pd.DataFrame(dict(round=[1, 2], association=[0.1, 0.2], roughness=[0.0, 0.1], scale=[1.0, 2.0]))
    message = r"plot_phases\(\) needs 'matplotlib', which is not installed: pip install 'sb3_influence\[analysis\]'"
    with pytest.raises(ModuleNotFoundError, match=message):
        plot_phases(formation)


def test_a_broken_optional_package_is_not_called_missing(tmp_path, monkeypatch):
    from sb3_influence.extras import import_optional

    # Installed packages whose import misses a module, another package's or one of their own: that error is raised,
    # not "install the extra"
    (tmp_path / "half_installed").mkdir()
    (tmp_path / "half_installed" / "__init__.py").write_text("import a_module_nobody_installs\n")
    (tmp_path / "lacks_a_part").mkdir()
    (tmp_path / "lacks_a_part" / "__init__.py").write_text("")
    (tmp_path / "lacks_a_part" / "figure.py").write_text("import lacks_a_part._compiled_part\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named 'a_module_nobody_installs'"):
        import_optional("half_installed", "analysis", "plot_phases()")
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'lacks_a_part\._compiled_part'"):
        import_optional("lacks_a_part.figure", "analysis", "plot_phases()")
