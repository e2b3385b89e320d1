"""
The optimizer's linearised update map: how a change of one step's gradient moves the parameters, for the
optimizers whose arithmetic is known (SGD with momentum and Nesterov, Adam, AdamW, RMSprop).

``M_j`` is diagonal. For SGD it is ``η``; with momentum ``η`` times the momentum's geometric sum over the round's
remaining steps; for Adam/AdamW ``η (1−β1) Σ_{t=j}^{J−1} β1^{t−j} / (1−β1^{s+t−j})`` divided elementwise by
``√v̂_j + ε`` (the second-moment estimate including this step's gradient, held fixed over the look-ahead); for
RMSprop ``η / (√v_j + ε)``. :func:`update_map` is one step; :class:`GroupSteps` computes the map of many recorded
steps of one parameter group at once, which is what the in-run scorer
(:mod:`~sb3_influence.common.scoring.optimizer_aware`) uses.
"""

import math
from collections.abc import Callable
from typing import Any

import torch as th
from torch import nn

#: Optimizers whose update map is known.
SUPPORTED_OPTIMIZERS = (th.optim.SGD, th.optim.Adam, th.optim.AdamW, th.optim.RMSprop)


def check_optimizer(optimizer: th.optim.Optimizer) -> None:
    """Raise a clear error for an optimizer whose update map :func:`update_map` does not know."""
    if not isinstance(optimizer, SUPPORTED_OPTIMIZERS):
        raise ValueError(
            f"optimizer_aware scoring knows the update map of {[cls.__name__ for cls in SUPPORTED_OPTIMIZERS]}, not "
            f"{type(optimizer).__name__}: use one of these (policy_kwargs=dict(optimizer_class=...)) or optimizer_aware=False"
        )
    for group in optimizer.param_groups:
        if group.get("maximize", False):
            raise ValueError("optimizer_aware scoring needs a minimising optimizer (maximize=False)")


class Spreads:
    """
    How much of one gradient a bias-corrected EMA carries over a round's remaining steps,
    ``S(s, L) = (1 − β) Σ_{t<L} β^t / (1 − β^(s+t))`` for step ``s`` with ``L`` steps left, cached per round: step
    ``s`` with ``L`` steps left is followed by step ``s + 1`` with ``L − 1`` left, and
    ``S(s, L) = (1 − β) / (1 − β^s) + β S(s + 1, L − 1)``, so the first request fills the whole chain and the later
    steps' are look-ups.
    """

    def __init__(self) -> None:
        self._values: dict[tuple[float, int, int], float] = {}

    def __call__(self, beta: float, step: int, steps_left: int) -> float:
        key = (beta, step, steps_left)
        if key not in self._values:
            total = 0.0
            for left in range(1, steps_left + 1):
                at = step + steps_left - left
                total = (1 - beta) / (1 - beta**at) + beta * total
                self._values[beta, at, left] = total
        return self._values[key]


def flatten_tensors(tensors: list[th.Tensor], out: th.Tensor | None = None) -> th.Tensor:
    """The tensors laid end to end (into ``out`` when given)."""
    return th.cat([tensor.reshape(-1) for tensor in tensors], out=out)


