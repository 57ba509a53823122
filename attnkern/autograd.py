"""Autograd for the attnkern ops: every torch.autograd.Function of the package.

The compiled ops are plain (non-differentiable) primitives; these Functions
save what the backward needs (the output p, and α) and call the matching
`_bwd` op: the row-wise normalizers and fused attention, normmax and
budget-sparsemax (attnkern.compat), and the Fenchel-Young losses
(attnkern.losses), with the derivative formulas in torch ops that serve
double backward, forward mode and vmap.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch.autograd import forward_ad

from attnkern.family import ALPHA_GRAD_SERIES_BAND, Family

_ops = torch.ops.attnkern


# --- beyond the first derivative ----------------------------------------------------------------
# The compiled backward ops are not differentiable. A backward run with
# create_graph=True (double backward, e.g. a gradient penalty; torch.func.grad
# also runs it so) uses the same vector-Jacobian products written in torch ops
# of the saved output p, which autograd differentiates again through p. Forward
# mode (jvp) reuses them: each normalizer is the gradient of a convex
# conjugate, so its Jacobian in x is symmetric and J·v has the form of vᵀ·J.
# vmap folds the vmapped dimension into the rows (the ops are row-wise).


def _support_weights(p: torch.Tensor, family: Family, alpha=None) -> torch.Tensor:
    """g with J = diag(g) - g gᵀ / Σg, in torch ops (differentiable in p and α):
    softmax g = p, sparsemax the support indicator, entmax15 √p, α-entmax
    p^(2-α) on the support."""
    if family is Family.SOFTMAX:
        return p
    pos = p > 0
    if family is Family.SPARSEMAX:
        return pos.to(p.dtype)
    safe = torch.where(pos, p, torch.ones_like(p))
    g = safe.sqrt() if family is Family.ENTMAX15 else torch.exp((2 - alpha.to(p.dtype)) * safe.log())
    return torch.where(pos, g, torch.zeros_like(p))


def _jacobian_product(p: torch.Tensor, v: torch.Tensor, dim: int, family: Family, alpha=None) -> torch.Tensor:
    """J·v = Jᵀ·v = g ⊙ (v - Σ g v / Σ g) along dim, in torch ops (float32 for
    half types). A row with no support (all -inf) gives 0."""
    dtype = p.dtype
    if dtype in (torch.float16, torch.bfloat16):
        p, v = p.float(), v.float()
    g = _support_weights(p, family, alpha)
    total = g.sum(dim, keepdim=True)
    mean = (g * v).sum(dim, keepdim=True) / torch.where(total > 0, total, torch.ones_like(total))
    return (g * (v - mean)).to(dtype)


def _expm1_excess(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = (eˣ - 1 - x)/x², differentiable to any order: its Taylor series
    Σ x^k/(k+2)! (k <= 8, error < 3e-17) for |x| < 0.1, the closed form with
    expm1 beyond (relative error ~2 eps/|x|)."""
    small = x.abs() < 0.1
    xs = torch.where(small, x, torch.zeros_like(x))
    series = torch.zeros_like(x)
    for k in range(8, -1, -1):
        series = series * xs + 1.0 / math.factorial(k + 2)
    xl = torch.where(small, torch.ones_like(x), x)
    return torch.where(small, series, (torch.expm1(xl) - xl) / (xl * xl))


