"""Units (records, trajectories) for scores, filters and snapshots; DTV-Loo against brute force."""

import numpy as np
import pytest
import torch as th
from conftest import (
    collect_rollout,
    make_env,
    make_masked_env,
    policy_for,
    reference_log_prob_grads,
    reference_training_advantages,
    requires,
)
from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import AttributionCallback, DTVLooCallback, IIFCallback, InfluenceMaskablePPO, InfluencePPO, dtv_loo_scores
from sb3_influence.analysis import trajectory_frame
from sb3_influence.common.callbacks import RoundCallback
from sb3_influence.common.filters import drop_neg_bottom
from sb3_influence.common.scoring.trajectory import trajectory_sq_norms
from sb3_influence.common.snapshots import load_snapshots


def build(cls=InfluencePPO, obs="box", action="discrete", masked=False, **kwargs):
    policy, policy_kwargs = policy_for(obs)
    factory = make_masked_env if masked else make_env
    env = make_vec_env(lambda: factory(obs, action, ep_length=9), n_envs=2, seed=0)
    params = dict(n_steps=24, batch_size=16, n_epochs=2, seed=0, policy_kwargs=policy_kwargs)
    params.update(kwargs)
    return cls(policy, env, **params)


def double_rollout(**kwargs):
    model = build(**kwargs)
    collect_rollout(model)
    with th.no_grad():
        for param in model.policy.parameters():
            param.add_(0.3 * th.randn_like(param))
    model.policy.double()
    return model


def test_trajectory_ids():
    model = build()
    collect_rollout(model)
    buffer = model.rollout_buffer
    buffer.episode_starts[:] = 0
    buffer.episode_starts[[3, 10], 0] = 1
    buffer.episode_starts[[0, 23], 1] = 1
    ids = buffer.to_records(buffer.trajectory_ids())
    # env 0: [0, 3) [3, 10) [10, 24); env 1: [0, 23) [23, 24)
    np.testing.assert_array_equal(ids[:, 0], np.repeat([0, 1, 2], [3, 7, 14]))
    np.testing.assert_array_equal(ids[:, 1], np.repeat([3, 4], [23, 1]))
    # Flattened by get(): the same ids
    list(buffer.get(8))
    np.testing.assert_array_equal(buffer.to_records(buffer.trajectory_ids()), ids)


def record_reference(model) -> np.ndarray:
    grads = reference_log_prob_grads(model)
    raw = th.as_tensor(model.rollout_buffer.flat_field("advantages").astype(np.float64))
    return reference_training_advantages(model) * (grads @ (raw @ grads / len(raw))).numpy()


@pytest.mark.parametrize("case", [dict(), dict(cls=InfluenceMaskablePPO, obs="dict", action="multidiscrete", masked=True)])
def test_trajectory_scores_are_sums_of_brute_force_record_scores(case):
    model = double_rollout(**case)
    buffer = model.rollout_buffer
    ids = buffer.trajectory_ids()
    assert ids.max() >= 4
    expected = np.bincount(ids, weights=record_reference(model))
    scores = model.compute_influence(unit="trajectory")
    assert scores.shape == (ids.max() + 1,)
    np.testing.assert_allclose(scores, expected, rtol=1e-8, atol=1e-10 * np.abs(expected).max())
    np.testing.assert_allclose(scores.sum(), model.compute_influence().sum(), rtol=1e-10)
    with pytest.raises(ValueError, match="unit"):
        model.compute_influence(unit="episode")


def test_iif_drops_whole_trajectories(tmp_path):
    model = build(n_steps=32)
    seen = []

    class Check(AttributionCallback):
        def on_round(self, round_):
            super().on_round(round_)
            buffer = self.model.rollout_buffer
            scores = self.model.compute_influence(unit="trajectory", cache=True)
            seen.append((buffer.trajectory_ids(), buffer.flat_keep.copy(), scores))

    model.learn(128, callback=[IIFCallback(fraction=1.0, unit="trajectory"), Check(save_dir=str(tmp_path))])
    for ids, keep, scores in seen:
        expected_drop = drop_neg_bottom(scores, 1.0, np.random.default_rng())
        assert expected_drop.any() and not expected_drop.all()
        np.testing.assert_array_equal(keep, ~expected_drop[ids])
    frame = load_snapshots(str(tmp_path))
    rows = trajectory_frame(frame)
    assert set(rows["kept_fraction"]) <= {0.0, 1.0}
    last = rows[rows["round"] == 1]
    np.testing.assert_allclose(last["influence_return"].to_numpy(), seen[1][2])
    assert last["length"].sum() == 64 and list(last["trajectory_id"]) == list(range(len(seen[1][2])))
    assert trajectory_frame(str(tmp_path)).equals(rows)
    assert frame.attrs["metadata"][1]["filters"][0]["unit"] == "trajectory"


def brute_force_dtv(model):
    grads = reference_log_prob_grads(model)
    advantages = th.as_tensor(model.rollout_buffer.to_flat(model.training_advantages()))
    loss_grads = -advantages[:, None] * grads
    ids = th.as_tensor(model.rollout_buffer.trajectory_ids())
    n = int(ids.max()) + 1
    per_trajectory = th.zeros(n, grads.shape[1], dtype=grads.dtype).index_add_(0, ids, loss_grads)
    total = per_trajectory.sum(0)
    norms = (per_trajectory**2).sum(1)
    scores = th.stack([per_trajectory[t] @ (total - per_trajectory[t]) / (n - 1) for t in range(n)])
    return scores.numpy(), norms.numpy()


