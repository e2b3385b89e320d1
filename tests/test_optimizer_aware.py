"""Optimizer-aware in-run influence against a brute-force replay (per-record autograd at every step) in float64."""

import copy

import numpy as np
import pytest
import torch as th
from conftest import OddExtractor, TinyCNN, collect_rollout, make_env
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from sb3_influence import AttributionCallback, IIFCallback, InfluencePPO
from sb3_influence.common import sb3_compat
from sb3_influence.common.scoring.optimizer_aware import update_map


class Float64Flatten(BaseFeaturesExtractor):
    """Flatten, cast to float64: the rollout buffer stores float32, the policy runs in float64."""

    def __init__(self, observation_space):
        super().__init__(observation_space, int(np.prod(observation_space.shape)))

    def forward(self, observations):
        return observations.flatten(1).double()


OPTIMIZERS = {
    "sgd": (th.optim.SGD, dict(lr=0.05)),
    "sgd-momentum": (th.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "sgd-nesterov": (th.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (th.optim.Adam, dict(lr=3e-3)),
    "adamw": (th.optim.AdamW, dict(lr=3e-3, weight_decay=0.01)),
    "adam-l2": (th.optim.Adam, dict(lr=3e-3, weight_decay=0.01)),
    "rmsprop": (th.optim.RMSprop, dict(lr=1e-3, alpha=0.99, eps=1e-5)),
}


class InPlaceReLU(BaseFeaturesExtractor):
    """A Linear layer (float64) whose output a ReLU overwrites in place (from the start, or once ``inplace`` is set)."""

    def __init__(self, observation_space, inplace=True):
        super().__init__(observation_space, 6)
        self.linear = th.nn.Linear(int(np.prod(observation_space.shape)), 6)
        self.inplace = inplace

    def forward(self, observations):
        out = self.linear(observations.flatten(1).double())
        return th.relu_(out) if self.inplace else th.relu(out)


def float64_model(
    optimizer: str, action: str = "discrete", algo=InfluencePPO, env=None, extractor=Float64Flatten, **kwargs
) -> InfluencePPO:
    """``algo`` in float64 on ``env`` (default: a box-observation env with ``action`` actions), one round trained."""
    optimizer_class, optimizer_kwargs = OPTIMIZERS[optimizer]
    params = dict(n_steps=48, batch_size=16, n_epochs=3, seed=0, ent_coef=0.01, learning_rate=optimizer_kwargs["lr"])
    params.update(kwargs)
    model = algo(
        "MlpPolicy",
        make_env("box", action) if env is None else env,
        policy_kwargs=dict(net_arch=[8], features_extractor_class=extractor),
        **params,
    )
    model.policy.to(th.float64)
    model.policy.optimizer = optimizer_class(model.policy.parameters(), **optimizer_kwargs)
    collect_rollout(model)
    # A round that is not the optimizer's first (momentum buffers and Adam moments already set)
    model.train()
    collect_rollout(model)
    return model


def return_target(model) -> th.Tensor:
    """f_return = mean_j A_j log π_j over the buffer (log π masked by the stored action masks, if any)."""
    buffer = model.rollout_buffer
    obs = th.as_tensor(buffer.flat_field("observations"))
    actions = th.as_tensor(buffer.flat_field("actions")).long().flatten() if model.action_space.shape == () else None
    if actions is None:
        actions = th.as_tensor(buffer.flat_field("actions")).double()
    masks = buffer.record_action_masks(np.arange(buffer.n_records))
    masked = {} if masks is None else {"action_masks": masks}
    _, log_prob, _ = model.policy.evaluate_actions(obs, actions, **masked)
    advantages = th.as_tensor(buffer.flat_field("advantages")).double()
    return (advantages * log_prob).mean()


def return_target_gradient(model) -> dict:
    """∇f_return at θ(k) by plain autograd, per parameter."""
    params = [p for p in model.policy.parameters()]
    grads = th.autograd.grad(return_target(model), params, allow_unused=True)
    return {p: g for p, g in zip(params, grads, strict=True) if g is not None}


def brute_force(model, second_moment: bool = False, record_losses=None) -> np.ndarray:
    """
    Replay the round; at every step, per-record autograd of the actual loss, the update map applied by hand.
    ``record_losses(model, samples, advantages, clip_range, clip_range_vf)``: the per-record loss (default: the model's).
    """
    replay = copy.deepcopy(model)
    record_losses = record_losses or type(replay).record_losses
    v = return_target_gradient(replay)
    progress = sb3_compat.progress_remaining(replay)
    clip_range_vf = None if replay.clip_range_vf is None else replay.clip_range_vf(progress)
    scores = np.zeros(replay.rollout_buffer.n_records)

    def step(info):
        params = [p for p in replay.policy.parameters()]
        grads = {p: p.grad.detach().clone() for p in params if p.grad is not None}
        u = by_hand_update_map(info.optimizer, grads, v, info.total_steps - info.step, second_moment)
        if info.clip_coef < 1:
            g = th.cat([grads[p].reshape(-1) for p in params if p in grads])
            u_flat = th.cat([u.get(p, th.zeros_like(grads[p])).reshape(-1) for p in params if p in grads])
            u_flat = u_flat - g * (g @ u_flat) / (g @ g)
            u, offset = {}, 0
            for p in params:
                if p in grads:
                    u[p] = u_flat[offset : offset + p.numel()].reshape(p.shape)
                    offset += p.numel()
        losses = record_losses(replay, info.samples, info.advantages, info.clip_range, clip_range_vf)
        for row, record in enumerate(info.record_ids):
            g_i = th.autograd.grad(losses[row] / len(losses), list(u), retain_graph=True, allow_unused=True)
            dot = sum(float((gi * u[p]).sum()) for gi, p in zip(g_i, u, strict=True) if gi is not None)
            scores[record] -= info.clip_coef * dot

    state = np.random.get_state()  # the later epochs' permutations: the same at every call
    replay.update(step_hooks=[step])
    np.random.set_state(state)
    return replay.rollout_buffer.to_records(scores)


def by_hand_update_map(optimizer, grads, v, steps_left, second_moment):
    group = optimizer.param_groups[0]
    out = {}
    for p, direction in v.items():
        state = optimizer.state.get(p, {})
        g = grads[p]
        if isinstance(optimizer, th.optim.SGD):
            mu = group["momentum"]
            if mu == 0:
                k = 1.0
            else:
                c0 = 1.0 if state.get("momentum_buffer") is None else 1 - group["dampening"]
                buf = sum(c0 * mu**t for t in range(steps_left))
                k = 1 + mu * buf if group["nesterov"] else buf
            out[p] = group["lr"] * k * direction
        elif isinstance(optimizer, th.optim.RMSprop):
            sq = state.get("square_avg", th.zeros_like(p)) * group["alpha"] + (1 - group["alpha"]) * g**2
            out[p] = group["lr"] * direction / (sq.sqrt() + group["eps"])
        else:
            b1, b2 = group["betas"]
            if not isinstance(optimizer, th.optim.AdamW):
                g = g + group["weight_decay"] * p.detach()  # Adam's L2 penalty is part of the gradient
            s = int(state.get("step", 0)) + 1
            sq = state.get("exp_avg_sq", th.zeros_like(p)) * b2 + (1 - b2) * g**2
            m_hat = (state.get("exp_avg", th.zeros_like(p)) * b1 + (1 - b1) * g) / (1 - b1**s)
            root = (sq / (1 - b2**s)).sqrt()
            k = (1 - b1) * sum(b1**t / (1 - b1 ** (s + t)) for t in range(steps_left))
            k2 = (1 - b2) * sum(b2**t / (1 - b2 ** (s + t)) for t in range(steps_left))
            # d/dg of −lr·m̂/(√v̂+ε) through m̂ (momentum) and through v̂ (second moment), held over the look-ahead
            moment_term = k2 * m_hat * g / (root * (root + group["eps"]) ** 2) if second_moment else 0.0
            out[p] = group["lr"] * (k / (root + group["eps"]) - moment_term) * direction
    return out


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_matches_brute_force_replay(optimizer):
    model = float64_model(optimizer)
    scores = model.compute_influence(optimizer_aware=True)
    expected = brute_force(model)
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
def test_matches_brute_force_with_grad_clipping_and_a_gaussian_policy(optimizer):
    # max_grad_norm small: every step is clipped (projection); Box actions: log_std goes through forward mode;
    # clip_range small and a value clip: ratios leave the trust region in later epochs
    model = float64_model(optimizer, action="box", max_grad_norm=0.05, clip_range=0.05, clip_range_vf=0.1)
    scores = model.compute_influence(optimizer_aware=True)
    expected = brute_force(model)
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())


def test_record_losses_are_the_update_loss():
    """The gradient of mean(record_losses) is the gradient the update takes (before clipping)."""
    model = float64_model("adam", max_grad_norm=1e9, clip_range_vf=0.2)
    progress = sb3_compat.progress_remaining(model)
    checked = []

    def check(info):
        grads = [p.grad.clone() for p in model.policy.parameters()]
        losses = model.record_losses(info.samples, info.advantages, info.clip_range, model.clip_range_vf(progress))
        expected = th.autograd.grad(losses.mean(), list(model.policy.parameters()), allow_unused=True)
        for g, e in zip(grads, expected, strict=True):
            if e is not None:
                th.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
        checked.append(1)

    model.update(step_hooks=[check])
    assert len(checked) == 9


def test_one_full_batch_sgd_step_is_the_single_checkpoint_score_times_lr_over_n():
    model = float64_model("sgd", n_epochs=1, batch_size=48, max_grad_norm=1e9, ent_coef=0.0)
    single = model.compute_influence()
    aware = model.compute_influence(optimizer_aware=True)
    # (ratios are 1 at θ(k) up to float rounding of the stored log-probabilities)
    np.testing.assert_allclose(aware, single * 0.05 / 48, rtol=1e-5, atol=1e-14)


def test_in_run_scores_equal_replayed_scores_and_training_is_unchanged(tmp_path):
    def build():
        return InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=3,
                            policy_kwargs=dict(net_arch=[16]))  # fmt: skip

    plain = build().learn(128)
    replayed = []

    class Replay(AttributionCallback):
        def on_round(self, round_):
            replayed.append(self.model.compute_influence(optimizer_aware=True))

    model = build()
    in_run = AttributionCallback(save_dir=str(tmp_path), optimizer_aware=True)
    model.learn(128, callback=[in_run, Replay()])
    assert all(th.equal(p, q) for p, q in zip(plain.policy.parameters(), model.policy.parameters(), strict=True))
    from sb3_influence import load_snapshots

    frame = load_snapshots(str(tmp_path))
    for round_, expected in enumerate(replayed):
        rows = frame[frame["round"] == round_].sort_values("record_id")
        np.testing.assert_allclose(rows["influence_return"], expected.swapaxes(0, 1).ravel(), rtol=1e-5, atol=1e-9)


