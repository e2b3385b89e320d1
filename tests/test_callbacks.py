"""IIFCallback and AttributionCallback on real (tiny) training runs."""

import os

import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import CheckpointCallback, EvalCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure
from stable_baselines3.common.vec_env import SubprocVecEnv, VecNormalize

from conftest import requires
from sb3_influence import AttributionCallback, IIFCallback, InfluencePPO, load_snapshot, load_snapshots
from sb3_influence.common.callbacks import RoundCallback

TINY = dict(n_steps=64, batch_size=32, n_epochs=2, policy_kwargs=dict(net_arch=[16]))


def _model(seed: int = 0, env: str | object = "CartPole-v1", n_envs: int = 1, **kwargs) -> InfluencePPO:
    if isinstance(env, str) and n_envs > 1:
        env = make_vec_env(env, n_envs=n_envs, seed=seed)
    return InfluencePPO("MlpPolicy", env, seed=seed, **{**TINY, **kwargs})


class Recorder(RoundCallback):
    """A round observer: records the (shared, unfiltered) return scores and the final keep mask of each round."""

    round_role = "observer"

    def __init__(self):
        super().__init__()
        self.scores: list[np.ndarray] = []
        self.keeps: list[np.ndarray] = []

    def on_round(self, round_) -> None:
        self.scores.append(self.model.compute_influence("return", cache=True))
        self.keeps.append(self.model.rollout_buffer.keep.copy())


@pytest.mark.parametrize("rule", ["neg-bottom", "neg", "bottom", "random", "neg-random"])
def test_iif_drops_exactly_what_the_rule_says(rule):
    fraction = 0.3
    model = _model(n_envs=2)
    iif, recorder = IIFCallback(fraction=fraction, rule=rule), Recorder()
    model.learn(2 * 64 * 2, callback=[iif, recorder])
    assert len(recorder.keeps) == 2
    for scores, keep in zip(recorder.scores, recorder.keeps, strict=True):
        n, n_neg = scores.size, int((scores < 0).sum())
        expected = {
            "neg-bottom": int(np.floor(fraction * n_neg + 1e-9)),
            "neg": n_neg,
            "bottom": int(np.floor(fraction * n + 1e-9)),
            "random": int(np.floor(fraction * n_neg + 1e-9)),
            "neg-random": int(np.floor(fraction * n_neg + 1e-9)),
        }[rule]
        dropped = ~keep
        assert dropped.sum() == expected
        if rule in ("neg-bottom", "neg", "neg-random"):
            assert (scores[dropped] < 0).all()
        if rule in ("neg-bottom", "bottom") and dropped.any():
            assert scores[dropped].max() <= scores[keep].min()


def test_random_rules_are_reproducible_and_leave_global_rng_alone():
    masks = []
    for _ in range(2):
        model = _model(seed=3)
        recorder = Recorder()
        model.learn(3 * 64, callback=[IIFCallback(fraction=0.5, rule="random"), recorder])
        masks.append(np.stack(recorder.keeps))
    np.testing.assert_array_equal(masks[0], masks[1])
    # A new draw every round
    assert not np.array_equal(masks[0][0], masks[0][1])

    # The random rule's generator is not numpy's global one: after the same seeding, the global RNG state after a
    # "random" run equals the state after a deterministic-rule run (PPO draws its permutations over all records,
    # so it consumes the global RNG identically whatever is kept)
    states = []
    for rule in ("random", "neg-bottom"):
        model = _model(seed=5)
        model.learn(2 * 64, callback=IIFCallback(fraction=0.5, rule=rule))
        states.append(np.random.random(4))
    np.testing.assert_array_equal(states[0], states[1])


def test_fraction_zero_is_plain_ppo_bit_for_bit(tmp_path):
    ppo = PPO("MlpPolicy", "CartPole-v1", seed=7, **TINY)
    ppo.learn(3 * 64)
    model = _model(seed=7)
    callbacks = [IIFCallback(fraction=0.0), AttributionCallback(save_dir=str(tmp_path))]
    model.learn(3 * 64, callback=callbacks)
    assert len(os.listdir(tmp_path)) == 3
    reference = dict(ppo.policy.named_parameters())
    for name, parameter in model.policy.named_parameters():
        assert th.equal(parameter, reference[name]), name