def entmax_alpha_derivative(p: torch.Tensor, alpha: torch.Tensor, dim: int) -> torch.Tensor:
    """∂p/∂α of α-entmax (float64, differentiable in p and α), from the output p
    (docs/algorithms.md, section 4, the formula the kernels' dα sums also take).

    With b = α - 1, g = p^(1-b), ĝ = g/Σg and H = -Σ p ln p the closed form is
    ∂p/∂α = (p - ĝ)/b² - (p ln p + ĝ H)/b, whose two terms are O(1/b) and
    cancel: an error ε in p costs ε/b² here and ε/b³ in the second derivative.
    For |b| < 0.25 it is taken instead in a form without cancellation: with
    l = ln p, Q = l² φ(-b l) (φ from _expm1_excess, so p^(-b) = 1 - b l + b² Q)
    and Z = Σ p^(1-b),
        ∂p/∂α = p (Σ p Q - Q - b l Σ p Q - b H Q) / Z,
    exact at b = 0 (the softmax limit -p/2 (l² - Σ p l²)) and smooth through it,
    so autograd's derivatives in α are as accurate as the first. p is
    renormalised in double first (an error in Σp would be divided by b²)."""
    p = p.to(torch.float64)
    total = p.sum(dim, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    b = alpha.to(torch.float64) - 1
    pos = p > 0
    logp = torch.where(pos, torch.where(pos, p, torch.ones_like(p)).log(), torch.zeros_like(p))
    plogp = p * logp
    entropy = -plogp.sum(dim, keepdim=True)
    near = b.abs() < ALPHA_GRAD_SERIES_BAND
    b_near = torch.where(near, b, torch.zeros_like(b))
    q = logp * logp * _expm1_excess(-b_near * logp)
    spq = (p * q).sum(dim, keepdim=True)
    z = torch.where(pos, torch.exp(-b_near * logp) * p, torch.zeros_like(p)).sum(dim, keepdim=True)
    z = torch.where(z > 0, z, torch.ones_like(z))
    series = p * (spq - q - b_near * logp * spq - b_near * entropy * q) / z
    b_far = torch.where(near, torch.ones_like(b), b)
    g = torch.where(pos, torch.exp((1 - b_far) * logp), torch.zeros_like(p))
    gsum = g.sum(dim, keepdim=True)
    ghat = g / torch.where(gsum > 0, gsum, torch.ones_like(gsum))
    general = (p - ghat) / (b_far * b_far) - (plogp + ghat * entropy) / b_far
    return torch.where(near, series, general)


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


def _cache_forward_signature(cls) -> None:
    """Stores the signature of cls.forward on it (PEP 362's __signature__).
    Function.apply binds every call's arguments to forward's signature when
    the class defines setup_context, and inspect.signature would rebuild it
    from the function each time, a large part of the Python cost of a small
    normalizer call. With the signature stored, inspect returns it as it is."""
    fn = cls.forward
    if getattr(fn, "__signature__", None) is None:
        fn.__signature__ = inspect.signature(fn)


def _eager_twin(cls):
    """(twin, n): an old-style copy of cls, whose forward(ctx, *args) runs
    cls.forward and then cls.setup_context, and the number of arguments it
    takes. Function.apply binds every call's arguments to forward's signature
    (inspect, in Python) when the class defines setup_context; the twin is not
    bound, which takes that cost off every eager call. It serves eager
    autograd and forward mode for calls that pass every argument; torch.func
    transforms and torch.compile take cls (its vmap rule, and what Dynamo
    traces)."""
    fwd, setup = cls.forward, cls.setup_context

    def forward(ctx, *args):
        out = fwd(*args)
        setup(ctx, args, out)
        return out

    attrs = {"forward": staticmethod(forward), "backward": staticmethod(cls.backward)}
    if "jvp" in vars(cls):
        attrs["jvp"] = staticmethod(cls.jvp)
    twin = type(cls.__name__, (torch.autograd.Function,), attrs)
    return twin, len(inspect.signature(fwd).parameters)


def _first_order_only(name: str):
    """Class decorator for a Function whose backward is first order only: double
    backward, forward mode and torch.func transforms raise an error naming the
    op instead of a silent wrong answer (torch would run the non-differentiable
    backward op and return zeros for the second derivative) or torch's generic
    message. The checks run in eager mode; Dynamo traces `.apply` itself.
    A class may define forward_without_graph(*args), called instead of the
    Function when no tensor argument needs a gradient."""

    def wrap(cls):
        _cache_forward_signature(cls)
        first_order_backward = cls.backward
        first_order_apply = cls.apply  # Function.apply bound to cls
        without_graph = getattr(cls, "forward_without_graph", None)

        def backward(ctx, *grads):
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():
                raise RuntimeError(
                    f"{name}: double backward (create_graph=True, e.g. a gradient penalty) is not implemented by "
                    "the fused kernels; use backend='reference' for higher derivatives")
            return first_order_backward(ctx, *grads)

        cls.backward = staticmethod(backward)
        twin, nargs = _eager_twin(cls)

        def apply(*args):
            if torch._C._are_functorch_transforms_active():
                raise RuntimeError(f"{name}: torch.func transforms (vmap, grad, jvp, jacrev, ...) are not "
                                   "implemented by the fused kernels; use backend='reference', or loop")
            if _has_tangent(args):
                raise RuntimeError(f"{name}: forward-mode AD is not implemented by the fused kernels; "
                                   "use backend='reference'")
            if torch.compiler.is_compiling():
                return first_order_apply(*args)
            if without_graph is not None and not _needs_grad(args):
                # Nothing to differentiate (inference, decoding): skip the
                # autograd node and what it saves.
                return without_graph(*args)
            return twin.apply(*args) if len(args) == nargs else first_order_apply(*args)

        cls.apply = staticmethod(apply)
        return cls

    return wrap


def traceable_apply(cls, unrecorded=None):
    """cls.apply, except under torch.compile, where it is the apply of a copy of
    cls without its jvp rule: Dynamo cannot trace a Function that defines jvp
    (a graph break; an error under fullgraph). Torch.compile has no forward
    mode, so nothing is lost there. Where autograd records nothing, the
    forward alone: cls.forward, or `unrecorded` (same arguments and outputs)
    where that skips work only the backward needs."""
    _cache_forward_signature(cls)  # (the copy below shares forward)
    attrs = {k: v for k, v in vars(cls).items() if k not in ("jvp", "__dict__", "__weakref__")}
    traceable = type(cls.__name__, (torch.autograd.Function,), attrs)
    twin, nargs = _eager_twin(cls)

    def apply(*args):
        if torch.compiler.is_compiling():
            return traceable.apply(*args)
        if torch._C._are_functorch_transforms_active():
            return cls.apply(*args)
        if _needs_grad(args) or _has_tangent(args):
            return twin.apply(*args) if len(args) == nargs else cls.apply(*args)
        # Nothing to record (inference, or no input needs a gradient): the
        # forward alone, without Function.apply's node and argument binding,
        # which cost more than the forward itself on small tensors.
        return (unrecorded or cls.forward)(*args)

    return apply


def _needs_grad(args) -> bool:
    """Grad mode is on and a tensor argument needs a gradient."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _has_tangent(args) -> bool:
    """A tensor argument carries a forward-mode tangent."""
    return forward_ad._current_level >= 0 and any(
        isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args)


def _exports_traceable_apply(name: str):
    """Class decorator: module global `name` = traceable_apply(cls)."""

    def wrap(cls):
        globals()[name] = traceable_apply(cls)
        return cls

    return wrap


# --- forward maps composed from the public normalizers ---------------------------------------------
# Some Functions below compute their forward with the public, backend-choosing
# normalizers (NormmaxFunction through α'-entmax, FYLossFunction's prediction
# p). The modules that define those (attnkern.compat, attnkern.losses) sit
# above this one, so they register the maps here when imported; this module
# imports nothing above it.

_COMPOSED_FORWARDS: dict = {}


def register_composed_forward(name: str, fn) -> None:
    _COMPOSED_FORWARDS[name] = fn


def composed_forward(name: str):
    return _COMPOSED_FORWARDS[name]


def _fixed_normalizer_function(name: str) -> type[torch.autograd.Function]:
    """The autograd.Function of the fixed normalizer `name` (softmax, sparsemax,
    entmax15), calling attnkern::<name>_fwd / <name>_bwd along `dim`."""
    family = Family.of(name)
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
            return _jacobian_product(p, grad, ctx.dim, family), None
        return getattr(_ops, f"{name}_bwd")(p, grad, ctx.dim), None

    def jvp(ctx, x_t, dim_t):
        (p,) = ctx.saved_tensors
        return _jacobian_product(p, x_t, ctx.dim, family)

    def vmap(info, in_dims, x, dim):
        x, d, _, scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim)
        out = cls.apply(x, d)
        return (out.squeeze(-1) if scalar else out), 0

    cls_name = {Family.SOFTMAX: "Softmax", Family.SPARSEMAX: "Sparsemax", Family.ENTMAX15: "Entmax15"}[family] \
        + "Function"
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
        out = _jacobian_product(p, x_t, ctx.dim, Family.ENTMAX, alpha) if x_t is not None else torch.zeros_like(p)
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
            dx = _jacobian_product(p, grad, ctx.dim, Family.ENTMAX, alpha)
            if not want_alpha:
                return dx, None, None
            da = (entmax_alpha_derivative(p, alpha, ctx.dim) * grad.to(torch.float64)).sum(ctx.dim, keepdim=True)
            return dx, da.sum_to_size(alpha.shape).to(alpha.dtype), None
        dx, dalpha = _ops.entmax_bwd(p, grad, alpha, ctx.dim, want_alpha)
        if not want_alpha:
            return dx, None, None
        return dx, sum_to_size_fixed_order(dalpha, alpha.shape).to(alpha.dtype), None


# Why each structured op stops at first derivatives (in its double-backward error).
_NO_SECOND_ORDER = {
    "fusedmax": "its first derivative is piecewise constant",
    "oscarmax": "its first derivative is piecewise constant",
    "crf_marginals": "it would need the chain's third cumulants",
    "sparsemap_chain": "its first derivative is piecewise constant",
}


def _structured_backward(ctx, grad: torch.Tensor, name: str, bwd_op: str = ""):
    """The backward of a structured op through attnkern::<bwd_op> (default
    <name>_bwd) from the saved (x or what the forward kept, ..., parameter):
    fusedmax on CUDA recomputes the prox from x; fusedmax and oscarmax on the
    CPU read what their forward kept (FusedmaxSegmentsFunction,
    OscarmaxClustersFunction); crf_marginals and sparsemap_chain recompute the
    messages or the solution from the unary scores. First derivatives only."""
    if torch.is_grad_enabled():
        raise NotImplementedError(f"attnkern.{name}: double backward is not implemented ({_NO_SECOND_ORDER[name]})")
    *saved, param = ctx.saved_tensors
    want_param = ctx.needs_input_grad[1]
    dx, dparam = getattr(_ops, bwd_op or f"{name}_bwd")(*saved, grad, param, ctx.dim, want_param)
    if not want_param:
        return dx, None, None
    return dx, sum_to_size_fixed_order(dparam, param.shape).to(param.dtype), None


def _refuse_forward_mode(name: str):
    raise NotImplementedError(f"attnkern.{name}: forward-mode derivatives are not implemented")


def _structured_function(name: str) -> type[torch.autograd.Function]:
    """The autograd.Function of the structured op `name` along `dim`, through
    attnkern::<name>_fwd / _bwd, with a tensor parameter (fusedmax, oscarmax: λ,
    one value per row after broadcasting; crf_marginals, sparsemap_chain: the
    2×2 pairwise scores, shared or per row) whose per-row gradients the op returns. First
    derivatives only: a backward that builds a graph (create_graph=True) or a
    forward-mode product is refused with an error naming the op."""
    def forward(x: torch.Tensor, param: torch.Tensor, dim: int) -> torch.Tensor:
        # (Looked up per call: without the compiled extension the op does not
        # exist, and importing attnkern must still work.)
        return getattr(_ops, f"{name}_fwd")(x, param, dim)

    def setup_context(ctx, inputs, output):
        x, param, ctx.dim = inputs
        ctx.save_for_backward(x, param)

    def jvp(ctx, x_t, param_t, dim_t):
        _refuse_forward_mode(name)

    def backward(ctx, grad: torch.Tensor):
        return _structured_backward(ctx, grad, name)

    methods = {"forward": forward, "setup_context": setup_context, "jvp": jvp, "backward": backward}
    class_name = "".join(part.capitalize() for part in name.split("_")) + "Function"
    return type(class_name, (torch.autograd.Function,), {k: staticmethod(f) for k, f in methods.items()})


def _kept_prox_function(name: str, kept: str,
                        count: int) -> tuple[type[torch.autograd.Function], Callable[..., torch.Tensor]]:
    """The autograd.Function of fusedmax or oscarmax along `dim` on CPU tensors,
    through attnkern::<name>_fwd_<kept>: it also returns what the backward
    needs of the prox (`count` tensors, not differentiable: fusedmax's segments,
    oscarmax's cluster flags and ranks), which attnkern::<name>_bwd_<kept> reads
    instead of solving the prox again as <name>_bwd does. First derivatives
    only, as the other structured ops."""
    def forward(x: torch.Tensor, lam: torch.Tensor, dim: int):
        return getattr(_ops, f"{name}_fwd_{kept}")(x, lam, dim)

    def setup_context(ctx, inputs, output):
        _, lam, ctx.dim = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*output[1:], lam)

    def jvp(ctx, x_t, lam_t, dim_t):
        _refuse_forward_mode(name)

    def backward(ctx, grad: torch.Tensor, *kept_grads):
        return _structured_backward(ctx, grad, name, f"{name}_bwd_{kept}")

    methods = {"forward": forward, "setup_context": setup_context, "jvp": jvp, "backward": backward}
    cls = type(f"{name.capitalize()}{kept.capitalize()}Function", (torch.autograd.Function,),
               {k: staticmethod(f) for k, f in methods.items()})

    def unrecorded(x: torch.Tensor, lam: torch.Tensor, dim: int):
        return (getattr(_ops, f"{name}_fwd")(x, lam, dim),) + (None,) * count

    apply = traceable_apply(cls, unrecorded=unrecorded)

    def cpu_apply(x: torch.Tensor, lam: torch.Tensor, dim: int) -> torch.Tensor:
        return apply(x, lam, dim)[0]

    cpu_apply.__doc__ = (f"{name} of a CPU tensor: with its {kept} kept for the backward where autograd records "
                         "one, the forward alone otherwise.")
    return cls, cpu_apply


FusedmaxSegmentsFunction, fusedmax_cpu_apply = _kept_prox_function("fusedmax", "segments", 1)
OscarmaxClustersFunction, oscarmax_cpu_apply = _kept_prox_function("oscarmax", "clusters", 2)


FusedmaxFunction = _structured_function("fusedmax")
CrfMarginalsFunction = _structured_function("crf_marginals")
SparsemapChainFunction = _structured_function("sparsemap_chain")
fusedmax_apply = traceable_apply(FusedmaxFunction)
crf_marginals_apply = traceable_apply(CrfMarginalsFunction)
sparsemap_chain_apply = traceable_apply(SparsemapChainFunction)


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
    keep mask. window: (left, right) keys around the bottom-right diagonal
    (-1 unbounded); key_lengths: int64 (B,) valid keys per batch, or None;
    row_bounds: int64 (B, L, 2), each row's run of keys [lo, hi) (CPU), or None.
    """

    @staticmethod
    def forward_without_graph(q, k, v, mask, alpha, is_causal: bool, scale: float, normalizer: str, impl: str,
                              dropout_p: float = 0.0, seed=None, window=(-1, -1), key_lengths=None,
                              row_bounds=None):
        """The output alone, when no input needs a gradient (see _first_order_only)."""
        fwd, _ = _attention_impl(impl)
        return fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p, seed, window[0], window[1],
                   key_lengths, row_bounds)[0]

    @staticmethod
    def forward(ctx, q, k, v, mask, alpha, is_causal: bool, scale: float, normalizer: str, impl: str,
                dropout_p: float = 0.0, seed=None, window=(-1, -1), key_lengths=None, row_bounds=None):
        fwd, _ = _attention_impl(impl)
        out, shift = fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p, seed, window[0], window[1],
                         key_lengths, row_bounds)
        ctx.save_for_backward(q, k, v, mask, alpha, out, shift, seed, key_lengths, row_bounds)
        ctx.is_causal, ctx.scale, ctx.normalizer, ctx.impl = is_causal, scale, normalizer, impl
        ctx.dropout_p, ctx.window = dropout_p, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, alpha, out, shift, seed, key_lengths, row_bounds = ctx.saved_tensors
        _, bwd = _attention_impl(ctx.impl)
        want_alpha = alpha is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dalpha = bwd(grad_out, q, k, v, mask, ctx.is_causal, ctx.scale, ctx.normalizer, alpha,
                                 out, shift, want_alpha, ctx.dropout_p, seed, ctx.window[0], ctx.window[1],
                                 key_lengths, row_bounds)
        return (dq, dk, dv, None, (dalpha if want_alpha else None)) + (None,) * 9