def test_iif_with_optimizer_aware_scores_filters_and_trains():
    model = InfluencePPO(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[16])
    )
    iif = IIFCallback(fraction=0.5, optimizer_aware=True)
    model.learn(128, callback=iif)
    assert iif.last_drop is not None and iif.last_drop.any()
    assert not model.rollout_buffer.keep.all()


def test_unknown_optimizer_is_a_clear_error():
    model = float64_model("sgd")
    model.policy.optimizer = th.optim.Adagrad(model.policy.parameters())
    with pytest.raises(ValueError, match="Adagrad"):
        model.compute_influence(optimizer_aware=True)
    with pytest.raises(ValueError, match="checkpoints='multi'"):
        model.compute_influence(checkpoints="single", optimizer_aware=True)
    with pytest.raises(ValueError, match="target_gradient"):
        model.compute_influence(optimizer_aware=True, target_gradient="every")
    assert update_map  # the public helper is importable


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_second_moment_term_matches_brute_force(optimizer):
    from sb3_influence import ReturnTarget
    from sb3_influence.common.scoring.optimizer_aware import OptimizerAwareScorer

    model = float64_model(optimizer)
    scorer = OptimizerAwareScorer(model, ReturnTarget(), 4096, second_moment=True)
    model.replay_update([scorer])
    expected = brute_force(model, second_moment=True)
    np.testing.assert_allclose(
        model.rollout_buffer.to_records(scorer.scores), expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max()
    )
    assert not np.allclose(expected, brute_force(model), rtol=1e-6)  # the term is not negligible in this round


