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

from collections.abc import Iterator
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


def update_map(
    optimizer: th.optim.Optimizer, v: dict[nn.Parameter, th.Tensor], steps_left: int, second_moment: bool = True
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
        denominator), not only through the momentum.
    :return: ``M_jᵀ v`` per parameter of ``v`` that the optimizer updates.
    """
    check_optimizer(optimizer)
    steps_left = max(1, int(steps_left))
    out: dict[nn.Parameter, th.Tensor] = {}
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        for param in group["params"]:
            if param not in v or param.grad is None:
                continue
            state = optimizer.state.get(param, {})
            grad = param.grad
            if isinstance(optimizer, (th.optim.Adam, th.optim.AdamW)):
                beta1, beta2 = group["betas"]
                # Adam's L2 penalty enters the moments; AdamW's decay is decoupled (recent torch: AdamW subclasses Adam)
                decoupled = isinstance(optimizer, th.optim.AdamW) or group.get("decoupled_weight_decay", False)
                if group["weight_decay"] and not decoupled:
                    grad = grad + group["weight_decay"] * param.detach()
                step = int(state.get("step", 0)) + 1
                exp_avg_sq = state.get("exp_avg_sq", th.zeros_like(param)) * beta2 + (1 - beta2) * grad * grad
                if group.get("amsgrad", False) and "max_exp_avg_sq" in state:
                    exp_avg_sq = th.maximum(state["max_exp_avg_sq"], exp_avg_sq)
                root = (exp_avg_sq / (1 - beta2**step)).sqrt()
                denominator = root + group["eps"]
                # Bias-corrected momentum spreads this step's gradient over the rest of the round
                spread = (1 - beta1) * sum(beta1**t / (1 - beta1 ** (step + t)) for t in range(steps_left))
                direction = lr * spread * v[param] / denominator
                if second_moment:
                    # The gradient also enters v̂, the denominator of this and the later steps:
                    # ∂(m̂/(√v̂+ε))/∂v̂ = −m̂ / (2√v̂ (√v̂+ε)²), ∂v̂_t/∂g_j = 2(1−β2)β2^(t−j) g_j / (1−β2^s_t)
                    exp_avg = state.get("exp_avg", th.zeros_like(param)) * beta1 + (1 - beta1) * grad
                    m_hat = exp_avg / (1 - beta1**step)
                    spread_v = (1 - beta2) * sum(beta2**t / (1 - beta2 ** (step + t)) for t in range(steps_left))
                    safe_root = th.where(root > 0, root, th.ones_like(root))
                    direction = direction - lr * spread_v * m_hat * grad * v[param] / (safe_root * denominator**2)
                out[param] = direction
            elif isinstance(optimizer, th.optim.SGD):
                momentum, dampening = float(group["momentum"]), float(group["dampening"])
                if momentum == 0:
                    spread = 1.0
                else:
                    # torch: buf = g on the first step, else momentum · buf + (1 − dampening) · g
                    first = (1.0 if state.get("momentum_buffer") is None else 1 - dampening) * sum(
                        momentum**t for t in range(steps_left)
                    )
                    spread = 1 + momentum * first if group["nesterov"] else first
                out[param] = lr * spread * v[param]
            else:  # RMSprop
                alpha = float(group["alpha"])
                if group["weight_decay"]:
                    grad = grad + group["weight_decay"] * param.detach()
                square_avg = state.get("square_avg", th.zeros_like(param)) * alpha + (1 - alpha) * grad * grad
                if group["centered"]:
                    grad_avg = state.get("grad_avg", th.zeros_like(param)) * alpha + (1 - alpha) * grad
                    square_avg = square_avg - grad_avg * grad_avg
                momentum = float(group["momentum"])
                spread = 1.0 if momentum == 0 else sum(momentum**t for t in range(steps_left))
                out[param] = lr * spread * v[param] / (square_avg.sqrt() + group["eps"])
    return out


class OptimizerAwareScorer:
    """
    Step hook accumulating the optimizer-aware in-run influence of every record (see the module docstring).

    :param model: The influence algorithm (its policy, engine and ``record_losses``).
    :param target: The target f.
    :param batch_size: Records per chunk for target gradients.
    :param target_gradient: ``"fixed"``: ``v = ∇f(θ(k))`` for every step (cheap: one target gradient per round);
        ``"step"``: ``v = ∇f(θ_j)`` recomputed at every step (one target gradient per step).
    :param second_moment: Adam/AdamW: include the record's effect through the second-moment estimate.
    :ivar scores: Accumulated scores, flat by record id.
    """

    def __init__(
        self, model: Any, target: Target, batch_size: int, target_gradient: str = "fixed", second_moment: bool = True
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
        self.scores = np.zeros(self.engine.buffer.n_records, dtype=np.float64)
        self._v: dict[str, th.Tensor] | None = None
        self._calls: list[list[Any]] = []
        self._recording = False

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
        call = [module, inputs[0].detach(), None]
        self._calls.append(call)

        def keep_grad(grad: th.Tensor, call: list[Any] = call) -> None:
            call[2] = grad.detach()

        output.register_hook(keep_grad)

    # ------------------------------------------------------------------ one step
    def _target_gradient(self) -> dict[str, th.Tensor]:
        if self._v is None or self.target_gradient == "step":
            with self.engine.eval_mode():
                self._v = self.engine.target_gradient(self.target, self.batch_size)
        return self._v

    def __call__(self, info: StepInfo) -> None:
        self._recording = False
        try:
            self._score_step(info)
        finally:
            self._calls.clear()
            self._recording = True

    def _score_step(self, info: StepInfo) -> None:
        named = dict(self.model.policy.named_parameters())
        v = self._target_gradient()
        if not v:
            return
        direction = update_map(
            info.optimizer, {named[name]: value for name, value in v.items()}, info.total_steps - info.step, self.second_moment
        )
        if info.clip_coef < 1.0:
            # The clipped step has a fixed norm: only the part of a record's gradient orthogonal to ĝ moves it
            grads = [p.grad for p in self.model.policy.parameters() if p.grad is not None]
            norm = th.linalg.vector_norm(th.stack([th.linalg.vector_norm(g) for g in grads]))
            along = th.stack([(p.grad * d).sum() for p, d in direction.items() if p.grad is not None]).sum() / norm**2
            direction = {p: d - along * p.grad for p, d in direction.items()}
            for p in self.model.policy.parameters():
                if p.grad is not None and p not in direction:
                    direction[p] = -along * p.grad
        contribution = th.zeros(len(info.record_ids), dtype=th.float64, device=self.engine.device)
        covered: set[nn.Parameter] = set()
        for module, inputs, grad_out in self._calls:
            if grad_out is None:
                continue
            weight, bias = module.weight, getattr(module, "bias", None)
            d_weight, d_bias = direction.get(weight), direction.get(bias) if bias is not None else None
            covered.update(p for p in (weight, bias) if p is not None)
            if d_weight is None and d_bias is None:
                continue
            scorer = self.engine.layer_scorer(module)
            assert scorer is not None
            contribution += scorer.dot(module, inputs, grad_out, d_weight, d_bias).double()
        rest = {name: direction[p] for name, p in named.items() if p in direction and p not in covered}
        if rest:
            contribution += self._forward_mode(rest, info).double()
        self.scores[info.record_ids] -= info.clip_coef * contribution.cpu().numpy()

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
        with th.no_grad():
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