# --- entmax-package compatibility: normmax and budget-sparsemax (attnkern.compat) ----------------


def _normmax_product(p: torch.Tensor, v: torch.Tensor, alpha, dim: int) -> torch.Tensor:
    """J·v = Jᵀ·v of α-normmax in torch ops (differentiable in p and v), from the
    output p: with a = p and c = p^(2-α) on the support,
    J = (Σ p^α)^((α-1)/α) / (α-1) · (diag(c) - a cᵀ - c aᵀ + (Σ c) a aᵀ),
    a symmetric matrix (computed in float64)."""
    dtype = p.dtype
    p64, v64 = p.to(torch.float64), v.to(torch.float64)
    a = alpha.to(torch.float64) if isinstance(alpha, torch.Tensor) else float(alpha)
    pos = p64 > 0
    logp = torch.where(pos, torch.where(pos, p64, torch.ones_like(p64)).log(), torch.zeros_like(p64))
    c = torch.where(pos, torch.exp((2 - a) * logp), torch.zeros_like(p64))
    pa = torch.where(pos, torch.exp(a * logp), torch.zeros_like(p64)).sum(dim, keepdim=True)

    def rows(t):
        return t.sum(dim, keepdim=True)

    out = c * v64 - rows(c * v64) * p64 - rows(p64 * v64) * (c - rows(c) * p64)
    scale = torch.where(pa > 0, pa, torch.ones_like(pa)) ** ((a - 1) / a) / (a - 1)
    return (out * scale).to(dtype)


