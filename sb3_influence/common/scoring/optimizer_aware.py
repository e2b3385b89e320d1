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

with ``M_j`` the linearised update map of the optimizer at step j (:mod:`~sb3_influence.common.scoring.update_maps`):
``η`` for SGD; ``η`` times the momentum's geometric sum over the round's remaining steps for SGD with momentum; for
Adam/AdamW ``η (1−β1) Σ_{t=j}^{J−1} β1^{t−j} / (1−β1^{s+t−j})`` divided elementwise by ``√v̂_j + ε`` (the
second-moment estimate including this step's gradient, held fixed over the look-ahead); for RMSprop
``η / (√v_j + ε)``. Like the
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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th
from torch import nn

from sb3_influence.common import sb3_compat
from sb3_influence.common.round import StepInfo
from sb3_influence.common.scoring.engine import InfluenceEngine
from sb3_influence.common.scoring.update_maps import (
    SUPPORTED_OPTIMIZERS,
    GroupSteps,
    Spreads,
    check_optimizer,
    flatten_tensors,
    update_map,
)
from sb3_influence.common.targets import Target

# The update map lives in its own module; these names stay importable from here
__all__ = ["SUPPORTED_OPTIMIZERS", "OptimizerAwareScorer", "check_optimizer", "update_map"]


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
        return flatten_tensors(
            [th.zeros_like(param) if t is None else t for param, t in zip(self.params, tensors, strict=True)]
        )

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
    :param batch_elements: Numbers kept for them, at most (memory): layer inputs and output gradients, and per step
        a row of gradients, directions and optimizer state (about 4 parameter-sized rows, so a large network is
        scored fewer steps at a time).
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
        self._spreads = Spreads()
        self._layout: _FlatLayout | None = None
        #: Per scored module: its layer scorer and the layout positions of its weight and bias
        self._layers: dict[nn.Module, tuple[Any, int | None, int | None]] = {}
        self._groups: list[tuple[GroupSteps, slice]] = []  # the update map of each parameter group
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
        call = _Call(module, inputs[0].detach(), output)
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
            # The rows of gradients and directions count against the memory cap too
            self._rows = max(1, min(self.steps_per_batch, self.batch_elements // max(1, 4 * layout.size)))
            self._groups = [
                (GroupSteps(optimizer, group, params, self._rows, self.second_moment), where)
                for group, params, where in layout.groups
            ]
            self._grads = th.zeros(self._rows, layout.size, dtype=first.dtype, device=first.device)
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
            len(pending) == self._rows
            or len(info.record_ids) != len(pending[0].record_ids)
            or self._held >= self.batch_elements
        ):
            self._flush()
            pending = self._pending
        row = len(pending)
        grads = [param.grad for param in layout.params]
        flatten_tensors(
            [th.zeros_like(p) if g is None else g for p, g in zip(layout.params, grads, strict=True)], out=self._grads[row]
        )
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
        clipped = [step for step, item in enumerate(pending) if item.clipped]
        if clipped:
            # A clipped step has a fixed norm: only the part of a record's gradient orthogonal to ĝ moves it
            # (projected in place when every step was clipped, else on a copy of the clipped steps' rows only)
            rows = None if len(clipped) == len(pending) else th.tensor(clipped, device=grads.device)
            grad, direction = (grads, directions) if rows is None else (grads[rows], directions[rows])
            along = th.linalg.vecdot(grad, direction) / th.linalg.vecdot(grad, grad)
            direction.addcmul_(grad, along[:, None], value=-1)
            if rows is not None:
                directions.index_copy_(0, rows, direction)
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
