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
  exact backward in BudgetFunction; on other devices (or backend="reference")
  the same iteration in vectorized torch ops, then τ rebuilt from the active
  set so that autograd gives the exact gradient in x and the budget.
"""

from __future__ import annotations

import math

import torch

from attnkern import ops
from attnkern.autograd import traceable_apply
from attnkern.ops import _compiling, _prologue, check_alpha, check_flag, check_n_iter


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


def _check_above_one(alpha, name: str) -> None:
    if _compiling():
        return
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() and alpha.device.type != "meta" and ops.any_true(alpha <= 1):
            raise ValueError(f"{name} must be > 1 everywhere, got min {alpha.min().item()}")
    elif alpha <= 1:
        raise ValueError(f"{name} must be > 1, got {alpha}")


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


class NormmaxFunction(torch.autograd.Function):
    """α-normmax with α fixed (no gradient in α): forward on the entmax kernels,
    backward by attnkern::normmax_bwd from the saved output. Its Jacobian in x is
    symmetric (the map is the gradient of a convex conjugate), so the same
    product serves forward mode. With create_graph the backward is the same
    product in torch ops (_normmax_product), which autograd differentiates
    again."""

    @staticmethod
    def forward(x: torch.Tensor, alpha, dim: int, backend: str) -> torch.Tensor:
        return _normmax_forward(x, alpha, dim, backend)

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
        from attnkern.autograd import _rows_to_front

        a_dim = in_dims[1] if isinstance(alpha, torch.Tensor) else None
        x, d, (alpha,), scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim, [(alpha, a_dim)])
        out = NormmaxFunction.apply(x, alpha, d, backend)
        return (out.squeeze(-1) if scalar else out), 0


_normmax_apply = traceable_apply(NormmaxFunction)


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
        alpha = check_alpha(alpha, X, dim)
    _check_above_one(alpha, "alpha")
    # An α that needs a derivative (a gradient, or a forward-mode tangent) takes
    # the composed path, which differentiates in α as well.
    needs_alpha_grad = ops.carries_derivative(alpha)
    if (X.requires_grad and torch.is_grad_enabled() and not needs_alpha_grad and X.device.type == "cpu"
            and ops.use_kernels(backend, X)):
        return _normmax_apply(X, alpha.detach() if isinstance(alpha, torch.Tensor) else alpha, dim, backend)
    return _normmax_forward(X, alpha, dim, backend)


def _normmax_forward(X: torch.Tensor, alpha, dim: int, backend: str) -> torch.Tensor:
    """α-normmax through α'-entmax; differentiable by autograd (in X and α)."""
    if isinstance(alpha, torch.Tensor):
        a = alpha.to(X.dtype if X.dtype == torch.float64 else torch.float32)
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

_BUDGET_MAX_STEPS = 100


