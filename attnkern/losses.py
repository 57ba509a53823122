"""Fenchel-Young losses of the sparse normalizers, with the `entmax` package's
signatures: sparsemax_loss, entmax15_loss, sparsemax_bisect_loss,
entmax_bisect_loss, normmax_bisect_loss.

For a regularizer Ω with prediction map p*(x) = argmax_{p in Δ} <p, x> - Ω(p),
the loss of scores x (one row) and target class t is

    L(x, t) = <p*, x> - Ω(p*) - x_t + Ω(e_t) ≥ 0,

with gradient p* - e_t in x. The α-entmax losses (sparsemax, entmax15, α)
run in one fused kernel per row (attnkern::entmax_loss_fwd: p, the loss and
p - e_t); the normmax loss is assembled in torch ops from normmax_bisect's p.
By Danskin's theorem its gradient in a parameter
of Ω (α, where it is a tensor) is -∂Ω/∂α at the fixed p*, so no
differentiation through the normalizer is needed: p* is computed once by the
kernels, without a graph, and the loss is assembled from it.

Masked (-inf) logits are accepted: they get p* = 0 and contribute nothing (the
`entmax` package gives NaN). A -inf target logit gives an infinite loss.
"""

from __future__ import annotations

import torch

from attnkern import ops
from attnkern.autograd import traceable_apply
from attnkern.compat import _check_above_one, normmax_bisect
from attnkern.ops import _compiling, as_index, check_alpha, check_n_iter, check_tensor

REDUCTIONS = ("elementwise_mean", "mean", "sum", "none")


def _check_inputs(X, target) -> None:
    if _compiling():
        return
    check_tensor(X, "X")
    if X.dim() < 1:
        raise ValueError("X must have a class dimension (shape (n_samples, n_classes))")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                     torch.int8, torch.uint8):
        raise TypeError("target must be an integer tensor of class indices")
    if tuple(target.shape) != tuple(X.shape[:-1]):
        raise ValueError(f"target of shape {tuple(target.shape)} does not match X of shape {tuple(X.shape)} "
                         "(expected X's shape without its last dim)")


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
            from attnkern.autograd import EntmaxFunction

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


_entmax_loss_apply = traceable_apply(EntmaxLossFunction)


def _entmax_family_loss(X: torch.Tensor, target: torch.Tensor, alpha) -> torch.Tensor:
    """The α-entmax loss along the last dim, any finite α (float or per-row tensor)."""
    if X.device.type == "cpu" and ops.use_kernels("auto", X) and X.shape[-1] > 0:
        C = X.shape[-1]
        a = alpha if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=torch.float64)
        a_rows = a.to(torch.float64 if X.dtype == torch.float64 else torch.float32).expand(
            tuple(X.shape[:-1]) + (1,)).reshape(-1)
        loss, _ = _entmax_loss_apply(X.reshape(-1, C), target.reshape(-1).long(), a_rows)
        return loss.reshape(X.shape[:-1]).to(X.dtype)
    return _fy_loss_apply(X, target, alpha, "entmax")[0]


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
    return ops.entmax(X, alpha, -1) if kind == "entmax" else normmax_bisect(X, alpha, -1)


def _fy_alpha_slope(kind: str, p64: torch.Tensor, alpha) -> torch.Tensor:
    a = alpha.to(torch.float64) if isinstance(alpha, torch.Tensor) else float(alpha)
    return _tsallis_alpha_slope(p64, a) if kind == "entmax" else _normmax_alpha_slope(p64, a)


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
        from attnkern.autograd import _rows_to_front

        x_dim, t_dim, a_dim = in_dims[:3]
        target = target.movedim(t_dim, 0) if t_dim is not None else target.expand(info.batch_size, *target.shape)
        a_dim = a_dim if isinstance(alpha, torch.Tensor) else None
        x, _, (alpha,), _ = _rows_to_front(info.batch_size, x, x_dim, -1, [(alpha, a_dim)])
        return FYLossFunction.apply(x, target, alpha, kind), (0, 0)


_fy_loss_apply = traceable_apply(FYLossFunction)


def sparsemax_loss(X: torch.Tensor, target: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """sparsemax loss, a sparse alternative to cross-entropy.

    X: (n_samples, n_classes) scores (any leading dims, classes last);
    target: (n_samples,) int class indices. k: compatibility argument (exact for
    any value). Returns the per-sample losses, shape (n_samples,)."""
    _check_inputs(X, target)
    ops._check_k(k)
    return _entmax_family_loss(X, target, 2.0)


def sparsemax_bisect_loss(X: torch.Tensor, target: torch.Tensor, n_iter: int = 50) -> torch.Tensor:
    """sparsemax loss with the `entmax` package's bisection signature (exact;
    n_iter: any int or None; the package ignores it too). Shapes as sparsemax_loss."""
    check_n_iter(n_iter, allow_any=True)
    return sparsemax_loss(X, target)


def entmax15_loss(X: torch.Tensor, target: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """1.5-entmax loss. Shapes as sparsemax_loss; k: compatibility argument."""
    _check_inputs(X, target)
    ops._check_k(k)
    return _entmax_family_loss(X, target, 1.5)


def entmax_bisect_loss(X: torch.Tensor, target: torch.Tensor, alpha=1.5, n_iter: int = 50) -> torch.Tensor:
    """α-entmax loss, any finite α (α = 1: cross-entropy; α ≤ 0 as the `entmax`
    package computes it). Shapes as sparsemax_loss.

    alpha: a float or a tensor broadcastable to (n_samples, 1), which may
    require grad (exact gradient). n_iter: validated, results are exact."""
    _check_inputs(X, target)
    check_n_iter(n_iter)
    if not _compiling():
        alpha = check_alpha(alpha, X, X.dim() - 1, lower=None)
    return _entmax_family_loss(X, target, alpha)


def normmax_bisect_loss(X: torch.Tensor, target: torch.Tensor, alpha=2, n_iter: int = 50) -> torch.Tensor:
    """α-normmax loss, Ω(p) = ||p||_α, α > 1. Shapes and alpha as
    entmax_bisect_loss."""
    _check_inputs(X, target)
    check_n_iter(n_iter)
    if not _compiling():
        alpha = check_alpha(alpha, X, X.dim() - 1)
    _check_above_one(alpha, "alpha")
    return _fy_loss_apply(X, target, alpha, "normmax")[0]


# --- reduction and ignore_index, shared by the loss modules ---------------------------------------


def check_reduction(reduction: str, ignore_index) -> int:
    """Validates reduction; returns ignore_index as an int (it may be given as a
    Python or numpy int or a one-element integer tensor such as `y[0]`)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return as_index(ignore_index, "ignore_index")


def reduce_loss(loss_fn, X: torch.Tensor, target: torch.Tensor, ignore_index, reduction: str):
    """Per-sample losses of the samples whose target is not ignore_index (0 and no
    gradient for the others), reduced as the `entmax` package's modules do:
    "elementwise_mean" (or "mean") divides the sum by the number of samples
    that are not ignored."""
    ignored = target == as_index(ignore_index, "ignore_index")
    safe_target = torch.where(ignored, torch.zeros_like(target), target)
    loss = loss_fn(X, safe_target)
    loss = torch.where(ignored, torch.zeros_like(loss), loss)
    if reduction == "sum":
        return loss.sum()
    if reduction in ("elementwise_mean", "mean"):
        return loss.sum() / float(target.numel() - int(ignored.sum()))
    return loss