class GroupSteps:
    """
    The update map (:func:`update_map`) of one parameter group at several optimiser steps at once: :meth:`record`
    keeps, at each step, what the map needs from the optimizer (its state before the step, step counts, the
    learning rate) in one row per step, and :meth:`directions` computes ``M_jᵀ v`` of every row with a few
    operations on ``(steps, parameters)`` matrices.

    :param optimizer: The optimizer.
    :param group: The parameter group.
    :param params: Its parameters (all of them or some), in the order of the rows' columns.
    :param rows: Steps it can hold.
    :param second_moment: See :func:`update_map`.
    """

    def __init__(
        self, optimizer: th.optim.Optimizer, group: dict[str, Any], params: list[nn.Parameter], rows: int, second_moment: bool
    ):
        check_optimizer(optimizer)
        self.optimizer, self.group, self.params, self.second_moment = optimizer, group, params, second_moment
        self.adam = isinstance(optimizer, (th.optim.Adam, th.optim.AdamW))
        self.sgd = isinstance(optimizer, th.optim.SGD)
        if self.adam:
            keys = ["exp_avg_sq"] + ["max_exp_avg_sq"] * bool(group.get("amsgrad", False)) + ["exp_avg"] * second_moment
            # Adam's L2 penalty enters the moments; AdamW's decay is decoupled (recent torch: AdamW subclasses Adam)
            decoupled = isinstance(optimizer, th.optim.AdamW) or group.get("decoupled_weight_decay", False)
            penalty = bool(group["weight_decay"]) and not decoupled
        elif self.sgd:
            keys, penalty = [], False  # (SGD's weight decay does not depend on the gradient)
        else:  # RMSprop
            keys, penalty = ["square_avg"] + ["grad_avg"] * bool(group["centered"]), bool(group["weight_decay"])
        size = sum(param.numel() for param in params)
        first = params[0]
        self.states = {key: th.zeros(rows, size, dtype=first.dtype, device=first.device) for key in keys}
        # The parameters at each step, for the L2 penalty that is part of the gradient
        self.weights = th.zeros(rows, size, dtype=first.dtype, device=first.device) if penalty else None
        self.sizes = [param.numel() for param in params]
        self.counts: list[list[Any]] = []  # per row: Adam's step per parameter, SGD's "momentum buffer exists"
        self.lrs: list[float] = []
        self.steps_left: list[int] = []
        self._states_of: Any = None
        self._states_cache: list[dict[str, Any]] = []

    def record(self, row: int, steps_left: int) -> None:
        """
        Keep this step's optimizer quantities in ``row`` (rows are filled in order from 0; called after
        ``backward()`` and clipping, before ``optimizer.step()``).

        :param row: The row.
        :param steps_left: Steps of the round from this one on (≥ 1).
        """
        del self.counts[row:], self.lrs[row:], self.steps_left[row:]
        states = self._states()
        for key, rows in self.states.items():
            values = [state.get(key) for state in states]
            flatten_tensors(
                [th.zeros_like(p) if t is None else t for p, t in zip(self.params, values, strict=True)], out=rows[row]
            )
        if self.weights is not None:
            flatten_tensors([param.detach() for param in self.params], out=self.weights[row])
        if self.adam:
            self.counts.append([int(state.get("step", 0)) + 1 for state in states])
        elif self.sgd:
            self.counts.append([state.get("momentum_buffer") is not None for state in states])
        self.lrs.append(float(self.group["lr"]))
        self.steps_left.append(max(1, int(steps_left)))

    def _states(self) -> list[dict[str, Any]]:
        """The optimizer's state of each parameter (``{}`` where there is none yet)."""
        if self._states_of is not self.optimizer.state:
            # Each parameter's state is one dict the optimizer updates in place: look them up again only when
            # the optimizer's state was replaced (load_state_dict) or some parameter had none yet
            found = [self.optimizer.state.get(param) for param in self.params]
            states: list[dict[str, Any]] = [{} if state is None else state for state in found]
            if any(state is None for state in found):
                return states
            self._states_of, self._states_cache = self.optimizer.state, states
        return self._states_cache

    def _column(self, values: list[list[float]], like: th.Tensor) -> th.Tensor:
        """One number per row and parameter: ``(rows, 1)`` when each row's are equal (the usual case), else per column."""
        if all(all(value == row[0] for value in row) for row in values):
            return th.tensor([[row[0]] for row in values], dtype=like.dtype, device=like.device)
        sizes = th.tensor(self.sizes, device=like.device)
        return th.tensor(values, dtype=like.dtype, device=like.device).repeat_interleave(sizes, dim=1)

    def directions(
        self, grad: th.Tensor, v: th.Tensor, spreads: Callable[[float, int, int], float], out: th.Tensor | None = None
    ) -> th.Tensor:
        """
        ``M_jᵀ v`` for the recorded rows. The rows are used up: their buffers serve as scratch space (the
        computation is in place, so that no ``(rows, size)`` temporary is allocated).

        :param grad: The rows' gradients, ``(rows, size)`` (not modified).
        :param v: The direction, ``(size,)``.
        :param spreads: ``spreads(β, step, steps_left)``: :class:`Spreads`.
        :param out: Where to write the result (``(rows, size)``), or ``None``.
        :return: ``(rows, size)``.
        """
        group, rows = self.group, len(self.lrs)
        if self.weights is not None:
            grad = grad + group["weight_decay"] * self.weights[:rows]
        if self.adam:
            beta1, beta2 = group["betas"]
            # The second-moment estimate and the denominator each step will use, with Adam's own expressions
            exp_avg_sq = self.states["exp_avg_sq"][:rows].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if group.get("amsgrad", False):
                # (zeros where there is no maximum yet: the estimate is never negative)
                exp_avg_sq = th.maximum(self.states["max_exp_avg_sq"][:rows], exp_avg_sq, out=exp_avg_sq)
            correction = self._column([[math.sqrt(1 - beta2**step) for step in row] for row in self.counts], grad)
            root = exp_avg_sq.sqrt_().div_(correction)
            denominator = root + group["eps"] if self.second_moment else root.add_(group["eps"])
            # Bias-corrected momentum spreads each step's gradient over the rest of the round
            scale = [
                [lr * spreads(beta1, step, left) for step in row]
                for row, lr, left in zip(self.counts, self.lrs, self.steps_left, strict=True)
            ]
            direction = th.div(v, denominator, out=out).mul_(self._column(scale, grad))
            if self.second_moment:
                # The gradient also enters v̂, the denominator of this and the later steps:
                # ∂(m̂/(√v̂+ε))/∂v̂ = −m̂ / (2√v̂ (√v̂+ε)²), ∂v̂_t/∂g_j = 2(1−β2)β2^(t−j) g_j / (1−β2^s_t)
                exp_avg = self.states["exp_avg"][:rows] * beta1 + (1 - beta1) * grad
                m_hat = exp_avg / self._column([[1 - beta1**step for step in row] for row in self.counts], grad)
                scale_v = [
                    [lr * spreads(beta2, step, left) for step in row]
                    for row, lr, left in zip(self.counts, self.lrs, self.steps_left, strict=True)
                ]
                safe_root = th.where(root > 0, root, th.ones_like(root))
                direction -= self._column(scale_v, grad) * m_hat * grad * v / (safe_root * denominator**2)
            return direction
        if self.sgd:
            momentum, dampening = float(group["momentum"]), float(group["dampening"])
            scale = []
            for row, lr, left in zip(self.counts, self.lrs, self.steps_left, strict=True):
                if momentum == 0:
                    scale.append([lr])
                    continue
                # torch: buf = g on the first step, else momentum · buf + (1 − dampening) · g
                geometric = sum(momentum**t for t in range(left))
                firsts = [(1 - dampening if exists else 1.0) * geometric for exists in row]
                scale.append([lr * (1 + momentum * first if group["nesterov"] else first) for first in firsts])
            return th.mul(v, self._column(scale, grad), out=out)
        # RMSprop
        alpha, momentum = float(group["alpha"]), float(group["momentum"])
        square_avg = self.states["square_avg"][:rows].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        if group["centered"]:
            grad_avg = self.states["grad_avg"][:rows].mul_(alpha).add_(grad, alpha=1 - alpha)
            square_avg.addcmul_(grad_avg, grad_avg, value=-1)
        scale = [
            [lr * (1.0 if momentum == 0 else sum(momentum**t for t in range(left)))]
            for lr, left in zip(self.lrs, self.steps_left, strict=True)
        ]
        return th.div(v, square_avg.sqrt_().add_(group["eps"]), out=out).mul_(self._column(scale, grad))