@_exports_traceable_apply("normmax_apply")
class NormmaxFunction(torch.autograd.Function):
    """α-normmax with α fixed (no gradient in α): forward on the entmax kernels,
    backward by attnkern::normmax_bwd from the saved output. Its Jacobian in x is
    symmetric (the map is the gradient of a convex conjugate), so the same
    product serves forward mode. With create_graph the backward is the same
    product in torch ops (_normmax_product), which autograd differentiates
    again."""

    @staticmethod
    def forward(x: torch.Tensor, alpha, dim: int, backend: str) -> torch.Tensor:
        return composed_forward("normmax")(x, alpha, dim, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.alpha, ctx.dim, ctx.backend = inputs
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def _alpha(ctx, p):
        a = ctx.alpha
        return a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.float64, device=p.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the same product in torch ops
            return _normmax_product(p, grad, ctx.alpha, ctx.dim), None, None, None
        return torch.ops.attnkern.normmax_bwd(p, grad, NormmaxFunction._alpha(ctx, p), ctx.dim), None, None, None

    @staticmethod
    def jvp(ctx, x_t, alpha_t, dim_t, backend_t):
        (p,) = ctx.saved_tensors
        return _normmax_product(p, x_t, ctx.alpha, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, alpha, dim, backend):
        a_dim = in_dims[1] if isinstance(alpha, torch.Tensor) else None
        x, d, (alpha,), scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim, [(alpha, a_dim)])
        out = NormmaxFunction.apply(x, alpha, d, backend)
        return (out.squeeze(-1) if scalar else out), 0


