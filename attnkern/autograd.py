"""Autograd for the attnkern ops: one torch.autograd.Function per op family.

The compiled ops are plain (non-differentiable) primitives; these Functions
save what the backward needs (the output p, and α) and call the matching
`_bwd` op.
"""

from __future__ import annotations

import torch

_ops = torch.ops.attnkern


class _FixedNormalizerFunction(torch.autograd.Function):
    """softmax / sparsemax / entmax15 along `dim` (subclasses name the ops)."""

    fwd_name = ""
    bwd_name = ""

    @classmethod
    def forward(cls, ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        p = getattr(_ops, cls.fwd_name)(x, dim)
        ctx.save_for_backward(p)
        ctx.dim = dim
        return p

    @classmethod
    def backward(cls, ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        return getattr(_ops, cls.bwd_name)(p, grad, ctx.dim), None


class SoftmaxFunction(_FixedNormalizerFunction):
    fwd_name, bwd_name = "softmax_fwd", "softmax_bwd"


class SparsemaxFunction(_FixedNormalizerFunction):
    fwd_name, bwd_name = "sparsemax_fwd", "sparsemax_bwd"


class Entmax15Function(_FixedNormalizerFunction):
    fwd_name, bwd_name = "entmax15_fwd", "entmax15_bwd"


class EntmaxFunction(torch.autograd.Function):
    """α-entmax along `dim` with α a tensor (one value per row after broadcasting)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: torch.Tensor, dim: int) -> torch.Tensor:
        p = _ops.entmax_fwd(x, alpha, dim)
        ctx.save_for_backward(p, alpha)
        ctx.dim = dim
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, alpha = ctx.saved_tensors
        want_alpha = ctx.needs_input_grad[1]
        dx, dalpha = _ops.entmax_bwd(p, grad, alpha, ctx.dim, want_alpha)
        if not want_alpha:
            return dx, None, None
        return dx, dalpha.sum_to_size(alpha.shape).to(alpha.dtype), None
