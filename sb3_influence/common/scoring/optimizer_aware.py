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
:class:`~sb3_influence.common.round.CapturingStepHook`); its forward hooks keep each layer's input and its tensor
hooks the per-record output gradient of the step's own backward pass, so the dot products are ghost dot products
of quantities the update computed anyway (the paper's Sec. 3 ghost trick, on the actual loss). Parameters no layer
scorer handles (``log_std``...) are scored by one forward-mode pass of the per-record loss.

Not modelled: the dependence of Adam's denominator on the record (``∂v̂/∂g``), curvature between steps (each step's
change is carried to the end of the round unchanged), the coupling of records through per-minibatch advantage
normalisation, and momentum carried into later rounds (the look-ahead stops at the round's end: attribution is local).
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def _flat(tensors: list[th.Tensor]) -> th.Tensor:
    """The tensors laid end to end."""
    return th.cat([tensor.reshape(-1) for tensor in tensors])


def _flat_state(optimizer: th.optim.Optimizer, params: list[nn.Parameter], key: str) -> th.Tensor:
    """The optimizer's state ``key`` of ``params`` laid end to end, a new tensor (zeros where there is none yet)."""
    states = [optimizer.state.get(param, {}).get(key) for param in params]
    return _flat([th.zeros_like(param) if state is None else state for param, state in zip(params, states, strict=True)])


def _per_parameter(values: list[float], params: list[nn.Parameter]) -> float | th.Tensor:
    """One number per parameter: that number when they are all equal (the usual case), else a flat tensor."""
    if all(value == values[0] for value in values):
        return values[0]
    return _flat([th.full_like(param, value) for param, value in zip(params, values, strict=True)])


def _group_map(
    optimizer: th.optim.Optimizer,
    group: dict[str, Any],
    params: list[nn.Parameter],
    grad: th.Tensor,
    v: th.Tensor,
    steps_left: int,
    second_moment: bool,
    spreads: Callable[[float, int, int], float] = _momentum_spread,
) -> th.Tensor:
    """
    ``M_jᵀ v`` for some parameters of one parameter group, on flat vectors (see :func:`update_map`).

    :param optimizer: The optimizer (its state before this step).
    :param group: The parameter group.
    :param params: The parameters, in the order of ``grad`` and ``v``.
    :param grad: This step's gradients of ``params``, laid end to end (not modified).
    :param v: The direction for ``params``, laid end to end (not modified).
    :param steps_left: Steps of the round from this one on (≥ 1).
    :param second_moment: See :func:`update_map`.
    :param spreads: ``spreads(β, step, steps_left)``: :func:`_momentum_spread` or a cache of it (:class:`_Spreads`).
    :return: ``M_jᵀ v``, laid end to end.
    """
    lr = float(group["lr"])
    if isinstance(optimizer, (th.optim.Adam, th.optim.AdamW)):
        beta1, beta2 = group["betas"]
        # Adam's L2 penalty enters the moments; AdamW's decay is decoupled (recent torch: AdamW subclasses Adam)
        decoupled = isinstance(optimizer, th.optim.AdamW) or group.get("decoupled_weight_decay", False)
        if group["weight_decay"] and not decoupled:
            grad = grad + group["weight_decay"] * _flat([param.detach() for param in params])
        steps = [int(optimizer.state.get(param, {}).get("step", 0)) + 1 for param in params]
        # The second-moment estimate and the denominator this step will use, with Adam's own expressions
        exp_avg_sq = _flat_state(optimizer, params, "exp_avg_sq").mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group.get("amsgrad", False):
            # (zeros where there is no maximum yet: the estimate is never negative)
            exp_avg_sq = th.maximum(_flat_state(optimizer, params, "max_exp_avg_sq"), exp_avg_sq)
        root = exp_avg_sq.sqrt_().div_(_per_parameter([math.sqrt(1 - beta2**step) for step in steps], params))
        denominator = root + group["eps"] if second_moment else root.add_(group["eps"])
        # Bias-corrected momentum spreads this step's gradient over the rest of the round
        spread = _per_parameter([spreads(beta1, step, steps_left) for step in steps], params)
        direction = th.div(v, denominator).mul_(spread * lr)
        if second_moment:
            # The gradient also enters v̂, the denominator of this and the later steps:
            # ∂(m̂/(√v̂+ε))/∂v̂ = −m̂ / (2√v̂ (√v̂+ε)²), ∂v̂_t/∂g_j = 2(1−β2)β2^(t−j) g_j / (1−β2^s_t)
            exp_avg = _flat_state(optimizer, params, "exp_avg") * beta1 + (1 - beta1) * grad
            m_hat = exp_avg / _per_parameter([1 - beta1**step for step in steps], params)
            spread_v = _per_parameter([spreads(beta2, step, steps_left) for step in steps], params)
            safe_root = th.where(root > 0, root, th.ones_like(root))
            direction = direction - lr * spread_v * m_hat * grad * v / (safe_root * denominator**2)
        return direction
    if isinstance(optimizer, th.optim.SGD):
        momentum, dampening = float(group["momentum"]), float(group["dampening"])
        if momentum == 0:
            return lr * v
        # torch: buf = g on the first step, else momentum · buf + (1 − dampening) · g
        geometric = sum(momentum**t for t in range(steps_left))
        spreads_sgd = []
        for param in params:
            first = (1.0 if optimizer.state.get(param, {}).get("momentum_buffer") is None else 1 - dampening) * geometric
            spreads_sgd.append(1 + momentum * first if group["nesterov"] else first)
        return lr * _per_parameter(spreads_sgd, params) * v
    # RMSprop
    alpha = float(group["alpha"])
    if group["weight_decay"]:
        grad = grad + group["weight_decay"] * _flat([param.detach() for param in params])
    square_avg = _flat_state(optimizer, params, "square_avg") * alpha + (1 - alpha) * grad * grad
    if group["centered"]:
        grad_avg = _flat_state(optimizer, params, "grad_avg") * alpha + (1 - alpha) * grad
        square_avg = square_avg - grad_avg * grad_avg
    momentum = float(group["momentum"])
    spread = 1.0 if momentum == 0 else sum(momentum**t for t in range(steps_left))
    return lr * spread * v / (square_avg.sqrt() + group["eps"])


def update_map(
    optimizer: th.optim.Optimizer, v: dict[nn.Parameter, th.Tensor], steps_left: int, second_moment: bool = False
) -> dict[nn.Parameter, th.Tensor]:
    """
    ``M_jᵀ v`` for the optimiser step about to be taken (called after ``backward()`` and clipping, before
    ``optimizer.step()``): how a unit change of this step's gradient moves the parameters, summed over this step
    and the ``steps_left − 1`` later steps of the round its momentum reaches. ``M_j`` is diagonal, so it is its
    own transpose. Each parameter group is computed at once, on its parameters laid end to end.

    :param optimizer: The optimizer (its hyperparameters, its state before this step, and ``p.grad`` of this step).
    :param v: Direction per parameter (the target gradient).
    :param steps_left: Steps of the round from this one on (≥ 1).
    :param second_moment: Adam/AdamW: include the gradient's effect through the second-moment estimate v̂ (the
        denominator), not only through the momentum (measured: no change of the LDS, so off by default).
    :return: ``M_jᵀ v`` per parameter of ``v`` that the optimizer updates.
    """
    check_optimizer(optimizer)
    steps_left = max(1, int(steps_left))
    out: dict[nn.Parameter, th.Tensor] = {}
    with th.no_grad():
        for group in optimizer.param_groups:
            params = [param for param in group["params"] if param in v and param.grad is not None]
            if not params:
                continue
            grad, direction = _flat([param.grad for param in params]), _flat([v[param] for param in params])
            direction = _group_map(optimizer, group, params, grad, direction, steps_left, second_moment)
            for param, piece in zip(params, direction.split([param.numel() for param in params]), strict=True):
                out[param] = piece.view_as(param)
    return out


class _FlatLayout:
    """
    The parameters an update moves, laid end to end as one vector: those of each optimizer parameter group in
    turn (so that each group is one slice), then the policy's other trainable parameters. :attr:`direction` is a
    buffer of that size and :attr:`views` its piece of each parameter, shaped like it.

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
        sizes = [param.numel() for param in self.params]
        first = self.params[0]
        self.direction = th.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        self.views = [piece.view_as(param) for piece, param in zip(self.direction.split(sizes), self.params, strict=True)]

    def flatten(self, tensors: list[th.Tensor | None]) -> th.Tensor:
        """One tensor per parameter (``None``: zeros), laid end to end."""
        return _flat([th.zeros_like(param) if t is None else t for param, t in zip(self.params, tensors, strict=True)])


class OptimizerAwareScorer:
    """
    Step hook accumulating the optimizer-aware in-run influence of every record (see the module docstring).

    Each step works on the parameters laid end to end: one vector for the gradients, one computation of the
    update map per parameter group and one for the clip's projection; then one ghost dot product per scored layer
    call, the weight and bias terms at once.

    :param model: The influence algorithm (its policy, engine and ``record_losses``).
    :param target: The target f.
    :param batch_size: Records per chunk for target gradients.
    :param target_gradient: ``"fixed"``: ``v = ∇f(θ(k))`` for every step (cheap: one target gradient per round);
        ``"step"``: ``v = ∇f(θ_j)`` recomputed at every step (one target gradient per step).
    :param second_moment: Adam/AdamW: include the record's effect through the second-moment estimate.
    """

    def __init__(
        self, model: Any, target: Target, batch_size: int, target_gradient: str = "fixed", second_moment: bool = False
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
        self._scores = th.zeros(self.engine.buffer.n_records, dtype=th.float64, device=self.engine.device)
        self._name_of = {param: name for name, param in model.policy.named_parameters()}  # they never change
        self._spreads = _Spreads()
        self._layout: _FlatLayout | None = None
        #: Per scored module: its layer scorer and the layout positions of its weight and bias
        self._layers: dict[nn.Module, tuple[Any, int | None, int | None]] = {}
        self._v: th.Tensor | None = None
        self._in_v: set[int] = set()
        self._calls: list[list[Any]] = []
        self._recording = False

    @property
    def scores(self) -> np.ndarray:
        """Accumulated scores, flat by record id (float64)."""
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
        finally:
            self._recording = False
            self._calls.clear()
            for handle in handles:
                handle.remove()

    def _on_forward(self, module: nn.Module, inputs: tuple[th.Tensor, ...], output: th.Tensor) -> None:
        if not self._recording or not isinstance(output, th.Tensor) or not output.requires_grad:
            return
        call = [module, inputs[0], None]
        self._calls.append(call)

        def keep_grad(grad: th.Tensor, call: list[Any] = call) -> None:
            call[2] = grad

        output.register_hook(keep_grad)

    # ------------------------------------------------------------------ one step
    def _prepare(self, optimizer: th.optim.Optimizer) -> _FlatLayout:
        """The flat layout of the parameters and the layout positions of the scored layers' (once per update)."""
        if self._layout is None:
            self._layout = layout = _FlatLayout(self.model.policy, optimizer)
            for module in self.model.policy.modules():
                scorer = self.engine.layer_scorer(module)
                if scorer is not None:
                    bias = getattr(module, "bias", None)
                    weight, bias = layout.index.get(module.weight), None if bias is None else layout.index.get(bias)
                    self._layers[module] = (scorer, weight, bias)
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
        steps_left = max(1, info.total_steps - info.step)
        grad = layout.flatten([param.grad for param in layout.params])
        direction = layout.direction
        if layout.optimized < len(direction):
            direction[layout.optimized :] = 0  # parameters the optimizer does not move (the projection may add some)
        for group, params, where in layout.groups:
            part = _group_map(
                info.optimizer, group, params, grad[where], v[where], steps_left, self.second_moment, self._spreads
            )
            direction[where] = part
        clipped = info.clip_coef < 1.0
        if clipped:
            # The clipped step has a fixed norm: only the part of a record's gradient orthogonal to ĝ moves it
            direction.addcmul_(grad, th.dot(grad, direction) / th.dot(grad, grad), value=-1)
        # Without the clip's projection only the parameters f depends on have a direction
        moved = None if clipped else self._in_v
        views = layout.views
        dots = []
        covered: set[int] = set()
        for module, inputs, grad_out in self._calls:
            if grad_out is None:
                continue
            scorer, weight, bias = self._layers[module]
            covered.update((weight, bias))
            if moved is not None:
                weight, bias = (weight if weight in moved else None), (bias if bias in moved else None)
            if weight is None and bias is None:
                continue
            d_weight, d_bias = (None if weight is None else views[weight]), (None if bias is None else views[bias])
            dots.append(scorer.dot(module, inputs, grad_out, d_weight, d_bias))
        rest = {
            self._name_of[param]: views[i]
            for i, param in enumerate(layout.params)
            if i not in covered and (moved is None or i in moved) and param in self._name_of
        }
        if rest:
            dots.append(self._forward_mode(rest, info))
        if dots:
            contribution = th.stack(dots).sum(dim=0, dtype=th.float64)
            ids = th.as_tensor(info.record_ids, device=self._scores.device)
            self._scores.index_add_(0, ids, contribution, alpha=-info.clip_coef)

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
