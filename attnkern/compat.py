"""The rest of the `entmax` package's root-finding API: sparsemax_bisect,
normmax_bisect and budget_bisect.

The `entmax` package solves each of these by a fixed number of bisection
steps. Here each is exact (converged to the dtype's resolution whatever
`n_iter` is) and differentiable in every tensor argument:

- sparsemax_bisect is sparsemax (the same problem, solved exactly).
- α-normmax reduces to α'-entmax with α' = 2 - 1/α: the optimality conditions
  give p ∝ [x - τ]_+^(1/(α-1)) with Σ [x - τ]_+^(α/(α-1)) = 1, so
  r = entmax_{α'}(x·α/(α-1)) = [x - τ]_+^(α/(α-1)) and p = r^(1/α) / Σ r^(1/α).
  It runs on the entmax kernels (entmax15 for α = 2). The gradient in x comes
  from the closed-form attnkern::normmax_bwd kernel (csrc/cpu/normmax.cpp);
  when α is a tensor that requires grad, autograd through the entmax kernels
  gives the exact gradient in x and α.
- budget-sparsemax, p = clip(x - τ, 0, 1) with Σ p = budget, is solved by a
  bracketed active-set Newton iteration (exact once the active set is right):
  per row in the attnkern::budget_fwd kernel (csrc/cpu/budget.cpp), with the
  exact backward in attnkern.autograd.BudgetFunction; on other devices (or backend="reference")
  the same iteration in vectorized torch ops (reference.budget_sparsemax), then τ rebuilt from the active
  set so that autograd gives the exact gradient in x and the budget.
"""

from __future__ import annotations

import torch

from attnkern import autograd, ops
from attnkern.backends import reference
from attnkern.family import acc_dtype
from attnkern.ops import _compiling, _prologue
from attnkern.validation import check_flag, check_n_iter, check_row_param


def sparsemax_bisect(X: torch.Tensor, dim: int = -1, n_iter: int = 50, ensure_sum_one: bool = True, *,
                     backend: str = "auto") -> torch.Tensor:
    """sparsemax along `dim` with the `entmax` package's `sparsemax_bisect`
    signature: argmin_{p in Δ} ||p - X||². Exact: n_iter (any int, or None, as
    the package's SparsemaxBisect passes it; the package ignores it here too) and
    ensure_sum_one are accepted and change nothing. X: any shape, floating point."""
    check_n_iter(n_iter, allow_any=True)
    if not _compiling():
        check_flag(ensure_sum_one, "ensure_sum_one")
    return ops.sparsemax(X, dim, backend=backend)


def normmax_bisect(X: torch.Tensor, alpha=2, dim: int = -1, n_iter: int = 50, *,
                   backend: str = "auto") -> torch.Tensor:
    """α-normmax along `dim`: argmax_{p in Δ} <p, X> - ||p||_α.

    X: any shape, floating point. alpha: a float > 1 or a tensor broadcastable to
    X with size 1 along `dim` (one α per row), which may require grad (the
    `entmax` package has no gradient in α). n_iter: validated, results are exact.
    Rows of only -inf give zeros; NaN stays in its row.
    """
    dim = _prologue(X, dim)
    check_n_iter(n_iter)
    if not _compiling():
        alpha = check_row_param(alpha, X, dim, lower=1.0)
    # An α that needs a derivative (a gradient, or a forward-mode tangent) takes
    # the composed path, which differentiates in α as well.
    needs_alpha_grad = ops.carries_derivative(alpha)
    # Under torch.compile the composed path too: torch 2.11's dynamo traced the
    # Function (whose forward applies entmax's) into zero gradients.
    if (X.requires_grad and torch.is_grad_enabled() and not needs_alpha_grad and X.device.type == "cpu"
            and ops.use_kernels(backend, X) and not _compiling()):
        return autograd.normmax_apply(X, alpha.detach() if isinstance(alpha, torch.Tensor) else alpha, dim, backend)
    return _normmax_forward(X, alpha, dim, backend)


def _normmax_forward(X: torch.Tensor, alpha, dim: int, backend: str) -> torch.Tensor:
    """α-normmax through α'-entmax; differentiable by autograd (in X and α)."""
    if isinstance(alpha, torch.Tensor):
        a = alpha.to(acc_dtype(X.dtype))
        inner = 2.0 - 1.0 / a
        scale = a / (a - 1.0)
    else:
        a = float(alpha)
        inner = 2.0 - 1.0 / a
        scale = a / (a - 1.0)
    r = ops.entmax(X * scale, inner, dim, backend=backend)
    if ops.carries_derivative(r):
        # r^(1/α) has an infinite slope at 0: keep r = 0 (outside the support,
        # where the entmax backward gives no gradient) off that branch.
        pos = r > 0
        q = torch.where(pos, torch.where(pos, r, torch.ones_like(r)) ** (1.0 / a), r)
    else:
        q = r.pow_(1.0 / a) if not isinstance(a, torch.Tensor) else r.pow_((1.0 / a).to(r.dtype))
    total = q.sum(dim, keepdim=True)
    total = torch.where(total > 0, total, torch.ones_like(total))
    return q / total if ops.carries_derivative(q) else q.div_(total)



# --- budget-sparsemax --------------------------------------------------------------------------



def budget_bisect(X: torch.Tensor, budget=2, dim: int = -1, n_iter: int = 50, *,
                  backend: str = "auto") -> torch.Tensor:
    """budget-sparsemax along `dim`: argmax_{p} <p, X> - ½||p||² subject to
    0 ≤ p ≤ 1 and Σ p = budget (a k-subset relaxation).

    X: any shape, floating point. budget: a float ≥ 0 or a tensor broadcastable
    to X with size 1 along `dim`, which may require grad. A budget at or above
    the number of finite entries gives 1 on each of them; budget 0 gives zeros
    (the limit of the family, as the `entmax` package), with gradient 0 in X and
    the one-sided slope in the budget (grad at the row's argmax). Rows of only
    -inf give zeros; NaN stays in its row. n_iter: validated, results are exact.
    """
    dim = _prologue(X, dim)
    check_n_iter(n_iter)
    if not _compiling():
        budget = check_row_param(budget, X, dim, name="budget", strict=False)
    if X.device.type == "cpu" and ops.use_kernels(backend, X) and X.dim() > 0:
        b = budget if isinstance(budget, torch.Tensor) else torch.tensor(float(budget), dtype=torch.float64,
                                                                         device=X.device)
        return autograd.budget_apply(X, b, dim)
    return reference.budget_sparsemax(X, budget, dim)


autograd.register_composed_forward("normmax", _normmax_forward)