def _row_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.amax(dim, keepdim=True), with -inf for rows of length 0 (amax refuses
    them); a 0-d x is its own max."""
    if not x.dim():
        return x
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_full(shape, -math.inf)
    return x.amax(dim, keepdim=True)


def _zero_budget_slope(x: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    """∂/∂budget of <grad, p> at budget = 0 (from above: the only side there is).
    For a small budget b > 0 the k entries tied at the row's max get b/k each,
    so the slope is the mean of grad over them (0 for a row with no finite
    entry). x, grad: with the row along `dim`; returns float64 keepdim rows."""
    x64 = x.detach().to(torch.float64)
    m = _row_amax(x64, dim)
    top = (x64 == m) & torch.isfinite(m)
    k = top.sum(dim, keepdim=True) if x.dim() else top.to(torch.int64)
    g = torch.where(top, grad.to(torch.float64), torch.zeros_like(x64))
    total = g.sum(dim, keepdim=True) if x.dim() else g
    return total / k.clamp_min(1).to(torch.float64)


def _budget_product(p: torch.Tensor, x: torch.Tensor, budget: torch.Tensor, v: torch.Tensor, v_budget,
                    dim: int, want_budget: bool = True):
    """The Jacobian products of budget-sparsemax in torch ops (differentiable in
    v). With s the active indicator (0 < p < 1) and k = Σ s: J·v = Jᵀ·v =
    s ⊙ (v - Σ s v / k); the budget column is s / k, and e_max / k_max at
    budget 0 (see _zero_budget_slope). Returns (J v + column · v_budget, the
    budget row · v)."""
    s = ((p > 0) & (p < 1)).to(v.dtype)
    k = s.sum(dim, keepdim=True)
    mean = (s * v).sum(dim, keepdim=True) / k.clamp_min(1)
    out = s * (v - mean)
    db = None
    zero = budget == 0
    if want_budget:
        db = torch.where(zero, _zero_budget_slope(x, v, dim).to(v.dtype), mean)
    if v_budget is not None:
        x64 = x.detach().to(torch.float64)
        top = (x64 == _row_amax(x64, dim)).to(v.dtype)
        col = torch.where(zero, top / top.sum(dim, keepdim=True).clamp_min(1), s / k.clamp_min(1))
        out = out + col * v_budget.to(v.dtype)
    return out, db


@_exports_traceable_apply("budget_apply")
class BudgetFunction(torch.autograd.Function):
    """budget-sparsemax through attnkern::budget_fwd. Backward, with s the
    active indicator (0 < p < 1) and k = Σ s: dx = s ⊙ (g - Σ s g / k), and
    d budget = Σ s g / k (0 for a row with no active entry, except at budget
    0, where p = 0 and the slope in the budget is _zero_budget_slope). The
    Jacobian in x is symmetric, so forward mode uses the same products."""

    @staticmethod
    def forward(x: torch.Tensor, budget: torch.Tensor, dim: int) -> torch.Tensor:
        p = torch.ops.attnkern.budget_fwd(x, budget, dim)
        if bool((budget == 0).any()):  # exactly 0 (the kernel leaves rounding-level mass at the max)
            p = torch.where((budget == 0) & ~torch.isnan(p), torch.zeros_like(p), p)
        return p

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, budget, ctx.dim = inputs
        ctx.save_for_backward(output, budget, x)
        ctx.save_for_forward(output, budget, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, budget, x = ctx.saved_tensors
        want_budget = ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph: products in torch ops
            dx, db = _budget_product(p, x, budget, grad, None, ctx.dim, want_budget)
        else:
            dx, db = torch.ops.attnkern.budget_bwd(p, grad, ctx.dim, want_budget)
            if want_budget:
                db = torch.where(budget == 0, _zero_budget_slope(x, grad, ctx.dim), db)
        if not want_budget:
            return dx, None, None
        return dx, db.sum_to_size(budget.shape).to(budget.dtype), None

    @staticmethod
    def jvp(ctx, x_t, budget_t, dim_t):
        p, budget, x = ctx.saved_tensors
        v = x_t if x_t is not None else torch.zeros_like(p)
        return _budget_product(p, x, budget, v, budget_t, ctx.dim, want_budget=False)[0]

    @staticmethod
    def vmap(info, in_dims, x, budget, dim):
        x, d, (budget,), scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim, [(budget, in_dims[1])])
        out = BudgetFunction.apply(x, budget, d)
        return (out.squeeze(-1) if scalar else out), 0


# --- Fenchel-Young losses (attnkern.losses) -------------------------------------------------------


def _fy_loss(X: torch.Tensor, target: torch.Tensor, p: torch.Tensor, omega_gap: torch.Tensor) -> torch.Tensor:
    """<p, x> - x_t + omega_gap, with omega_gap = Ω(e_t) - Ω(p) of shape (..., 1).

    For the value only (FYLossFunction gives the gradients). Scores are shifted
    by their row max (it cancels since Σ p = 1) to avoid cancellation, and
    entries with p = 0 (masked -inf ones among them) are left out."""
    p = p.to(X.dtype)
    m = X.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    y = torch.where(p > 0, X - m, torch.zeros_like(X))
    inner = torch.linalg.vecdot(y, p, dim=-1).unsqueeze(-1)
    y_t = X.gather(-1, target.long().unsqueeze(-1)) - m
    loss = inner - y_t + omega_gap.to(inner.dtype)
    return loss.squeeze(-1)


def _tsallis_sums(p64: torch.Tensor, alpha):
    """Per-row Σ p^α, Σ p^α ln p and S_k = Σ p (ln p)^k (k = 1, 2, 3) over the
    support, keepdim; α a float or a (..., 1) tensor."""
    pos = p64 > 0
    log_p = torch.where(pos, torch.where(pos, p64, torch.ones_like(p64)).log(), torch.zeros_like(p64))
    a = alpha if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=p64.dtype, device=p64.device)
    pa = torch.where(pos, torch.exp(a * log_p), torch.zeros_like(p64))
    plog = p64 * log_p

    def rows(t):
        return t.sum(-1, keepdim=True)

    return a, rows(pa), rows(pa * log_p), rows(plog), rows(plog * log_p), rows(plog * log_p * log_p)


# |α - 1| below which the Tsallis entropy and its α-slope come from their
# expansion to second order in α - 1 (the closed forms cancel there).
_TSALLIS_TAYLOR_BAND = 1e-4


def _tsallis_gap(p64: torch.Tensor, alpha) -> torch.Tensor:
    """Ω(e_t) - Ω(p) for the Tsallis regularizer Ω(p) = (Σ p^α - 1)/(α(α-1)),
    i.e. the Tsallis α-entropy H_α(p) (the Shannon entropy at α = 1), keepdim.
    Differentiable in p and α; near α = 1, with b = α - 1,
    H_α = -S1 + b (S1 - S2/2) + b² (-S1 + S2/2 - S3/6) + O(b³)."""
    a, s, _, s1, s2, s3 = _tsallis_sums(p64, alpha)
    b = a - 1
    near = b.abs() < _TSALLIS_TAYLOR_BAND
    den = torch.where(near, torch.ones_like(b), a * b)
    return torch.where(near, -s1 + b * (s1 - s2 / 2) + b * b * (-s1 + s2 / 2 - s3 / 6), (1 - s) / den)


def _tsallis_alpha_slope(p64: torch.Tensor, alpha) -> torch.Tensor:
    """∂H_α(p)/∂α at fixed p (keepdim), differentiable in p and α: by Danskin's
    theorem the α-gradient of the entmax loss. Closed form
    -(Σ p^α ln p + H_α (2α - 1)) / (α(α - 1)); near α = 1 the derivative of the
    expansion in _tsallis_gap."""
    a, s, sl, s1, s2, s3 = _tsallis_sums(p64, alpha)
    b = a - 1
    near = b.abs() < _TSALLIS_TAYLOR_BAND
    den = torch.where(near, torch.ones_like(b), a * b)
    h = (1 - s) / den
    return torch.where(near, (s1 - s2 / 2) + 2 * b * (-s1 + s2 / 2 - s3 / 6), -(sl + h * (2 * a - 1)) / den)


def _one_hot_like(p: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p).scatter(-1, target.unsqueeze(-1), 1.0)


@_exports_traceable_apply("entmax_loss_apply")
class EntmaxLossFunction(torch.autograd.Function):
    """The α-entmax loss of x (rows, n) against target (rows,), α (rows,),
    through the fused attnkern::entmax_loss_fwd kernel, which returns the loss
    and its gradient p - e_t in one pass per row (the second output, not
    differentiable). Backward scales the saved gradient; the α-gradient is
    ∂H_α/∂α at p (Danskin). With create_graph both are recomputed from a
    differentiable p = entmax(x, α), so higher derivatives are exact."""

    @staticmethod
    def forward(x: torch.Tensor, target: torch.Tensor, alpha: torch.Tensor):
        return torch.ops.attnkern.entmax_loss_fwd(x, target, alpha)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, alpha = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, target, alpha, output[1])
        ctx.save_for_forward(x, target, alpha, output[1])

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _):
        x, target, alpha, grad = ctx.saved_tensors
        want_x, want_alpha = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        p = None
        if torch.is_grad_enabled():  # create_graph: differentiable in x and α
            p = EntmaxFunction.apply(x, alpha.unsqueeze(-1), 1)
            grad = p - _one_hot_like(p, target)
        elif want_alpha:
            p = grad + _one_hot_like(grad, target)
        dx = grad_loss.unsqueeze(-1).to(grad.dtype) * grad if want_x else None
        da = None
        if want_alpha:
            slope = _tsallis_alpha_slope(p.to(torch.float64), alpha.to(torch.float64).unsqueeze(-1)).squeeze(-1)
            da = (grad_loss.to(torch.float64) * slope).to(alpha.dtype)
        return dx, None, da

    @staticmethod
    def jvp(ctx, x_t, target_t, alpha_t):
        x, target, alpha, grad = ctx.saved_tensors
        loss_t = torch.zeros(grad.shape[:-1], dtype=grad.dtype, device=grad.device)
        if x_t is not None:
            loss_t = loss_t + (grad * x_t.to(grad.dtype)).sum(-1)
        if alpha_t is not None:
            p = grad + _one_hot_like(grad, target)
            slope = _tsallis_alpha_slope(p.to(torch.float64), alpha.to(torch.float64).unsqueeze(-1)).squeeze(-1)
            loss_t = loss_t + (slope * alpha_t).to(loss_t.dtype)
        return loss_t, None

    @staticmethod
    def vmap(info, in_dims, x, target, alpha):
        B = info.batch_size

        def front(t, d):
            return t.movedim(d, 0) if d is not None else t.expand(B, *t.shape)

        x, target, alpha = front(x, in_dims[0]), front(target, in_dims[1]), front(alpha, in_dims[2])
        n, c = x.shape[1], x.shape[2]
        loss, grad = EntmaxLossFunction.apply(x.reshape(B * n, c), target.reshape(B * n), alpha.reshape(B * n))
        return (loss.reshape(B, n), grad.reshape(B, n, c)), (0, 0)


def _normmax_gap(p64: torch.Tensor, alpha) -> torch.Tensor:
    """Ω(e_t) - Ω(p) = 1 - ||p||_α for normmax (keepdim), differentiable in p and α."""
    pos = p64 > 0
    log_p = torch.log(torch.where(pos, p64, torch.ones_like(p64)))
    s = torch.where(pos, torch.exp(alpha * log_p), torch.zeros_like(p64)).sum(-1, keepdim=True)
    return 1 - torch.where(s > 0, s, torch.ones_like(s)) ** (1 / alpha)


def _normmax_alpha_slope(p64: torch.Tensor, alpha) -> torch.Tensor:
    """∂(1 - ||p||_α)/∂α at fixed p: with S = Σ p^α and N = S^(1/α),
    -N (Σ p^α ln p / (α S) - ln S / α²)."""
    pos = p64 > 0
    log_p = torch.log(torch.where(pos, p64, torch.ones_like(p64)))
    pa = torch.where(pos, torch.exp(alpha * log_p), torch.zeros_like(p64))
    s = pa.sum(-1, keepdim=True)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return -(s ** (1 / alpha)) * ((pa * log_p).sum(-1, keepdim=True) / (alpha * s) - torch.log(s) / alpha ** 2)


def _fy_predict(kind: str, X: torch.Tensor, alpha) -> torch.Tensor:
    """p = the prediction map of the loss `kind` along the last dim (public
    normalizer, registered by attnkern.losses as "<kind>_predict")."""
    return composed_forward(f"{kind}_predict")(X, alpha)


def _fy_alpha_slope(kind: str, p64: torch.Tensor, alpha) -> torch.Tensor:
    a = alpha.to(torch.float64) if isinstance(alpha, torch.Tensor) else float(alpha)
    return _tsallis_alpha_slope(p64, a) if kind == "entmax" else _normmax_alpha_slope(p64, a)


@_exports_traceable_apply("fy_loss_apply")
class FYLossFunction(torch.autograd.Function):
    """A Fenchel-Young loss along the last dim assembled in torch ops, for the
    α-entmax family off the fused CPU kernel and for normmax (kind "entmax" or
    "normmax"). x (..., n), target (...), alpha a float or a tensor
    broadcastable to (..., 1).
    By Danskin's theorem the gradients are p - e_t and ∂(Ω(e_t) - Ω(p))/∂α at the
    fixed p, so the forward computes p once without a graph (returned as a
    second, non-differentiable output). With create_graph the backward
    recomputes p differentiably, so higher derivatives are exact."""

    @staticmethod
    def forward(x: torch.Tensor, target: torch.Tensor, alpha, kind: str):
        p = _fy_predict(kind, x, alpha)
        if kind == "normmax" and not isinstance(alpha, torch.Tensor):
            gap = 1 - torch.linalg.vector_norm(p, ord=float(alpha), dim=-1, keepdim=True)
        else:
            p64 = p.to(torch.float64)
            a = alpha.to(torch.float64).expand(tuple(x.shape[:-1]) + (1,)) if isinstance(alpha, torch.Tensor) \
                else float(alpha)
            gap = _tsallis_gap(p64, a) if kind == "entmax" else _normmax_gap(p64, a)
        return _fy_loss(x, target, p, gap), p

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, alpha, ctx.kind = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.alpha = None if isinstance(alpha, torch.Tensor) else alpha
        saved = (x, target, alpha if ctx.alpha is None else None, output[1])
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _):
        x, target, alpha, p = ctx.saved_tensors
        alpha = ctx.alpha if alpha is None else alpha
        if torch.is_grad_enabled():  # create_graph: p differentiable in x and α
            p = _fy_predict(ctx.kind, x, alpha)
        dx = da = None
        if ctx.needs_input_grad[0]:
            dx = grad_loss.unsqueeze(-1).to(p.dtype) * (p - _one_hot_like(p, target))
        if ctx.needs_input_grad[2]:
            slope = _fy_alpha_slope(ctx.kind, p.to(torch.float64), alpha)
            da = (grad_loss.to(torch.float64).unsqueeze(-1) * slope).sum_to_size(alpha.shape).to(alpha.dtype)
        return dx, None, da, None

    @staticmethod
    def jvp(ctx, x_t, target_t, alpha_t, kind_t):
        x, target, alpha, p = ctx.saved_tensors
        alpha = ctx.alpha if alpha is None else alpha
        loss_t = torch.zeros(p.shape[:-1], dtype=x.dtype, device=x.device)
        if x_t is not None:
            loss_t = loss_t + ((p - _one_hot_like(p, target)) * x_t).sum(-1).to(x.dtype)
        if alpha_t is not None:
            slope = _fy_alpha_slope(ctx.kind, p.to(torch.float64), alpha)
            loss_t = loss_t + (slope * alpha_t).squeeze(-1).to(x.dtype)
        return loss_t, None

    @staticmethod
    def vmap(info, in_dims, x, target, alpha, kind):
        x_dim, t_dim, a_dim = in_dims[:3]
        target = target.movedim(t_dim, 0) if t_dim is not None else target.expand(info.batch_size, *target.shape)
        a_dim = a_dim if isinstance(alpha, torch.Tensor) else None
        x, _, (alpha,), _ = _rows_to_front(info.batch_size, x, x_dim, -1, [(alpha, a_dim)])
        return FYLossFunction.apply(x, target, alpha, kind), (0, 0)
