"""Autograd for the attnkern ops: one torch.autograd.Function per op family.

The compiled ops are plain (non-differentiable) primitives; these Functions
save what the backward needs (the output p, and α) and call the matching
`_bwd` op.
"""

from __future__ import annotations

import math

import torch
from torch.autograd import forward_ad

_ops = torch.ops.attnkern


# --- beyond the first derivative ----------------------------------------------------------------
# The compiled backward ops are not differentiable. A backward run with
# create_graph=True (double backward, e.g. a gradient penalty; torch.func.grad
# also runs it so) uses the same vector-Jacobian products written in torch ops
# of the saved output p, which autograd differentiates again through p. Forward
# mode (jvp) reuses them: each normalizer is the gradient of a convex
# conjugate, so its Jacobian in x is symmetric and J·v has the form of vᵀ·J.
# vmap folds the vmapped dimension into the rows (the ops are row-wise).


def _support_weights(p: torch.Tensor, family: str, alpha=None) -> torch.Tensor:
    """g with J = diag(g) - g gᵀ / Σg, in torch ops (differentiable in p and α):
    softmax g = p, sparsemax the support indicator, entmax15 √p, α-entmax
    p^(2-α) on the support."""
    if family == "softmax":
        return p
    pos = p > 0
    if family == "sparsemax":
        return pos.to(p.dtype)
    safe = torch.where(pos, p, torch.ones_like(p))
    g = safe.sqrt() if family == "entmax15" else torch.exp((2 - alpha.to(p.dtype)) * safe.log())
    return torch.where(pos, g, torch.zeros_like(p))


def _jacobian_product(p: torch.Tensor, v: torch.Tensor, dim: int, family: str, alpha=None) -> torch.Tensor:
    """J·v = Jᵀ·v = g ⊙ (v - Σ g v / Σ g) along dim, in torch ops (float32 for
    half types). A row with no support (all -inf) gives 0."""
    dtype = p.dtype
    if dtype in (torch.float16, torch.bfloat16):
        p, v = p.float(), v.float()
    g = _support_weights(p, family, alpha)
    total = g.sum(dim, keepdim=True)
    mean = (g * v).sum(dim, keepdim=True) / torch.where(total > 0, total, torch.ones_like(total))
    return (g * (v - mean)).to(dtype)


def entmax_alpha_derivative(p: torch.Tensor, alpha: torch.Tensor, dim: int) -> torch.Tensor:
    """∂p/∂α of α-entmax (float64, differentiable in p and α), from the output p.

    With b = α - 1, g = p^(1-b), ĝ = g/Σg and H = -Σ p ln p:
    ∂p/∂α = (p - ĝ)/b² - (p ln p + ĝ H)/b; below |b| = 1e-6 its softmax limit
    -p/2 ((ln p)² - Σ p (ln p)²). p is renormalised in double first: an error
    in Σp would be divided by b²."""
    p = p.to(torch.float64)
    total = p.sum(dim, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    b = alpha.to(torch.float64) - 1
    pos = p > 0
    logp = torch.where(pos, torch.where(pos, p, torch.ones_like(p)).log(), torch.zeros_like(p))
    plogp = p * logp
    limit = -0.5 * p * (logp * logp - (plogp * logp).sum(dim, keepdim=True))
    near = b.abs() < 1e-6
    b_safe = torch.where(near, torch.ones_like(b), b)
    g = torch.where(pos, torch.exp((1 - b_safe) * logp), torch.zeros_like(p))
    gsum = g.sum(dim, keepdim=True)
    ghat = g / torch.where(gsum > 0, gsum, torch.ones_like(gsum))
    entropy = -plogp.sum(dim, keepdim=True)
    general = (p - ghat) / (b_safe * b_safe) - (plogp + ghat * entropy) / b_safe
    return torch.where(near, limit, general)


def _rows_to_front(batch_size: int, x: torch.Tensor, x_bdim, dim: int, params=()):
    """For the vmap rule of a row-wise op: x with the vmapped dimension first (so
    the row dim moves up by one), and each (tensor, bdim) of `params` (per-row
    parameters such as α) batched the same way with singleton dims to broadcast
    against x, or unchanged when not vmapped. Returns x, the physical row dim,
    the params, and whether x was 0-d (a row of one, made explicit)."""
    x = x.movedim(x_bdim, 0) if x_bdim is not None else x.expand(batch_size, *x.shape)
    scalar = x.dim() == 1
    if scalar:
        x = x.unsqueeze(-1)
    out = []
    for t, bdim in params:
        if t is not None and bdim is not None:
            t = t.movedim(bdim, 0)
            t = t.reshape(t.shape[:1] + (1,) * (x.dim() - t.dim()) + t.shape[1:])
        out.append(t)
    return x, 1 if scalar else dim % (x.dim() - 1) + 1, out, scalar


def _first_order_only(name: str):
    """Class decorator for a Function whose backward is first order only: double
    backward, forward mode and torch.func transforms raise an error naming the
    op instead of a silent wrong answer (torch would run the non-differentiable
    backward op and return zeros for the second derivative) or torch's generic
    message. The checks run in eager mode; Dynamo traces `.apply` itself."""

    def wrap(cls):
        first_order_backward = cls.backward
        first_order_apply = cls.apply  # Function.apply bound to cls

        def backward(ctx, *grads):
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():
                raise RuntimeError(
                    f"{name}: double backward (create_graph=True, e.g. a gradient penalty) is not implemented by "
                    "the fused kernels; use backend='reference' for higher derivatives")
            return first_order_backward(ctx, *grads)

        def apply(*args):
            if torch._C._are_functorch_transforms_active():
                raise RuntimeError(f"{name}: torch.func transforms (vmap, grad, jvp, jacrev, ...) are not "
                                   "implemented by the fused kernels; use backend='reference', or loop")
            if any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args):
                raise RuntimeError(f"{name}: forward-mode AD is not implemented by the fused kernels; "
                                   "use backend='reference'")
            return first_order_apply(*args)

        cls.backward, cls.apply = staticmethod(backward), staticmethod(apply)
        return cls

    return wrap


