"""Autograd for the attnkern ops: one torch.autograd.Function per op family.

The compiled ops are plain (non-differentiable) primitives; these Functions
save what the backward needs (the output p, and α) and call the matching
`_bwd` op.
"""

from __future__ import annotations

import math

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
        return dx, sum_to_size_fixed_order(dalpha, alpha.shape).to(alpha.dtype), None


def sum_to_size_fixed_order(t: torch.Tensor, shape) -> torch.Tensor:
    """t.sum_to_size(shape), summed in an order that does not depend on the
    thread count. torch splits a reduction to a single value across threads
    (per-thread partial sums), so a per-row gradient summed into one α would
    change in its last bits with torch.get_num_threads(); a reduction with
    several outputs is split over the outputs only. So a full reduction is
    done in two steps of the second kind."""
    if t.numel() <= 1024 or math.prod(shape) != 1 or tuple(t.shape) == tuple(shape):
        return t.sum_to_size(shape)
    flat = t.reshape(-1)
    cols = 1024
    pad = (-flat.numel()) % cols
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, cols).sum(0).sum().reshape(shape)


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
    or None (no gradient); alpha: float32 (H,) or None. dropout_p > 0 comes
    with seed, an int64 scalar tensor from which both passes regenerate the
    keep mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, alpha, is_causal: bool, scale: float, normalizer: str, impl: str,
                dropout_p: float = 0.0, seed=None):
        fwd, _ = _attention_impl(impl)
        out, shift = fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p, seed)
        ctx.save_for_backward(q, k, v, mask, alpha, out, shift, seed)
        ctx.is_causal, ctx.scale, ctx.normalizer, ctx.impl = is_causal, scale, normalizer, impl
        ctx.dropout_p = dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, alpha, out, shift, seed = ctx.saved_tensors
        _, bwd = _attention_impl(ctx.impl)
        want_alpha = alpha is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dalpha = bwd(grad_out, q, k, v, mask, ctx.is_causal, ctx.scale, ctx.normalizer, alpha,
                                 out, shift, want_alpha, ctx.dropout_p, seed)
        return dq, dk, dv, None, (dalpha if want_alpha else None), None, None, None, None, None, None