def _budget_threshold(y: torch.Tensor, budget: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """τ with Σ clip(y - τ, 0, 1) = budget along the last dim, by Newton on the
    piecewise-linear sum, safeguarded by a bisection bracket. y: float64 rows
    (masked entries -inf); budget: (..., 1). No gradient."""
    n_valid = valid.sum(-1, keepdim=True).to(y.dtype)
    y_fin = torch.where(valid, y, torch.zeros_like(y))
    big = torch.finfo(y.dtype).max
    hi = torch.where(valid, y, torch.full_like(y, -big)).amax(-1, keepdim=True)
    # f(lo) = n_valid: every entry at least 1 above lo (with room for rounding).
    lo = torch.where(valid, y, torch.full_like(y, big)).amin(-1, keepdim=True) - 2
    hi = torch.where(n_valid > 0, hi, torch.zeros_like(hi))
    lo = torch.where(n_valid > 0, lo, torch.zeros_like(lo))
    tau = lo.clone()
    for _ in range(_BUDGET_MAX_STEPS):
        d = y_fin - tau
        inside = valid & (d > 0) & (d < 1)
        f = torch.where(valid, d.clamp(0, 1), torch.zeros_like(d)).sum(-1, keepdim=True) - budget
        k = inside.sum(-1, keepdim=True).to(y.dtype)
        lo = torch.where(f >= 0, tau, lo)
        hi = torch.where(f <= 0, tau, hi)
        newton = tau + f / k.clamp_min(1)
        ok = (k > 0) & (newton > lo) & (newton < hi)
        nxt = torch.where(ok, newton, 0.5 * (lo + hi))
        nxt = torch.where(f == 0, tau, nxt)
        if bool((nxt == tau).all()):
            break
        tau = nxt
    return tau


def _zero_budget_slope(x: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    """∂/∂budget of <grad, p> at budget = 0 (from above: the only side there is).
    For a small budget b > 0 the k entries tied at the row's max get b/k each,
    so the slope is the mean of grad over them (0 for a row with no finite
    entry). x, grad: with the row along `dim`; returns float64 keepdim rows."""
    x64 = x.detach().to(torch.float64)
    m = x64.amax(dim, keepdim=True) if x.dim() else x64
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
        top = (x64 == x64.amax(dim, keepdim=True)).to(v.dtype)
        col = torch.where(zero, top / top.sum(dim, keepdim=True).clamp_min(1), s / k.clamp_min(1))
        out = out + col * v_budget.to(v.dtype)
    return out, db


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
        from attnkern.autograd import _rows_to_front

        x, d, (budget,), scalar = _rows_to_front(info.batch_size, x, in_dims[0], dim, [(budget, in_dims[1])])
        out = BudgetFunction.apply(x, budget, d)
        return (out.squeeze(-1) if scalar else out), 0


_budget_apply = traceable_apply(BudgetFunction)


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
        budget = check_alpha(budget, X, dim, name="budget", strict=False)
    if X.device.type == "cpu" and ops.use_kernels(backend, X) and X.dim() > 0:
        b = budget if isinstance(budget, torch.Tensor) else torch.tensor(float(budget), dtype=torch.float64,
                                                                         device=X.device)
        return _budget_apply(X, b, dim)
    return _budget_torch(X, budget, dim)


def _budget_torch(X: torch.Tensor, budget, dim: int) -> torch.Tensor:
    """budget-sparsemax in vectorized torch ops (float64), for the reference
    backend and devices without a kernel."""
    z = X.movedim(dim, -1).to(torch.float64) if X.dim() else X.reshape(1).to(torch.float64)
    if isinstance(budget, torch.Tensor):
        b = budget.to(torch.float64)
        shape = list(X.shape)
        if shape:
            shape[dim] = 1
        b = b.expand(shape).movedim(dim, -1) if X.dim() else b.reshape(1)
    else:
        b = torch.full(z.shape[:-1] + (1,), float(budget), dtype=torch.float64, device=X.device)
    nan_rows = torch.isnan(z).any(-1, keepdim=True)
    valid = (z > -math.inf) & ~nan_rows
    zd = z.detach()
    with torch.no_grad():
        n_valid = valid.sum(-1, keepdim=True).to(z.dtype)
        tau0 = _budget_threshold(zd, b.detach().minimum(n_valid), valid)
        d = zd - tau0
        inside = valid & (d > 0) & (d < 1)
        capped = valid & (d >= 1)
        k = inside.sum(-1, keepdim=True)
    # τ from its active set: differentiable in z (1/k on the active entries) and
    # in the budget (-1/k); rows with no active entry are locally constant.
    z_in = torch.where(inside, z, torch.zeros_like(z))
    tau = (capped.sum(-1, keepdim=True).to(z.dtype) + z_in.sum(-1, keepdim=True) - b) / k.clamp_min(1)
    tau = torch.where(k > 0, tau, tau0)
    z_safe = torch.where(valid, z, torch.zeros_like(z))
    p = torch.where(valid, (z_safe - tau).clamp(0, 1), torch.zeros_like(z))
    # A budget at or above the number of finite entries: all of them get 1.
    p = torch.where(valid & (b.detach() >= n_valid), torch.ones_like(p), p)
    if b.requires_grad:
        # Budget 0: p = 0, and its slope in the budget is e_argmax (split over ties).
        zero = b.detach() == 0
        top = valid & (z == z.detach().where(valid, torch.full_like(z, -math.inf)).amax(-1, keepdim=True))
        share = top.to(z.dtype) / top.sum(-1, keepdim=True).clamp_min(1).to(z.dtype)
        p = p + torch.where(zero & top, (b - b.detach()) * share, torch.zeros_like(p))
    p = torch.where(nan_rows, torch.full_like(p, math.nan), p)
    p = p.to(X.dtype)
    return p.movedim(-1, dim) if X.dim() else p.reshape(())
