"""
Per-layer scorers: the ghost dot product for layers that are linear in their parameters.

For a layer ``y = layer(x; W, b)`` that is linear in ``(W, b)``, record i's parameter gradient of a summed loss
is determined by its input ``x_i`` and output gradient ``g_i = ∂ℓ_i/∂y_i``, and its dot product with a direction
``(P, p_b)`` in parameter space is ``⟨g_i, layer(x_i; P, 0)⟩ + ⟨Σ_positions g_i, p_b⟩`` — no per-record gradient
is ever built (the paper's Sec. 3 "ghost" computation, generalised beyond Linear layers).

A :class:`LayerScorer` says which modules it handles and computes that dot product for one layer call. The
engine takes an ordered list of them (``InfluencePPO(influence_layer_scorers=...)``); parameters in no handled
layer (``log_std``, layer norms, embeddings...) go through the exact forward-mode path instead. To score a layer
type of your own, pass an object implementing the protocol; nothing in the package needs editing.

A scorer may also define ``dot_steps(module, inputs, grad_out, v_weight, v_bias)``: the same dot products for ``E``
calls of the layer at once, each with its own direction (every argument gains a leading dimension ``E``; the
result is ``(E, n)``). The in-run optimizer-aware scorer uses it to score many optimiser steps in one batched
call instead of a few small calls per step; without it, it calls ``dot`` once per call. :class:`LinearScorer` has
it; :class:`ConvScorer` does not (on CPUs neither a grouped convolution nor ``unfold`` beat one call at a time).
"""

from typing import Protocol, runtime_checkable

import torch as th
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class LayerScorer(Protocol):
    """Ghost dot products for one kind of layer."""

    def handles(self, module: nn.Module) -> bool:
        """True when this scorer computes exact dot products for ``module``'s ``weight`` and ``bias``."""
        ...

    def dot(
        self, module: nn.Module, inputs: th.Tensor, grad_out: th.Tensor, v_weight: th.Tensor | None, v_bias: th.Tensor | None
    ) -> th.Tensor:
        """
        ``⟨∂ℓ_i/∂W, v_W⟩ + ⟨∂ℓ_i/∂b, v_b⟩`` for every record of one layer call.

        :param module: The layer.
        :param inputs: Its input, ``(n, ...)``.
        :param grad_out: ``∂(Σ_i ℓ_i)/∂output``, ``(n, ...)``: row i is record i's own output gradient.
        :param v_weight: The direction for the weight (``None``: not scored).
        :param v_bias: The direction for the bias (``None``: no bias, or not scored).
        :return: Shape ``(n,)``.
        """
        ...


class LinearScorer:
    """``nn.Linear`` (any number of leading dimensions): ``((x_i Pᵀ) ⊙ g_i).sum() + Σ g_i · p_b``."""

    def handles(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def dot(
        self, module: nn.Module, inputs: th.Tensor, grad_out: th.Tensor, v_weight: th.Tensor | None, v_bias: th.Tensor | None
    ) -> th.Tensor:
        n = inputs.shape[0]
        if v_weight is None:
            if v_bias is None:
                return th.zeros(n, dtype=grad_out.dtype, device=grad_out.device)
            return grad_out.reshape(n, -1, grad_out.shape[-1]).sum(dim=1) @ v_bias
        # The layer applied to x_i with (P, p_b): ⟨g_i, x_i Pᵀ + p_b⟩ is both terms at once
        return th.linalg.vecdot(F.linear(inputs, v_weight, v_bias).reshape(n, -1), grad_out.reshape(n, -1))

    def dot_steps(
        self, module: nn.Module, inputs: th.Tensor, grad_out: th.Tensor, v_weight: th.Tensor | None, v_bias: th.Tensor | None
    ) -> th.Tensor:
        """:meth:`dot` for ``E`` calls at once: ``inputs (E, n, ..., in)``, ``v_weight (E, out, in)``... → ``(E, n)``."""
        calls, n = inputs.shape[:2]
        x = inputs.reshape(calls, -1, inputs.shape[-1])
        g = grad_out.reshape(calls, -1, grad_out.shape[-1])
        if v_weight is None:
            if v_bias is None:
                return th.zeros(calls, n, dtype=grad_out.dtype, device=grad_out.device)
            per_position = th.linalg.vecdot(g, v_bias.unsqueeze(1))
        elif v_bias is None:
            per_position = th.linalg.vecdot(th.bmm(x, v_weight.transpose(1, 2)), g)
        else:
            per_position = th.linalg.vecdot(th.baddbmm(v_bias.unsqueeze(1), x, v_weight.transpose(1, 2)), g)
        return per_position if inputs.dim() == 3 else per_position.reshape(calls, n, -1).sum(dim=2)


class ConvScorer:
    """
    ``nn.Conv1d/2d/3d``: ``⟨g_i x_iᵀ, P⟩`` (summed over positions) is ``⟨g_i, conv(x_i; P)⟩``, one convolution of the
    input with ``P``: the ``unfold`` identity without building the patches. The layer's own ``_conv_forward``
    applies its strides, dilation, groups and padding mode.
    """

    def handles(self, module: nn.Module) -> bool:
        return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))

    def dot(
        self, module: nn.Module, inputs: th.Tensor, grad_out: th.Tensor, v_weight: th.Tensor | None, v_bias: th.Tensor | None
    ) -> th.Tensor:
        n = inputs.shape[0]
        if v_weight is None:
            if v_bias is None:
                return th.zeros(n, dtype=grad_out.dtype, device=grad_out.device)
            return grad_out.reshape(n, grad_out.shape[1], -1).sum(dim=2) @ v_bias
        # The layer applied to x_i with (P, p_b): the bias term ⟨Σ_positions g_i, p_b⟩ comes with it
        direction = module._conv_forward(inputs, v_weight, v_bias)  # type: ignore[operator]
        return th.linalg.vecdot(direction.reshape(n, -1), grad_out.reshape(n, -1))


#: The scorers used unless a model is given others.
DEFAULT_LAYER_SCORERS: tuple[LayerScorer, ...] = (LinearScorer(), ConvScorer())