def update_map(
    optimizer: th.optim.Optimizer, v: dict[nn.Parameter, th.Tensor], steps_left: int, second_moment: bool = False
) -> dict[nn.Parameter, th.Tensor]:
    """
    ``M_jᵀ v`` for the optimiser step about to be taken (called after ``backward()`` and clipping, before
    ``optimizer.step()``): how a unit change of this step's gradient moves the parameters, summed over this step
    and the ``steps_left − 1`` later steps of the round its momentum reaches. ``M_j`` is diagonal, so it is its
    own transpose.

    :param optimizer: The optimizer (its hyperparameters, its state before this step, and ``p.grad`` of this step).
    :param v: Direction per parameter (the target gradient).
    :param steps_left: Steps of the round from this one on (≥ 1).
    :param second_moment: Adam/AdamW: include the gradient's effect through the second-moment estimate v̂ (the
        denominator), not only through the momentum (measured: no change of the LDS, so off by default).
    :return: ``M_jᵀ v`` per parameter of ``v`` that the optimizer updates.
    """
    check_optimizer(optimizer)
    out: dict[nn.Parameter, th.Tensor] = {}
    with th.no_grad():
        for group in optimizer.param_groups:
            params = [param for param in group["params"] if param in v and param.grad is not None]
            if not params:
                continue
            steps = GroupSteps(optimizer, group, params, 1, second_moment)
            steps.record(0, steps_left)
            grad = flatten_tensors([param.grad for param in params])[None]
            direction = steps.directions(grad, flatten_tensors([v[param] for param in params]), Spreads())[0]
            for param, piece in zip(params, direction.split(steps.sizes), strict=True):
                out[param] = piece.view_as(param)
    return out