@pytest.mark.parametrize("steps_per_batch, batch_elements", [(1, 2**23), (4, 2**23), (64, 1)])
def test_steps_scored_in_batches_of_any_size(steps_per_batch, batch_elements):
    """The ghost dot products of several steps are computed together: how many at once changes nothing (a memory
    cap below one step's parameter rows scores one step at a time)."""
    from sb3_influence import ReturnTarget
    from sb3_influence.common.scoring.optimizer_aware import OptimizerAwareScorer

    # batch_size 20 of 48 records: two minibatches of 20 and one of 8 per epoch (a batch ends when the size changes)
    model = float64_model("adam", action="box", batch_size=20, max_grad_norm=0.05)
    scorer = OptimizerAwareScorer(model, ReturnTarget(), 4096, steps_per_batch=steps_per_batch, batch_elements=batch_elements)
    model.replay_update([scorer])
    assert scorer._grads.shape[0] == (1 if batch_elements == 1 else steps_per_batch)
    expected = brute_force(model)
    np.testing.assert_allclose(
        model.rollout_buffer.to_records(scorer.scores), expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max()
    )


def test_batch_of_clipped_and_unclipped_steps():
    """A batch of steps of which only some were clipped projects the directions of those steps alone."""
    from sb3_influence import ReturnTarget
    from sb3_influence.common.scoring.optimizer_aware import OptimizerAwareScorer

    model = float64_model("adam", max_grad_norm=5.0)  # (this round: 4 of its 9 steps clipped)
    coefficients: list[float] = []
    scorer = OptimizerAwareScorer(model, ReturnTarget(), 4096)
    model.replay_update([lambda info: coefficients.append(info.clip_coef), scorer])
    assert 0 < sum(coefficient < 1 for coefficient in coefficients) < len(coefficients)
    expected = brute_force(model)
    np.testing.assert_allclose(
        model.rollout_buffer.to_records(scorer.scores), expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max()
    )


