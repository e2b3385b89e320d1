"""
Unrolled influence: the exact first-order effect of each record on the target through the whole update.

The in-run optimizer-aware score (:mod:`~sb3_influence.common.scoring.optimizer_aware`) carries each step's
parameter change to the end of the round unchanged, which leaves out curvature between steps: a record that moves
θ at step j changes every later step's gradient (PPO's clipped objective partly undoes it, Adam renormalises it).
This scorer differentiates the update itself. It replays the round from θ(k) with a weight ``w_i`` on every record's
loss (``w = 1`` is the real update: same minibatches, same order, same clipped-ratio loss, gradient clipping and
optimizer arithmetic), keeps the graph, evaluates the target at the final parameters θ_J and returns

    I_i = ∂f(θ_J) / ∂w_i  at w = 1,

the first-order change of f from up-weighting record i (removing it: w_i → 0), curvature, clipping and the
optimizer's state all included. This is a hypergradient (backpropagation through training), exact up to float
rounding; it costs a replay with a double backward, and the memory of the whole update's graph, so it suits the
small networks of classic control and MiniGrid. ``compute_influence(optimizer_aware="unrolled")`` uses it.

The replay is a differentiable twin of ``InfluencePPO.update`` and of torch's SGD, Adam/AdamW and RMSprop steps
(single-tensor arithmetic); ``tests/test_unrolled.py`` checks that it lands on the parameters the real update
reaches. ``target_kl`` early stopping is not replayed (an error says so).
"""

from typing import Any

import numpy as np
import torch as th
from torch import nn

from sb3_influence.common import sb3_compat
from sb3_influence.common.scoring.update_maps import check_optimizer
from sb3_influence.common.state import training_state
from sb3_influence.common.targets import Target


class _Wrapped(nn.Module):
    """Calls ``fn(model, *args)`` with ``self.policy`` in the module tree, so ``functional_call`` can swap its parameters."""

    def __init__(self, model: Any, fn: Any):
        super().__init__()
        self.policy = model.policy
        self.__dict__["_model"] = model
        self.__dict__["_fn"] = fn

    def forward(self, *args: Any) -> th.Tensor:
        return self.__dict__["_fn"](self.__dict__["_model"], *args)


def _record_losses(
    model: Any, samples: Any, advantages: th.Tensor, clip_range: float, clip_range_vf: float | None, clip_smoothing: float
) -> th.Tensor:
    return model.record_losses(samples, advantages, clip_range, clip_range_vf, clip_smoothing)


def _target_value(model: Any, target: Target, batch_size: int) -> th.Tensor:
    return sum(target.terms(model.influence_engine, batch_size))  # type: ignore[return-value]


def _optimizer_step(
    optimizer: th.optim.Optimizer, group: dict[str, Any], param: th.Tensor, grad: th.Tensor, state: dict[str, Any], lr: float
) -> th.Tensor:
    """One differentiable optimizer step for one parameter (``state`` holds tensors and ``step``, updated in place)."""
    weight_decay = group.get("weight_decay", 0.0)
    if isinstance(optimizer, (th.optim.Adam, th.optim.AdamW)):
        beta1, beta2 = group["betas"]
        decoupled = isinstance(optimizer, th.optim.AdamW) or group.get("decoupled_weight_decay", False)
        if weight_decay and decoupled:
            param = param * (1 - lr * weight_decay)
        elif weight_decay:
            grad = grad + weight_decay * param
        state["step"] += 1
        state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * grad
        state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * grad * grad
        second = state["exp_avg_sq"]
        if group.get("amsgrad", False):
            state["max_exp_avg_sq"] = th.maximum(state["max_exp_avg_sq"], second)
            second = state["max_exp_avg_sq"]
        bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
        # (+1e-38 under the root: its derivative at 0 would be infinite; the value is unchanged in float32/64)
        denominator = th.sqrt(second + 1e-38) / (bias2**0.5) + group["eps"]
        return param - (lr / bias1) * state["exp_avg"] / denominator
    if isinstance(optimizer, th.optim.SGD):
        if weight_decay:
            grad = grad + weight_decay * param
        momentum = group["momentum"]
        if momentum:
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = grad
            else:
                state["momentum_buffer"] = momentum * state["momentum_buffer"] + (1 - group["dampening"]) * grad
            grad = grad + momentum * state["momentum_buffer"] if group["nesterov"] else state["momentum_buffer"]
        return param - lr * grad
    # RMSprop
    if weight_decay:
        grad = grad + weight_decay * param
    alpha = group["alpha"]
    state["square_avg"] = alpha * state["square_avg"] + (1 - alpha) * grad * grad
    average = state["square_avg"]
    if group["centered"]:
        state["grad_avg"] = alpha * state["grad_avg"] + (1 - alpha) * grad
        average = average - state["grad_avg"] * state["grad_avg"]
    denominator = th.sqrt(average + 1e-38) + group["eps"]
    if group["momentum"]:
        state["momentum_buffer"] = group["momentum"] * state["momentum_buffer"] + grad / denominator
        return param - lr * state["momentum_buffer"]
    return param - lr * grad / denominator


