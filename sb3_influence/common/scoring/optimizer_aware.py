"""
Optimizer-aware in-run influence: what each record's gradient did to the target through the optimiser that ran.

The paper's score (Sec. 3) is an SGD proxy at θ(k): ``I_i = Â_i ⟨∇log π_i, ∇f⟩``. PPO's real update takes many
steps j with the clipped-ratio loss, gradient-norm clipping and, in SB3 by default, Adam. Upweighting record i
by ``w_i`` changes step j's clipped gradient by ``c_j Π_j ∇ℓ_i(θ_j) / |B_j|`` (``ℓ_i`` the record's actual PPO loss:
ratio-weighted, zero where the clip is active, plus its value and entropy terms; ``c_j`` the clip coefficient;
``Π_j = I − ĝĝᵀ`` when the gradient norm was clipped, since the step's norm is then fixed, else ``I``). The
optimizer maps that change into parameter moves at step j and, through its momentum, at the later steps of the
round; to first order the target moves by::

    I_i = Σ_{j ∋ i} −c_j ⟨∇ℓ_i(θ_j) / |B_j|,  Π_j M_jᵀ v⟩,     v = ∇f (at θ(k), or at θ_j)

with ``M_j`` the linearised update map of the optimizer at step j (:func:`update_map`): ``η`` for SGD; ``η`` times
the momentum's geometric sum over the round's remaining steps for SGD with momentum; for Adam/AdamW
``η (1−β1) Σ_{t=j}^{J−1} β1^{t−j} / (1−β1^{s+t−j})`` divided elementwise by ``√v̂_j + ε`` (the second-moment
estimate including this step's gradient, held fixed over the look-ahead); for RMSprop ``η / (√v_j + ε)``. Like the
paper's score, positive means the record moved f up. With SGD, one full-batch step and no clipping it is the
paper's single-checkpoint score times ``η / n``.

Computed *in run*: the update calls :class:`OptimizerAwareScorer` at every step (see
:class:`~sb3_influence.common.round.CapturingStepHook`); its forward hooks keep each layer's input and the
per-record output gradient of the step's own backward pass, so the dot products are ghost dot products of
quantities the update computed anyway (the paper's Sec. 3 ghost trick, on the actual loss). Parameters no layer
scorer handles (``log_std``...) are scored by one forward-mode pass of the per-record loss. To cost little next to
the update, a step only keeps these quantities; the update map, the projection and the dot products of many steps
are computed together (see :class:`OptimizerAwareScorer`); ``benchmarks/inrun_cost.py`` measures the cost.

Not modelled: the dependence of Adam's denominator on the record (``∂v̂/∂g``), curvature between steps (each step's
change is carried to the end of the round unchanged), the coupling of records through per-minibatch advantage
normalisation, and momentum carried into later rounds (the look-ahead stops at the round's end: attribution is local).
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th
from torch import nn

from sb3_influence.common import sb3_compat
from sb3_influence.common.round import StepInfo
from sb3_influence.common.scoring.engine import InfluenceEngine
from sb3_influence.common.targets import Target

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


def _momentum_spread(beta: float, step: int, steps_left: int) -> float:
    """``(1 − β) Σ_{t<steps_left} β^t / (1 − β^(step+t))``: how much of one gradient a bias-corrected EMA carries."""
    t = np.arange(steps_left, dtype=np.float64)
    return float((1 - beta) * np.sum(beta**t / (1 - beta ** (step + t))))


class _Spreads:
    """
    :func:`_momentum_spread` for the steps of one round, computed once: step ``s`` with ``L`` steps left is
    followed by step ``s + 1`` with ``L − 1`` left, and ``S(s, L) = (1 − β) / (1 − β^s) + β S(s + 1, L − 1)``, so the
    first request fills the whole chain and the later steps' are look-ups.
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


def _flat(tensors: list[th.Tensor], out: th.Tensor | None = None) -> th.Tensor:
    """The tensors laid end to end (into ``out`` when given)."""
    return th.cat([tensor.reshape(-1) for tensor in tensors], out=out)


