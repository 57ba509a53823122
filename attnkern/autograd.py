"""Autograd for the attnkern ops: one torch.autograd.Function per op family.

The compiled ops are plain (non-differentiable) primitives; these Functions
save what the backward needs (the output p, and α) and call the matching
`_bwd` op.
"""

from __future__ import annotations

import torch

_ops = torch.ops.attnkern


def _fixed_normalizer_function(name: str) -> type[torch.autograd.Function]:
    """The autograd.Function of the fixed normalizer `name` (softmax, sparsemax,
    entmax15), calling attnkern::<name>_fwd / <name>_bwd along `dim`."""
    fwd_op = getattr(_ops, f"{name}_fwd")
    bwd_op = getattr(_ops, f"{name}_bwd")

    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        p = fwd_op(x, dim)
        ctx.save_for_backward(p)
        ctx.dim = dim
        return p

    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        return bwd_op(p, grad, ctx.dim), None

    cls_name = {"softmax": "Softmax", "sparsemax": "Sparsemax", "entmax15": "Entmax15"}[name] + "Function"
    return type(cls_name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


SoftmaxFunction = _fixed_normalizer_function("softmax")
SparsemaxFunction = _fixed_normalizer_function("sparsemax")
Entmax15Function = _fixed_normalizer_function("entmax15")


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


def _attention_impl(impl: str):
    """The attention_fwd/attention_bwd pair: the compiled ops (dispatching on
    device) or the Triton launchers."""
    if impl == "triton":
        from attnkern.backends import triton as triton_backend

        return triton_backend.attention_fwd, triton_backend.attention_bwd
    return _ops.attention_fwd, _ops.attention_bwd


class AttentionFunction(torch.autograd.Function):
    """Fused attention, q (B, H, L, E), k (B, Hk, S, E), v (B, Hk, S, Ev).

    Saves q, k, v, the mask, α, the output and one shift per query row; the
    backward op recomputes the scores. mask: float (B, H, L, S)-broadcastable
    or None (no gradient); alpha: float32 (H,) or None.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, alpha, is_causal: bool, scale: float, normalizer: str, impl: str):
        fwd, _ = _attention_impl(impl)
        out, shift = fwd(q, k, v, mask, is_causal, scale, normalizer, alpha)
        ctx.save_for_backward(q, k, v, mask, alpha, out, shift)
        ctx.is_causal, ctx.scale, ctx.normalizer, ctx.impl = is_causal, scale, normalizer, impl
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, alpha, out, shift = ctx.saved_tensors
        _, bwd = _attention_impl(ctx.impl)
        want_alpha = alpha is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dalpha = bwd(grad_out, q, k, v, mask, ctx.is_causal, ctx.scale, ctx.normalizer, alpha,
                                 out, shift, want_alpha)
        return dq, dk, dv, None, (dalpha if want_alpha else None), None, None, None, None