def _initial_state(optimizer: th.optim.Optimizer, param: nn.Parameter) -> dict[str, Any]:
    stored = optimizer.state.get(param, {})
    state: dict[str, Any] = {"step": int(stored.get("step", 0))}
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "grad_avg"):
        state[key] = stored[key].detach().clone() if key in stored else th.zeros_like(param)
    buffer = stored.get("momentum_buffer")
    state["momentum_buffer"] = None if buffer is None else buffer.detach().clone()
    if isinstance(optimizer, th.optim.RMSprop) and state["momentum_buffer"] is None:
        state["momentum_buffer"] = th.zeros_like(param)
    return state


def unrolled_replay(
    model: Any, weights: th.Tensor | None = None, order_seed: int | None = None, clip_smoothing: float = 0.0
) -> dict[str, th.Tensor]:
    """
    Replay the current round's update from θ(k), differentiably, with record weights; restore the model after.

    :param model: An ``InfluencePPO`` whose buffer holds the round.
    :param weights: Per-record loss weights, flat by record id (``None``: all ones). When they require grad,
        gradients flow back to them and the whole update's graph is kept; otherwise each step is detached (a plain
        weighted retrain, e.g. with zeros for dropped records that stay in their minibatches).
    :param order_seed: ``None``: the real update's minibatch orders (the round's first permutation, then numpy's
        global RNG as the round found it). A seed: every epoch's order drawn afresh after ``np.random.seed(order_seed)``,
        the first epoch's too (as :func:`~sb3_influence.analysis.faithfulness.retrained_target` retrains).
    :param clip_smoothing: Width τ of the softened ratio clip (see ``record_losses``); 0: PPO's loss, the real update.
    :return: The final parameters θ_J by name (graph attached when ``weights`` requires grad).
    """
    if model.target_kl is not None:
        raise ValueError("optimizer_aware='unrolled' does not replay target_kl early stopping: set target_kl=None")
    optimizer = model.policy.optimizer
    check_optimizer(optimizer)
    round_ = model.current_round()
    buffer = model.rollout_buffer
    if weights is None:
        weights = th.ones(buffer.n_records, dtype=th.float64)
    differentiable = weights.requires_grad
    with training_state(model):
        round_.start_state.restore(model, keep=False)
        first_permutation = round_.first_permutation
        if order_seed is not None:
            np.random.seed(order_seed)
            first_permutation = np.random.permutation(buffer.n_records)
        progress = sb3_compat.progress_remaining(model)
        lr = float(model.lr_schedule(progress))
        clip_range = model.clip_range(progress)
        clip_range_vf = None if model.clip_range_vf is None else model.clip_range_vf(progress)
        named = dict(model.policy.named_parameters())
        group_of = {param: group for group in optimizer.param_groups for param in group["params"]}
        theta = {name: param.detach().clone().requires_grad_(True) for name, param in named.items()}
        states = {name: _initial_state(optimizer, named[name]) for name in theta}
        losses = _Wrapped(model, _record_losses)
        model.policy.set_training_mode(True)
        for epoch in range(model.n_epochs):
            order = first_permutation if epoch == 0 else np.random.permutation(buffer.n_records)
            for ids in buffer.kept_minibatches(order, model.batch_size):
                samples = buffer.samples(ids)
                advantages = samples.advantages
                if model.normalize_advantage and len(advantages) > 1:
                    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                arguments = (samples, advantages, clip_range, clip_range_vf, clip_smoothing)
                per_record = th.func.functional_call(
                    losses, {f"policy.{k}": v for k, v in theta.items()}, arguments, tie_weights=False
                )
                loss = (weights[th.as_tensor(ids)].to(device=per_record.device, dtype=per_record.dtype) * per_record).mean()
                grads = th.autograd.grad(loss, list(theta.values()), create_graph=differentiable, allow_unused=True)
                grads = tuple(th.zeros_like(t) if g is None else g for g, t in zip(grads, theta.values(), strict=True))
                norm = th.sqrt(sum((g * g).sum() for g in grads))  # type: ignore[arg-type]
                coefficient = th.clamp(model.max_grad_norm / (norm + 1e-6), max=1.0)
                theta = {
                    name: _optimizer_step(optimizer, group_of[named[name]], value, grad * coefficient, states[name], lr)
                    for (name, value), grad in zip(theta.items(), grads, strict=True)
                }
                if not differentiable:
                    theta = {name: value.detach().requires_grad_(True) for name, value in theta.items()}
                    for state in states.values():
                        for key, value in state.items():
                            if isinstance(value, th.Tensor):
                                state[key] = value.detach()
    return theta