class _GroupSteps:
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
            _flat([th.zeros_like(p) if t is None else t for p, t in zip(self.params, values, strict=True)], out=rows[row])
        if self.weights is not None:
            _flat([param.detach() for param in self.params], out=self.weights[row])
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
        :param spreads: ``spreads(β, step, steps_left)``: :func:`_momentum_spread` or a cache of it (:class:`_Spreads`).
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
            steps = _GroupSteps(optimizer, group, params, 1, second_moment)
            steps.record(0, steps_left)
            grad = _flat([param.grad for param in params])[None]
            direction = steps.directions(grad, _flat([v[param] for param in params]), _momentum_spread)[0]
            for param, piece in zip(params, direction.split(steps.sizes), strict=True):
                out[param] = piece.view_as(param)
    return out


class _FlatLayout:
    """
    The parameters an update moves, laid end to end as one vector: those of each optimizer parameter group in
    turn (so that each group is one slice), then the policy's other trainable parameters.

    :param policy: The policy.
    :param optimizer: Its optimizer.
    """

    def __init__(self, policy: nn.Module, optimizer: th.optim.Optimizer):
        self.params: list[nn.Parameter] = []
        #: Per parameter group: the group, its parameters and their slice of the flat vector
        self.groups: list[tuple[dict[str, Any], list[nn.Parameter], slice]] = []
        start = 0
        for group in optimizer.param_groups:
            self.params += group["params"]
            size = sum(param.numel() for param in group["params"])
            self.groups.append((group, list(group["params"]), slice(start, start + size)))
            start += size
        in_optimizer = set(self.params)
        self.params += [param for param in policy.parameters() if param.requires_grad and param not in in_optimizer]
        self.index = {param: i for i, param in enumerate(self.params)}
        self.optimized = start  # the first elements, those the optimizer updates
        self.slices, start = [], 0
        for param in self.params:
            self.slices.append(slice(start, start + param.numel()))
            start += param.numel()
        self.size = start

    def flatten(self, tensors: list[th.Tensor | None]) -> th.Tensor:
        """One tensor per parameter (``None``: zeros), laid end to end."""
        return _flat([th.zeros_like(param) if t is None else t for param, t in zip(self.params, tensors, strict=True)])

    def view(self, flat: th.Tensor, i: int) -> th.Tensor:
        """Parameter ``i``'s piece of ``flat`` (``(..., size)``), shaped like it (``(..., *shape)``)."""
        return flat[..., self.slices[i]].reshape(*flat.shape[:-1], *self.params[i].shape)


class _Call:
    """One call of a scored layer during the update: its input, its output (and version), its output gradient."""

    __slots__ = ("grad", "inputs", "module", "output", "version")

    def __init__(self, module: nn.Module, inputs: th.Tensor, output: th.Tensor):
        self.module, self.inputs, self.output, self.version = module, inputs, output, output._version
        self.grad: th.Tensor | None = None

    def keep_grad(self, grad: th.Tensor) -> None:
        """Tensor hook on the output."""
        self.grad = grad


@dataclass
class _PendingStep:
    """A step whose direction is computed and whose ghost dot products wait to be computed with other steps'."""

    record_ids: np.ndarray
    factor: float  # −clip coefficient
    clipped: bool  # the gradient norm was clipped
    calls: list[tuple[nn.Module, th.Tensor, th.Tensor]]


