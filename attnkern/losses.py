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

from attnkern import autograd, ops
from attnkern.compat import normmax_bisect
from attnkern.family import acc_dtype
from attnkern.ops import _compiling
from attnkern.validation import any_true, as_index, check_k, check_n_iter, check_row_param, check_tensor

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
    n_classes = X.shape[-1]
    if target.numel() and target.device.type == "cpu" and any_true((target < 0) | (target >= n_classes)):
        raise ValueError(f"target must hold class indices in [0, {n_classes}), got min {int(target.min())}, "
                         f"max {int(target.max())}")


def _entmax_family_loss(X: torch.Tensor, target: torch.Tensor, alpha) -> torch.Tensor:
    """The α-entmax loss along the last dim, any finite α (float or per-row tensor)."""
    if X.device.type == "cpu" and ops.use_kernels("auto", X) and X.shape[-1] > 0:
        C = X.shape[-1]
        a = alpha if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=torch.float64)
        a_rows = a.to(acc_dtype(X.dtype)).expand(
            tuple(X.shape[:-1]) + (1,)).reshape(-1)
        loss, _ = autograd.entmax_loss_apply(X.reshape(-1, C), target.reshape(-1).long(), a_rows)
        return loss.reshape(X.shape[:-1]).to(X.dtype)
    return autograd.fy_loss_apply(X, target, alpha, "entmax")[0]


def sparsemax_loss(X: torch.Tensor, target: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """sparsemax loss, a sparse alternative to cross-entropy.

    X: (n_samples, n_classes) scores (any leading dims, classes last);
    target: (n_samples,) int class indices. k: compatibility argument (exact for
    any value). Returns the per-sample losses, shape (n_samples,)."""
    _check_inputs(X, target)
    check_k(k)
    return _entmax_family_loss(X, target, 2.0)


def sparsemax_bisect_loss(X: torch.Tensor, target: torch.Tensor, n_iter: int = 50) -> torch.Tensor:
    """sparsemax loss with the `entmax` package's bisection signature (exact;
    n_iter: any int or None; the package ignores it too). Shapes as sparsemax_loss."""
    check_n_iter(n_iter, allow_any=True)
    return sparsemax_loss(X, target)


def entmax15_loss(X: torch.Tensor, target: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """1.5-entmax loss. Shapes as sparsemax_loss; k: compatibility argument."""
    _check_inputs(X, target)
    check_k(k)
    return _entmax_family_loss(X, target, 1.5)


def entmax_bisect_loss(X: torch.Tensor, target: torch.Tensor, alpha=1.5, n_iter: int = 50) -> torch.Tensor:
    """α-entmax loss, any finite α (α = 1: cross-entropy; α ≤ 0 as the `entmax`
    package computes it). Shapes as sparsemax_loss.

    alpha: a float or a tensor broadcastable to (n_samples, 1), which may
    require grad (exact gradient). n_iter: validated, results are exact."""
    _check_inputs(X, target)
    check_n_iter(n_iter)
    if not _compiling():
        alpha = check_row_param(alpha, X, X.dim() - 1, lower=None)
    return _entmax_family_loss(X, target, alpha)


def normmax_bisect_loss(X: torch.Tensor, target: torch.Tensor, alpha=2, n_iter: int = 50) -> torch.Tensor:
    """α-normmax loss, Ω(p) = ||p||_α, α > 1. Shapes and alpha as
    entmax_bisect_loss."""
    _check_inputs(X, target)
    check_n_iter(n_iter)
    if not _compiling():
        alpha = check_row_param(alpha, X, X.dim() - 1, lower=1.0)
    return autograd.fy_loss_apply(X, target, alpha, "normmax")[0]


autograd.register_composed_forward("entmax_predict", lambda X, alpha: ops.entmax(X, alpha, -1))
autograd.register_composed_forward("normmax_predict", lambda X, alpha: normmax_bisect(X, alpha, -1))


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