@pytest.mark.parametrize(
    "case",
    [dict(), dict(action="box"), dict(cls=InfluenceMaskablePPO, obs="image", action="multibinary", masked=True)],
)
def test_dtv_loo_exact_against_brute_force(case):
    model = double_rollout(**case)
    expected, expected_norms = brute_force_dtv(model)
    buffer = model.rollout_buffer
    advantages = buffer.to_flat(model.training_advantages())
    for batch_size in (5, 4096):
        norms = trajectory_sq_norms(model.influence_engine, advantages, buffer.trajectory_ids(), batch_size)
        np.testing.assert_allclose(norms, expected_norms, rtol=1e-9)
        scores = dtv_loo_scores(model, batch_size=batch_size)
        np.testing.assert_allclose(scores, expected, rtol=1e-8, atol=1e-10 * np.abs(expected).max())
    assert np.abs(expected).max() > 1e-6


def test_dtv_loo_callback_drops_opposing_trajectories():
    model = build(n_steps=32)
    before, after = [], []

    class Before(RoundCallback):
        round_role = "filter"

        def on_round(self, round_):
            before.append(dtv_loo_scores(self.model))

    class After(RoundCallback):
        def on_round(self, round_):
            after.append((dtv_loo_scores(self.model), self.model.rollout_buffer.flat_keep.copy()))

    model.learn(64, callback=[Before(), DTVLooCallback(fraction=1.0), After()])
    dtv, (dtv_after, keep), ids = before[0], after[0], model.rollout_buffer.trajectory_ids()
    assert (dtv < 0).any() and (dtv > 0).any()
    np.testing.assert_array_equal(keep, ~(dtv < 0)[ids])
    assert DTVLooCallback().settings == {
        "fraction": 0.125,
        "rule": "neg-bottom",
        "unit": "trajectory",
        "budget": "records",
        "scorer": "dtv-loo",
    }
    # After learn(): scored at θ(k) of the last round (with its final keep mask), and nothing moved
    params = [p.detach().clone() for p in model.policy.parameters()]
    np.testing.assert_allclose(dtv_loo_scores(model), dtv_after, rtol=1e-5, atol=1e-7 * np.abs(dtv_after).max())
    assert all(th.equal(p, q) for p, q in zip(model.policy.parameters(), params, strict=True))


def test_bad_unit():
    with pytest.raises(ValueError, match="unit"):
        IIFCallback(unit="episode")
    with pytest.raises(ValueError, match="budget must be one of"):
        IIFCallback(unit="trajectory", budget="trajectories")

    def own_rule(scores, fraction, rng):
        return scores < 0

    with pytest.raises(ValueError, match=r"budget='units'"):
        IIFCallback(unit="trajectory", rule=own_rule)
    # Fine where no sizes are passed
    IIFCallback(unit="trajectory", rule=own_rule, budget="units")
    IIFCallback(rule=own_rule)


@pytest.mark.parametrize("budget", ["records", "units"])
def test_trajectory_budget_in_records_or_units(budget):
    """A small fraction of few long trajectories: budgeted in units it drops nothing, in records the most negative."""
    model = build(n_steps=64)
    seen = []

    class Check(RoundCallback):
        round_role = "filter"

        def on_round(self, round_):
            buffer = self.model.rollout_buffer
            seen.append((buffer.trajectory_ids(), self.model.compute_influence(unit="trajectory")))

    callback = IIFCallback(fraction=0.2, unit="trajectory", budget=budget)
    model.learn(128, callback=[Check(), callback])
    # The last round's buffer is still there
    ids, scores = seen[-1]
    np.testing.assert_array_equal(ids, model.rollout_buffer.trajectory_ids())
    sizes = np.bincount(ids)
    negative = np.flatnonzero(scores < 0)
    assert 1 <= len(negative) < 5, "the case needs floor(0.2 · n_neg) = 0 trajectories"
    dropped_records = ~model.rollout_buffer.flat_keep
    if budget == "units":
        assert not dropped_records.any()
    else:
        budget_records = int(np.floor(0.2 * sizes[negative].sum()))
        worst = negative[np.argsort(scores[negative])]
        count = int(np.searchsorted(np.cumsum(sizes[worst]), budget_records)) + 1
        np.testing.assert_array_equal(dropped_records, np.isin(ids, worst[:count]))
        assert dropped_records.sum() >= budget_records > 0
    assert callback.settings["budget"] == budget


@requires("matplotlib", extra="analysis")
def test_report_shows_trajectory_rows(tmp_path):
    from sb3_influence.analysis import build_report

    model = build(cls=InfluenceMaskablePPO, masked=True, n_steps=32)
    model.learn(64, callback=[IIFCallback(fraction=1.0, unit="trajectory"), AttributionCallback(save_dir=str(tmp_path))])
    page = build_report(tmp_path, top_k=2).read_text()
    assert 'id="trajectories"' in page and "harmful" in page and "helpful" in page