class OptimizerAwareScorer:
    """
    Step hook accumulating the optimizer-aware in-run influence of every record (see the module docstring).

    At each step it only keeps what the step's scores need, in one row per step: the gradients laid end to end,
    the optimizer's state before the step (also laid end to end), the layers' inputs and output gradients. The
    scores of up to ``steps_per_batch`` steps (with minibatches of one size) are then computed together, when the
    rows are full, the minibatch size changes, the kept layer inputs and output gradients reach
    ``batch_elements`` numbers, or the update ends: the update map and the clip's projection of every row with a
    few in-place operations on ``(steps, parameters)`` matrices, and the ghost dot products with one batched call
    per scored layer (the layer scorer's ``dot_steps`` where it has one, else one ``dot`` per call). Parameters no
    layer scorer handles are scored at their step (forward mode needs that step's parameters).

    :param model: The influence algorithm (its policy, engine and ``record_losses``).
    :param target: The target f.
    :param batch_size: Records per chunk for target gradients.
    :param target_gradient: ``"fixed"``: ``v = ∇f(θ(k))`` for every step (cheap: one target gradient per round);
        ``"step"``: ``v = ∇f(θ_j)`` recomputed at every step (one target gradient per step).
    :param second_moment: Adam/AdamW: include the record's effect through the second-moment estimate.
    :param steps_per_batch: Steps whose ghost dot products are computed together, at most.
    :param batch_elements: Numbers (layer inputs and output gradients) kept for them, at most (memory).
    """

    def __init__(
        self,
        model: Any,
        target: Target,
        batch_size: int,
        target_gradient: str = "fixed",
        second_moment: bool = False,
        steps_per_batch: int = 64,
        batch_elements: int = 2**23,
    ):
        if target_gradient not in ("fixed", "step"):
            raise ValueError(f"target_gradient must be 'fixed' or 'step', got {target_gradient!r}")
        check_optimizer(model.policy.optimizer)
        self.model = model
        self.engine: InfluenceEngine = model.influence_engine
        self.target = target
        self.batch_size = batch_size
        self.target_gradient = target_gradient
        self.second_moment = second_moment
        self.steps_per_batch = max(1, int(steps_per_batch))
        self.batch_elements = batch_elements
        self._scores = th.zeros(self.engine.buffer.n_records, dtype=th.float64, device=self.engine.device)
        self._name_of = {param: name for name, param in model.policy.named_parameters()}  # they never change
        self._spreads = _Spreads()
        self._layout: _FlatLayout | None = None
        #: Per scored module: its layer scorer and the layout positions of its weight and bias
        self._layers: dict[nn.Module, tuple[Any, int | None, int | None]] = {}
        self._groups: list[tuple[_GroupSteps, slice]] = []  # the update map of each parameter group
        self._grads = th.zeros(0)  # one row per pending step: its gradients, laid out flat
        self._directions = th.zeros(0)  # ... and its direction M_jᵀ v (projected when the step was clipped)
        self._pending: list[_PendingStep] = []
        self._held = 0  # numbers kept by the pending steps' calls
        self._v: th.Tensor | None = None
        self._in_v: set[int] = set()
        self._calls: list[_Call] = []
        # Layers whose output nothing modified in place at the first step, and the others
        self._seen: set[nn.Module] = set()
        self._modified: set[nn.Module] = set()
        self._retained: set[nn.Module] = set()  # layers whose output gradient is kept by retain_grad
        self._recording = False

    @property
    def scores(self) -> np.ndarray:
        """Accumulated scores, flat by record id (float64)."""
        self._flush()
        return self._scores.cpu().numpy().copy()

    # ------------------------------------------------------------------ capture of the update's own passes
    @contextmanager
    def capture(self, policy: nn.Module) -> Iterator[None]:
        """Keep every scored layer's input and per-record output gradient of the update's steps."""
        handles = [
            module.register_forward_hook(self._on_forward) for module in policy.modules() if self.engine.layer_scorer(module)
        ]
        self._recording = True
        try:
            yield
            self._flush()
        finally:
            self._recording = False
            self._calls.clear()
            self._pending.clear()
            self._held = 0
            for handle in handles:
                handle.remove()

    def _on_forward(self, module: nn.Module, inputs: tuple[th.Tensor, ...], output: th.Tensor) -> None:
        if not self._recording or not isinstance(output, th.Tensor) or not output.requires_grad:
            return
        call = _Call(module, inputs[0], output)
        self._calls.append(call)
        if module in self._retained:
            output.retain_grad()  # (kept by autograd itself: no Python call in the backward pass)
        else:
            output.register_hook(call.keep_grad)

    def _output_gradients(self) -> list[tuple[nn.Module, th.Tensor, th.Tensor]]:
        """
        The step's layer calls with their output gradients. A layer's output gradient is kept by a tensor hook,
        which sees the output as the layer returned it; at the first step the layers whose output nothing modified
        in place are noted, and from then on their output keeps its ``.grad`` (``retain_grad``, cheaper), which is
        the same gradient as long as nothing modifies the output in place (checked at every step).
        """
        calls = []
        first = not self._seen
        for call in self._calls:
            modified = call.output._version != call.version
            if call.grad is None and call.module in self._retained:
                if modified:
                    raise RuntimeError(
                        f"optimizer_aware in-run scoring: the output of {call.module} was modified in place at this "
                        "optimiser step but not at the update's first, so its kept gradient is not the layer's. Use "
                        "out-of-place operations after scored layers (e.g. nn.ReLU(inplace=False))"
                    )
                call.grad = call.output.grad
            elif first:
                (self._modified if modified else self._seen).add(call.module)
            if call.grad is not None:
                calls.append((call.module, call.inputs, call.grad))
        if first:
            self._retained = self._seen - self._modified
        return calls

    # ------------------------------------------------------------------ one step
    def _prepare(self, optimizer: th.optim.Optimizer) -> _FlatLayout:
        """The flat layout of the parameters, the scored layers' positions in it, the direction rows (once)."""
        if self._layout is None:
            self._layout = layout = _FlatLayout(self.model.policy, optimizer)
            for module in self.model.policy.modules():
                scorer = self.engine.layer_scorer(module)
                if scorer is not None:
                    bias = getattr(module, "bias", None)
                    weight, bias = layout.index.get(module.weight), None if bias is None else layout.index.get(bias)
                    self._layers[module] = (scorer, weight, bias)
            first = layout.params[0]
            self._groups = [
                (_GroupSteps(optimizer, group, params, self.steps_per_batch, self.second_moment), where)
                for group, params, where in layout.groups
            ]
            self._grads = th.zeros(self.steps_per_batch, layout.size, dtype=first.dtype, device=first.device)
            self._directions = th.zeros_like(self._grads)
        return self._layout

    def _target_vector(self, layout: _FlatLayout) -> th.Tensor | None:
        """``v`` laid out as the layout's flat vector (``None`` when f depends on no parameter)."""
        if self._v is None or self.target_gradient == "step":
            with th.enable_grad(), self.engine.eval_mode():
                v = self.engine.target_gradient(self.target, self.batch_size)
            names = [self._name_of.get(param) for param in layout.params]
            self._in_v = {i for i, name in enumerate(names) if name in v}
            self._v = layout.flatten([v.get(name) if name is not None else None for name in names]) if v else None
        return self._v

    def __call__(self, info: StepInfo) -> None:
        self._recording = False
        try:
            with th.no_grad():
                self._score_step(info)
        finally:
            self._calls.clear()
            self._recording = True

    def _score_step(self, info: StepInfo) -> None:
        layout = self._prepare(info.optimizer)
        v = self._target_vector(layout)
        if v is None:
            return
        pending = self._pending
        if pending and (
            len(pending) == self.steps_per_batch
            or len(info.record_ids) != len(pending[0].record_ids)
            or self._held >= self.batch_elements
        ):
            self._flush()
            pending = self._pending
        row = len(pending)
        grads = [param.grad for param in layout.params]
        _flat([th.zeros_like(p) if g is None else g for p, g in zip(layout.params, grads, strict=True)], out=self._grads[row])
        for steps, _ in self._groups:
            steps.record(row, info.total_steps - info.step)
        clipped = info.clip_coef < 1.0
        # Without the clip's projection only the parameters f depends on have a direction (zero elsewhere)
        moved = None if clipped else self._in_v
        calls = []
        covered: set[int | None] = set()
        for module, inputs, grad_out in self._output_gradients():
            _, weight, bias = self._layers[module]
            covered.update((weight, bias))
            if moved is None or weight in moved or bias in moved:
                calls.append((module, inputs, grad_out))
                self._held += inputs.numel() + grad_out.numel()
        pending.append(_PendingStep(info.record_ids, -info.clip_coef, clipped, calls))
        rest = [
            i
            for i, param in enumerate(layout.params)
            if i not in covered and (moved is None or i in moved) and param in self._name_of
        ]
        if rest or self.target_gradient == "step":
            # Forward mode needs the parameters of this step, and v changes at every step: score the step now
            self._flush()
        if rest:
            direction = {self._name_of[layout.params[i]]: layout.view(self._directions[row], i) for i in rest}
            ids = th.as_tensor(info.record_ids, device=self._scores.device)
            self._scores.index_add_(0, ids, self._forward_mode(direction, info).double(), alpha=-info.clip_coef)

    def _flush(self) -> None:
        """Score the pending steps: their directions at once, then one batched ghost dot product per layer."""
        pending, self._pending, self._held = self._pending, [], 0
        if not pending or self._layout is None or self._v is None:
            return
        with th.no_grad():
            self._score_pending(pending, self._layout, self._v)

    def _score_pending(self, pending: list[_PendingStep], layout: _FlatLayout, v: th.Tensor) -> None:
        grads, directions = self._grads[: len(pending)], self._directions[: len(pending)]
        if layout.optimized < layout.size:
            directions[:, layout.optimized :] = 0  # parameters the optimizer does not move
        for steps, where in self._groups:
            steps.directions(grads[:, where], v[where], self._spreads, out=directions[:, where])
        if any(item.clipped for item in pending):
            # A clipped step has a fixed norm: only the part of a record's gradient orthogonal to ĝ moves it
            clipped = th.tensor([item.clipped for item in pending], device=grads.device)
            along = th.linalg.vecdot(grads, directions) / th.linalg.vecdot(grads, grads)
            directions.addcmul_(grads, th.where(clipped, along, th.zeros_like(along))[:, None], value=-1)
        # The calls of each layer (and input and output shape), with the steps they belong to
        batches: dict[tuple[Any, ...], tuple[list[int], list[th.Tensor], list[th.Tensor]]] = {}
        for step, item in enumerate(pending):
            for module, inputs, grad_out in item.calls:
                steps_of, inputs_, grad_outs = batches.setdefault((module, inputs.shape, grad_out.shape), ([], [], []))
                steps_of.append(step)
                inputs_.append(inputs)
                grad_outs.append(grad_out)
        contribution = th.zeros(len(pending), len(pending[0].record_ids), dtype=th.float64, device=self._scores.device)
        for (module, _, _), (steps_of, inputs_, grad_outs) in batches.items():
            scorer, weight, bias = self._layers[module]
            rows = directions if steps_of == list(range(len(pending))) else directions[steps_of]
            d_weight = None if weight is None else layout.view(rows, weight)
            d_bias = None if bias is None else layout.view(rows, bias)
            dot_steps = getattr(scorer, "dot_steps", None)
            if dot_steps is not None:
                dots = dot_steps(module, th.stack(inputs_), th.stack(grad_outs), d_weight, d_bias)
            else:
                dots = th.stack(
                    [
                        scorer.dot(
                            module, x, g, None if d_weight is None else d_weight[e], None if d_bias is None else d_bias[e]
                        )
                        for e, (x, g) in enumerate(zip(inputs_, grad_outs, strict=True))
                    ]
                )
            contribution.index_add_(0, th.as_tensor(steps_of, device=contribution.device), dots.double())
        factors = th.tensor([item.factor for item in pending], dtype=th.float64, device=contribution.device)
        ids = th.as_tensor(np.concatenate([item.record_ids for item in pending]), device=self._scores.device)
        self._scores.index_add_(0, ids, (contribution * factors[:, None]).reshape(-1))

    def _forward_mode(self, direction: dict[str, th.Tensor], info: StepInfo) -> th.Tensor:
        """``⟨∇ℓ_i / |B|, d⟩`` for the parameters no layer scorer handled, by one jvp of the per-record loss."""
        names = list(direction)
        named = dict(self.model.policy.named_parameters())
        module = _RecordLosses(self.model)
        arguments = (info.samples, info.advantages, info.clip_range)

        def losses(*values: th.Tensor) -> th.Tensor:
            params = {f"policy.{name}": value for name, value in zip(names, values, strict=True)}
            # tie_weights=False: a shared features extractor is reachable under several names (see the engine)
            return th.func.functional_call(module, params, arguments, tie_weights=False) / len(info.record_ids)

        primals = tuple(named[name].detach() for name in names)
        tangents = tuple(direction[name] for name in names)
        return th.func.jvp(losses, primals, tangents)[1]


class _RecordLosses(nn.Module):
    """``forward(samples, advantages, clip_range) = model.record_losses(...)``, so ``functional_call`` can swap params."""

    def __init__(self, model: Any):
        super().__init__()
        self.policy = model.policy
        self.__dict__["_model"] = model

    def forward(self, samples: Any, advantages: th.Tensor, clip_range: float) -> th.Tensor:
        model = self.__dict__["_model"]
        progress = sb3_compat.progress_remaining(model)
        clip_range_vf = None if model.clip_range_vf is None else model.clip_range_vf(progress)
        return model.record_losses(samples, advantages, clip_range, clip_range_vf)