def unrolled_order_seeds(model: Any, n_orders: int) -> list[int | None]:
    """
    The minibatch orders :func:`unrolled_influence` averages over: ``None`` (the real update's), then
    ``n_orders − 1`` seeds drawn from a generator seeded with the model's seed and the round's ``rollout_id``
    (the same round gives the same orders; numpy's global RNG is not touched).

    :param model: An ``InfluencePPO`` whose buffer holds the round.
    :param n_orders: How many orders, at least 1.
    :return: ``[None, seed, ...]`` of length ``n_orders``.
    """
    rng = np.random.default_rng([int(model.seed or 0), int(model.rollout_buffer.rollout_id)])
    return [None, *(int(seed) for seed in rng.integers(0, 2**31 - 1, size=n_orders - 1))]


def unrolled_influence(
    model: Any, target: Target, batch_size: int, n_orders: int = 1, clip_smoothing: float = 0.0
) -> np.ndarray:
    """
    ``∂f(θ_J)/∂w_i`` for every record of the current round (flat, by record id), averaged over minibatch orders.

    With ``n_orders=1`` and ``clip_smoothing=0`` this is the exact derivative of the real update. Under Adam the
    effect of removing one record is not that derivative's: records whose ratio sits near the clip boundary
    switch in or out of the clip when θ moves, a jump the derivative of the hard clip never sees, and where they
    switch depends on the minibatch order. A softened clip (``clip_smoothing``) turns the jumps into slopes the
    derivative sees, and averaging over orders (``n_orders``) estimates the expected effect of removing the record,
    as IIF's re-batched update meets it. ``docs/faithfulness.md`` measures both: ``clip_smoothing=3e-2`` with
    ``n_orders=4`` predicted subset removals best under SB3's Adam (a narrower 1e-3 failed badly in one cell).

    :param model: An ``InfluencePPO`` whose buffer holds the round.
    :param target: The target f.
    :param batch_size: Records per chunk when evaluating f.
    :param n_orders: Minibatch orders averaged over (:func:`unrolled_order_seeds`): the real update's, then others.
    :param clip_smoothing: Width τ of the softened ratio clip in the replay (0: PPO's hard clip).
    :return: Float64 scores, flat by record id (zero for dropped records).
    """
    evaluate = _Wrapped(model, _target_value)
    total = np.zeros(model.rollout_buffer.n_records)
    for order_seed in unrolled_order_seeds(model, n_orders):
        weights = th.ones(model.rollout_buffer.n_records, dtype=th.float64, requires_grad=True)
        theta = unrolled_replay(model, weights, order_seed=order_seed, clip_smoothing=clip_smoothing)
        with model.influence_engine.eval_mode():
            value = th.func.functional_call(
                evaluate, {f"policy.{k}": v for k, v in theta.items()}, (target, batch_size), tie_weights=False
            )
            (gradient,) = th.autograd.grad(value, weights, allow_unused=True)
        if gradient is not None:
            total += gradient.detach().cpu().numpy().astype(np.float64)
    return total / n_orders