def traceable_apply(cls):
    """cls.apply, except under torch.compile, where it is the apply of a copy of
    cls without its jvp rule: Dynamo cannot trace a Function that defines jvp
    (a graph break; an error under fullgraph). Torch.compile has no forward
    mode, so nothing is lost there."""
    attrs = {k: v for k, v in vars(cls).items() if k not in ("jvp", "__dict__", "__weakref__")}
    traceable = type(cls.__name__, (torch.autograd.Function,), attrs)

    def apply(*args):
        if torch.compiler.is_compiling():
            return traceable.apply(*args)
        return cls.apply(*args)

    return apply


def _exports_traceable_apply(name: str):
    """Class decorator: module global `name` = traceable_apply(cls)."""

    def wrap(cls):
        globals()[name] = traceable_apply(cls)
        return cls

    return wrap


def _fixed_normalizer_function(name: str) -> type[torch.autograd.Function]:
    """The autograd.Function of the fixed normalizer `name` (softmax, sparsemax,
    entmax15), calling attnkern::<name>_fwd / <name>_bwd along `dim`."""
    # Looked up at call time: importing this module must not need the compiled ops.
    def forward(x: torch.Tensor, dim: int) -> torch.Tensor:
        return getattr(_ops, f"{name}_fwd")(x, dim)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)
        ctx.dim = inputs[1]

    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a backward autograd can differentiate
            return _jacobian_product(p, grad, ctx.dim, name), None
        return getattr(_ops, f"{name}_bwd")(p, grad, ctx.dim), None

    def jvp(ctx, x_t, dim_t):
        (p,) = ctx.saved_tensors
        return _jacobian_product(p, x_t, ctx.dim, name)

    def vmap(info, in_dims, x, dim):
        x, d, _, scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim)
        out = cls.apply(x, d)
        return (out.squeeze(-1) if scalar else out), 0

    cls_name = {"softmax": "Softmax", "sparsemax": "Sparsemax", "entmax15": "Entmax15"}[name] + "Function"
    cls = type(cls_name, (torch.autograd.Function,),
               {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
                "backward": staticmethod(backward), "jvp": staticmethod(jvp), "vmap": staticmethod(vmap)})
    return cls


SoftmaxFunction = _fixed_normalizer_function("softmax")
SparsemaxFunction = _fixed_normalizer_function("sparsemax")
Entmax15Function = _fixed_normalizer_function("entmax15")
softmax_apply = traceable_apply(SoftmaxFunction)
sparsemax_apply = traceable_apply(SparsemaxFunction)
entmax15_apply = traceable_apply(Entmax15Function)


@_exports_traceable_apply("entmax_apply")
class EntmaxFunction(torch.autograd.Function):
    """α-entmax along `dim` with α a tensor (one value per row after broadcasting)."""

    @staticmethod
    def forward(x: torch.Tensor, alpha: torch.Tensor, dim: int) -> torch.Tensor:
        return _ops.entmax_fwd(x, alpha, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, alpha, ctx.dim = inputs
        ctx.save_for_backward(output, alpha)
        ctx.save_for_forward(output, alpha)

    @staticmethod
    def jvp(ctx, x_t, alpha_t, dim_t):
        p, alpha = ctx.saved_tensors
        out = _jacobian_product(p, x_t, ctx.dim, "entmax", alpha) if x_t is not None else torch.zeros_like(p)
        if alpha_t is not None:
            out = out + (entmax_alpha_derivative(p, alpha, ctx.dim) * alpha_t).to(p.dtype)
        return out

    @staticmethod
    def vmap(info, in_dims, x, alpha, dim):
        x, d, (alpha,), scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim, [(alpha, in_dims[1])])
        out = EntmaxFunction.apply(x, alpha, d)
        return (out.squeeze(-1) if scalar else out), 0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, alpha = ctx.saved_tensors
        want_alpha = ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph: a backward autograd can differentiate
            dx = _jacobian_product(p, grad, ctx.dim, "entmax", alpha)
            if not want_alpha:
                return dx, None, None
            da = (entmax_alpha_derivative(p, alpha, ctx.dim) * grad.to(torch.float64)).sum(ctx.dim, keepdim=True)
            return dx, da.sum_to_size(alpha.shape).to(alpha.dtype), None
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


@_first_order_only("attnkern.attention")
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