@pytest.mark.parametrize(
    "module, input_shape",
    [
        (th.nn.Linear(5, 3), (4, 5)),
        (th.nn.Linear(5, 3, bias=False), (4, 2, 5)),
    ],
)
def test_layer_dot_products_of_several_calls_at_once(module, input_shape):
    """``LinearScorer.dot_steps`` (several calls, each with its own direction) is ``dot`` call by call."""
    from sb3_influence.common.scoring.layers import DEFAULT_LAYER_SCORERS

    scorer = next(s for s in DEFAULT_LAYER_SCORERS if s.handles(module))
    module = module.double()
    generator = th.Generator().manual_seed(0)
    calls = 3
    inputs = th.randn(calls, *input_shape, generator=generator, dtype=th.float64)
    grad_out = th.randn(calls, *module(inputs[0]).shape, generator=generator, dtype=th.float64)
    v_weight = th.randn(calls, *module.weight.shape, generator=generator, dtype=th.float64)
    v_bias = None if module.bias is None else th.randn(calls, *module.bias.shape, generator=generator, dtype=th.float64)
    for weight, bias in ((v_weight, v_bias), (None, v_bias), (v_weight, None)):
        if weight is None and bias is None:
            continue
        together = scorer.dot_steps(module, inputs, grad_out, weight, bias)
        one_by_one = [
            scorer.dot(
                module, inputs[e], grad_out[e], None if weight is None else weight[e], None if bias is None else bias[e]
            )
            for e in range(calls)
        ]
        th.testing.assert_close(together, th.stack(one_by_one), rtol=1e-12, atol=1e-12)


def test_layer_outputs_modified_in_place():
    """A layer whose output is overwritten in place keeps its output gradient by a tensor hook (the layer's own)."""
    model = float64_model("adam", extractor=InPlaceReLU, max_grad_norm=0.05)
    scores = model.compute_influence(optimizer_aware=True)
    expected = brute_force(model)
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())


def test_layer_output_modified_in_place_only_later_is_a_clear_error():
    from sb3_influence import ReturnTarget
    from sb3_influence.common.scoring.optimizer_aware import OptimizerAwareScorer

    model = float64_model("adam", extractor=InPlaceReLU)
    extractor = model.policy.features_extractor
    extractor.inplace = False
    scorer = OptimizerAwareScorer(model, ReturnTarget(), 4096)

    def start_overwriting(info):
        extractor.inplace = True

    with pytest.raises(RuntimeError, match="modified in place"):
        model.replay_update([scorer, start_overwriting])


class Float64TinyCNN(TinyCNN):
    def forward(self, observations):
        return super().forward(observations.double())


class Float64OddExtractor(OddExtractor):
    def forward(self, observations):
        return super().forward(observations.double())


@pytest.mark.parametrize("obs, extractor", [("image", Float64TinyCNN), ("sequence", Float64OddExtractor)])
def test_convolutions_shared_layers_and_forward_mode_parameters(obs, extractor):
    """Convolutions (one call at a time), a Linear called twice per step, LayerNorm (forward mode), clipped steps."""
    model = float64_model("adam", env=make_env(obs), extractor=extractor, max_grad_norm=0.05)
    scores = model.compute_influence(optimizer_aware=True)
    expected = brute_force(model)
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())