def test_bad_inputs():
    for fraction in (-0.1, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            IIFCallback(fraction=fraction)
    for fraction in ("0.5", True, None):
        with pytest.raises(TypeError, match="fraction"):
            IIFCallback(fraction=fraction)
    with pytest.raises(ValueError, match="unknown rule 'worst'"):
        IIFCallback(rule="worst")
    with pytest.raises(TypeError, match="rule must be a name"):
        IIFCallback(rule=3)
    with pytest.raises(ValueError, match="Unknown target"):
        IIFCallback(target="value")
    with pytest.raises(ValueError, match="every"):
        AttributionCallback(every=0)
    with pytest.raises(ValueError, match="distinct"):
        AttributionCallback(targets=("return", "return"))
    with pytest.raises(ValueError, match="targets is empty"):
        AttributionCallback(targets=())
    with pytest.raises(TypeError, match="save_dir"):
        AttributionCallback(save_dir=3)
    with pytest.raises(ValueError, match="name_prefix"):
        AttributionCallback(name_prefix="")


@pytest.mark.parametrize("callback_class", [IIFCallback, AttributionCallback])
def test_plain_ppo_raises_at_init_callback(callback_class):
    ppo = PPO("MlpPolicy", "CartPole-v1", **TINY)
    callback = callback_class()
    with pytest.raises(TypeError, match=r"Use sb3_influence\.InfluencePPO"):
        callback.init_callback(ppo)
    with pytest.raises(TypeError, match="InfluencePPO"):
        ppo.learn(64, callback=callback_class())


def test_scores_computed_once_per_round_and_snapshot_keep_is_final(tmp_path, monkeypatch):
    for order in ("iif-first", "attribution-first"):
        model = _model(seed=1)
        calls = []
        original = model.influence_engine.influence

        def counting(*args, original=original, calls=calls, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(model.influence_engine, "influence", counting)
        iif = IIFCallback(fraction=0.5)
        attribution = AttributionCallback(save_dir=str(tmp_path / order))
        recorder = Recorder()
        callbacks = [iif, attribution] if order == "iif-first" else [attribution, iif]
        model.learn(2 * 64, callback=[*callbacks, recorder])
        assert len(calls) == 2, order
        frame = load_snapshots(str(tmp_path / order))
        for round_, keep in enumerate(recorder.keeps):
            assert not keep.all()
            rows = frame[frame["round"] == round_].sort_values("record_id")
            np.testing.assert_array_equal(rows["keep"].to_numpy(), model.rollout_buffer.to_flat(keep))
            np.testing.assert_array_equal(rows["influence_return"].to_numpy(), recorder.scores[round_].swapaxes(0, 1).ravel())


def test_every_and_on_training_end_twice(tmp_path):
    model = _model()
    attribution = AttributionCallback(save_dir=str(tmp_path), every=2)
    iif = IIFCallback(fraction=0.25)
    model.learn(5 * 64, callback=[attribution, iif])
    # Zero-padded round numbers: a plain sort (and ls) lists them in round order
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "snapshot_round000000_64_steps.npz",
        "snapshot_round000002_192_steps.npz",
        "snapshot_round000004_320_steps.npz",
    ]
    # rl-zoo calls on_training_end again after learn()
    for _ in range(2):
        attribution.on_training_end()
        iif.on_training_end()
    # Still usable for a second learn() call
    model.learn(128, callback=[attribution, iif], reset_num_timesteps=False)
    # Rounds 5 and 6: only round 6 is due
    assert not os.path.exists(tmp_path / "snapshot_round000005_384_steps.npz")
    assert os.path.exists(tmp_path / "snapshot_round000006_448_steps.npz")


@requires("tensorboard", extra="tensorboard")
def test_logger_scalars_histogram_and_csv(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _model()
    model.set_logger(configure(str(tmp_path), ["csv", "tensorboard"]))
    model.learn(2 * 64, callback=[IIFCallback(fraction=0.5), AttributionCallback()])
    events = [name for name in os.listdir(tmp_path) if name.startswith("events.out.tfevents")]
    assert events
    accumulator = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    accumulator.Reload()
    scalars = set(accumulator.Tags()["scalars"])
    for tag in (
        "iif/kept_fraction",
        "iif/n_dropped",
        "influence/return/mean",
        "influence/return/std",
        "influence/return/frac_negative",
        "influence/return/corr_advantage",
    ):
        assert tag in scalars, tag
    assert "influence/return/hist" in accumulator.Tags()["histograms"]
    histogram = accumulator.Histograms("influence/return/hist")
    assert len(histogram) == 2 and histogram[0].histogram_value.num == 64
    kept = [event.value for event in accumulator.Scalars("iif/kept_fraction")]
    assert all(0.5 <= value < 1.0 for value in kept)
    header = (tmp_path / "progress.csv").read_text().splitlines()[0].split(",")
    assert "influence/return/mean" in header and "influence/return/hist" not in header


@requires("tqdm", "rich", extra="zoo")
def test_composes_with_checkpoint_eval_and_progress_bar(tmp_path):
    model = _model(n_envs=2)
    eval_env = make_vec_env("CartPole-v1", n_envs=1, seed=1)
    callbacks = [
        CheckpointCallback(save_freq=64, save_path=str(tmp_path / "ckpt")),
        IIFCallback(fraction=0.5),
        EvalCallback(eval_env, eval_freq=64, n_eval_episodes=1, log_path=str(tmp_path / "eval")),
        AttributionCallback(save_dir=str(tmp_path / "snap")),
    ]
    model.learn(2 * 128, callback=callbacks, progress_bar=True)
    assert len(os.listdir(tmp_path / "ckpt")) == 2
    assert os.path.exists(tmp_path / "eval" / "evaluations.npz")
    frame = load_snapshots(str(tmp_path / "snap"))
    assert len(frame) == 2 * 128 and set(frame["env"]) == {0, 1}
    assert not frame["keep"].all()
    # The checkpoint loads back and keeps training with the callbacks
    loaded = InfluencePPO.load(str(tmp_path / "ckpt" / "rl_model_256_steps.zip"), env=make_vec_env("CartPole-v1", n_envs=2))
    loaded.learn(128, callback=IIFCallback(fraction=0.5))


def test_subproc_vecnormalize_statistics_in_snapshot(tmp_path):
    venv = make_vec_env("Pendulum-v1", n_envs=2, seed=0, vec_env_cls=SubprocVecEnv, vec_env_kwargs=dict(start_method="fork"))
    env = VecNormalize(venv)
    model = _model(env=env)
    try:
        model.learn(2 * 128, callback=[IIFCallback(fraction=0.5), AttributionCallback(save_dir=str(tmp_path))])
        last = load_snapshot(str(tmp_path / "snapshot_round000001_256_steps.npz"))
        stats = last.metadata["vec_normalize"]
        # No rollout after the last snapshot: its statistics are the env's final ones
        np.testing.assert_allclose(stats["obs_rms"]["mean"], env.obs_rms.mean)
        np.testing.assert_allclose(stats["obs_rms"]["var"], env.obs_rms.var)
        np.testing.assert_allclose(stats["ret_rms"]["var"], env.ret_rms.var)
        assert stats["obs_rms"]["count"] == pytest.approx(env.obs_rms.count)
        assert last.metadata["env_id"] == "Pendulum-v1"
        first = load_snapshot(str(tmp_path / "snapshot_round000000_128_steps.npz"))
        assert first.metadata["vec_normalize"]["obs_rms"]["count"] < stats["obs_rms"]["count"]
        assert last.arrays["action"].shape == (64, 2, 1)
    finally:
        env.close()
