"""Eager PyTorch oracle for every attnkern op.

Runs on any device, differentiable by autograd, computed in float64 and
returned in the input's dtype. The algorithms here are deliberately different
from the kernels' (sorting for sparsemax and entmax15, bisection for other α,
autograd instead of hand-written backward formulas) so that the two can check
each other.

Conventions shared with the kernels (see docs/algorithms.md):
- a -inf score gets probability exactly 0; a row of only -inf gives zeros;
- a NaN anywhere in a row makes that whole row NaN, and no other row;
- α = 1 is softmax; the family is continuous there.
"""

from __future__ import annotations

import math

import torch

from attnkern.family import STRUCTURED_NORMALIZERS, Family
from attnkern.validation import any_true

# Bisection steps: the bracket is at most ln(n) + 1 wide, so 100 halvings
# reach float64 resolution for any row length.
_BISECT_STEPS = 100
# A finite stand-in for -inf scores in the sorting algorithms; far below any
# support threshold once the row max is subtracted.
_FAR = -1e30


def _rows_last(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x in float64 with `dim` last; a 0-d x is one row of one entry, as the
    kernels take it."""
    return (x.movedim(dim, -1) if x.dim() else x.reshape(1)).to(torch.float64)


def _finish(p64: torch.Tensor, x: torch.Tensor, dim: int, nan_rows: torch.Tensor) -> torch.Tensor:
    p64 = torch.where(nan_rows, torch.full_like(p64, math.nan), p64)
    return (p64.movedim(-1, dim) if x.dim() else p64.reshape(())).to(x.dtype)


def _no_entries(x: torch.Tensor, dim: int, a: torch.Tensor | None = None) -> torch.Tensor:
    """The output for an input with no entries (rows of length 0, or no rows):
    an empty tensor of x's shape and dtype. It is computed from x (and from the
    α rows `a`), so that backward runs and gives them their empty or zero
    gradients, as the kernels' backward does."""
    p = _rows_last(x, dim) * 0
    if a is not None:
        p = p + a * 0
    return p.movedim(-1, dim).to(x.dtype)


def _prepare(x: torch.Tensor, dim: int):
    """Scores along the last dim, in float64, shifted by the row max, with -inf
    (and the rows that are all -inf) tracked separately."""
    z = _rows_last(x, dim)
    nan_rows = torch.isnan(z).any(-1, keepdim=True)
    posinf_rows = (z == math.inf).any(-1, keepdim=True)
    valid = z > -math.inf
    empty_rows = ~valid.any(-1, keepdim=True)
    z_safe = torch.where(valid, z, torch.zeros_like(z))
    z_safe = torch.where(nan_rows | posinf_rows, torch.zeros_like(z), z_safe)
    m = z_safe.masked_fill(~valid, -math.inf).amax(-1, keepdim=True)
    m = torch.where(empty_rows, torch.zeros_like(m), m).detach()
    y = torch.where(valid, z_safe - m, torch.full_like(z, _FAR))
    return y, valid, empty_rows, nan_rows | posinf_rows


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax(x)_i = exp(x_i) / Σ_j exp(x_j) along `dim`; rows of only -inf give 0."""
    if not x.numel():
        return _no_entries(x, dim)
    y, valid, empty, bad = _prepare(x, dim)
    e = torch.exp(y) * valid
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    p = torch.where(empty, torch.zeros_like(p), p)
    return _finish(p, x, dim, bad)


def sparsemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Euclidean projection onto the simplex, argmin_{p in Δ} ||p - x||², by sorting."""
    if not x.numel():
        return _no_entries(x, dim)
    y, valid, empty, bad = _prepare(x, dim)
    ys, _ = torch.sort(y, dim=-1, descending=True)
    n = y.shape[-1]
    k = torch.arange(1, n + 1, device=y.device, dtype=y.dtype)
    cs = ys.cumsum(-1)
    in_support = 1 + k * ys > cs
    ksz = in_support.sum(-1, keepdim=True).clamp_min(1)
    tau = (cs.gather(-1, ksz - 1) - 1) / ksz.to(y.dtype)
    p = torch.clamp(y - tau, min=0) * valid
    p = torch.where(empty, torch.zeros_like(p), p)
    return _finish(p, x, dim, bad)


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax, argmax_{p in Δ} <p, x> + H_1.5(p), by sorting (Peters et al., 2019)."""
    if not x.numel():
        return _no_entries(x, dim)
    y, valid, empty, bad = _prepare(x, dim)
    z = y / 2
    zs, _ = torch.sort(z, dim=-1, descending=True)
    n = z.shape[-1]
    rho = torch.arange(1, n + 1, device=z.device, dtype=z.dtype)
    mean = zs.cumsum(-1) / rho
    # Prefix variance about the running mean; the stand-in -1e30 entries only
    # appear after the support, where these values are not used.
    mean_sq = (zs * zs).cumsum(-1) / rho
    ss = rho * (mean_sq - mean * mean)
    delta = (1 - ss) / rho
    tau = mean - torch.sqrt(torch.clamp(delta, min=0))
    ksz = (tau <= zs).sum(-1, keepdim=True).clamp_min(1)
    tau_star = tau.gather(-1, ksz - 1)
    p = torch.clamp(z - tau_star, min=0) ** 2 * valid
    p = torch.where(empty, torch.zeros_like(p), p)
    return _finish(p, x, dim, bad)


def _phi(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[1 + b t]_+^(1/b), differentiable in t and b, 0 (with 0 gradient) outside the support."""
    bt = b * t
    inside = bt > -1
    safe = torch.where(inside, bt, torch.zeros_like(bt))
    return torch.where(inside, torch.exp(torch.log1p(safe) / b), torch.zeros_like(bt))


def _alpha_rows(alpha, x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    if shape:
        shape[dim] = 1
    if isinstance(alpha, torch.Tensor):
        a = alpha
    else:
        a = torch.tensor(float(alpha), dtype=torch.float64, device=x.device)
    return _rows_last(a.to(torch.float64).expand(shape), dim)


def _map_sparse(y: torch.Tensor, c: torch.Tensor, b: torch.Tensor):
    """α > 1 (b > 0) at the shift c: p = φ_b(y - c) and d = 1 + b(y - c), so that
    -∂p/∂c = p/d on the support."""
    return _phi(y - c, b), 1 + b * (y - c)


def _map_dense(y: torch.Tensor, s: torch.Tensor, beta: torch.Tensor):
    """α < 1 (β = 1 - α > 0) at the shift c = expm1(β s)/β, i.e. with the shift
    on a log scale: p = φ_-β(y - c) = exp(-s) (1 + w)^(-1/β) with
    w = -y β exp(-β s) >= 0 (y <= 0), and d = 1 + w, so that -∂p/∂s = p/d.

    c itself overflows float64 once β ln n > 709 (it reaches (n^β - 1)/β for n
    equal scores), while s stays in [0, ln n] for every β: at s = 0 the top
    entry alone has p = 1, and at s = ln n every entry has p <= 1/n."""
    w = -y * torch.exp(torch.log(beta) - beta * s)
    return torch.exp(-s - torch.log1p(w) / beta), 1 + w


def _edge_probs(z: torch.Tensor, valid: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """α > 2 (b > 1) in p-space: p of every row of scores z (float64, -inf
    where not valid), differentiable in z and b.

    The shift form needs 1 + b(y - c) = p^b at the edge of the support, below
    float64 resolution for small p at large α (1e-36 for p = 1e-4 at α = 10).
    Measured from the support's smallest score z_r, each other support entry
    is p_i = (q^b + b(z_i - z_r))^(1/b), accurate to the rounding of z_i - z_r,
    and q = p_r solves the well-conditioned F(q) = q + Σ_(i ≠ r) p_i(q) = 1
    (convex and increasing, F' >= 1). The support is chosen by the sort-based
    rule: z_j is inside iff Σ_(z_i > z_j) (b(z_i - z_j))^(1/b) < 1. q is found
    by bisection without gradient, then made differentiable by two Newton
    steps, as the shift is in `entmax`.
    """
    n = z.shape[-1]
    zv = torch.where(valid, z, torch.full_like(z, -math.inf))
    with torch.no_grad():
        zd, bd = zv.detach(), b.detach()
        zs, order = torch.sort(zd, dim=-1, descending=True)
        count = valid.sum(-1, keepdim=True)
        lo = torch.zeros_like(count)  # a sorted position inside the support
        hi = count  # one outside it (or past the valid entries)
        for _ in range(max(1, n).bit_length() + 1):
            mid = (lo + hi) // 2
            zj = zs.gather(-1, mid.clamp(max=n - 1))
            mass = (torch.clamp(bd * (zd - zj), min=0) ** (1 / bd)).sum(-1, keepdim=True)
            move = hi - lo > 1
            lo = torch.where(move & (mass < 1), mid, lo)
            hi = torch.where(move & ~(mass < 1), mid, hi)
        r = order.gather(-1, lo)  # the support's smallest score (the last of its ties)
        zr = zd.gather(-1, r)
        others = (zd >= zr) & (torch.arange(n, device=z.device) != r)
        terms = torch.where(others, bd * (zd - zr), torch.zeros_like(zd))

        def mass_d(q):
            return q + torch.where(others, (q ** bd + terms) ** (1 / bd), torch.zeros_like(zd)).sum(-1, keepdim=True)

        qlo, qhi = torch.zeros_like(zr), torch.ones_like(zr)
        for _ in range(_BISECT_STEPS):
            qm = 0.5 * (qlo + qhi)
            big = mass_d(qm) >= 1
            qlo, qhi = torch.where(big, qlo, qm), torch.where(big, qm, qhi)
        q = 0.5 * (qlo + qhi)
    zr = z.gather(-1, r)
    diff = torch.where(others, z - zr, torch.zeros_like(z))

    def others_p(q):
        u = torch.where(others, q ** b + b * diff, torch.ones_like(z))
        return torch.where(others, u ** (1 / b), torch.zeros_like(z)), u

    for _ in range(2):
        po, u = others_p(q)
        slope = 1 + (q ** (b - 1) * torch.where(others, po / u, torch.zeros_like(z))).sum(-1, keepdim=True)
        q = q - (q + po.sum(-1, keepdim=True) - 1) / slope
    po, _ = others_p(q)
    is_r = torch.arange(n, device=z.device) == r
    return torch.where(is_r, q.expand_as(z), po) * valid


def entmax(x: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """α-entmax, argmax_{p in Δ} <p, x> + H^T_α(p) (Tsallis entropy), any finite α.

    alpha: float, or tensor broadcastable to x with size 1 along `dim`; may
    require grad. The shift is found by bisection (no gradient) and made
    differentiable with one implicit-function step, so autograd gives the exact
    gradient in x and α. Rows with α > 1 solve for the shift c of
    docs/algorithms.md, rows with α < 1 for its log-scale form (_map_dense).
    """
    if not x.numel():
        return _no_entries(x, dim, _alpha_rows(alpha, x, dim))
    y, valid, empty, bad = _prepare(x, dim)
    a = _alpha_rows(alpha, x, dim)
    b = a - 1
    soft = b == 0
    b_safe = torch.where(soft, torch.full_like(b, 0.5), b)
    # Each row takes one of the two maps; the other is evaluated at a harmless
    # parameter (b = 1/2, β = 1) so that it stays finite and sends no NaN into
    # the gradients through torch.where.
    dense = b_safe < 0
    b_sparse = torch.where(dense, torch.full_like(b_safe, 0.5), b_safe)
    beta = torch.where(dense, -b_safe, torch.ones_like(b_safe))
    y_dense = torch.where(valid, y, torch.zeros_like(y))
    n = y.shape[-1]
    # Only the maps some row takes are evaluated (the oracle's cost is in the
    # bisection); where the values cannot be read (torch.func.vmap), both are.
    some_dense, some_sparse = any_true(dense, under_vmap=True), any_true(~dense, under_vmap=True)

    def rows(y, y_dense, t, b_sparse, beta, slope=True):
        """p at the shift t of each row (c or s), and g = -∂p/∂t (0 off the support)."""
        if not some_dense:
            p, d = _map_sparse(y, t, b_sparse)
        elif not some_sparse:
            p, d = _map_dense(y_dense, t, beta)
        else:
            p_s, d_s = _map_sparse(y, t, b_sparse)
            p_d, d_d = _map_dense(y_dense, t, beta)
            p, d = torch.where(dense, p_d, p_s), torch.where(dense, d_d, d_s)
        p = p * valid
        if not slope:
            return p, None
        g = torch.where(p > 0, p / torch.where(p > 0, d, torch.ones_like(d)), torch.zeros_like(p))
        return p, g

    with torch.no_grad():
        bd, betad = b_sparse.detach(), beta.detach()
        yd, ydd = y.detach(), y_dense.detach()
        lo = torch.zeros_like(bd)
        hi = -torch.expm1(-bd * math.log(n)) / bd if n > 1 else torch.zeros_like(bd)
        hi = torch.where(dense, torch.full_like(hi, math.log(n)), hi)
        for _ in range(_BISECT_STEPS):
            mid = 0.5 * (lo + hi)
            big = rows(yd, ydd, mid, bd, betad, slope=False)[0].sum(-1, keepdim=True) >= 1
            lo = torch.where(big, mid, lo)
            hi = torch.where(big, hi, mid)
        t0 = 0.5 * (lo + hi)
        g0 = rows(yd, ydd, t0, bd, betad)[1].sum(-1, keepdim=True)
        # Rows with no support (all -inf) are zeroed below; keep their
        # (unused) branch finite so no NaN reaches the gradients.
        g0 = torch.where(g0 > 0, g0, torch.ones_like(g0))

    # Implicit function step: value t0, gradient -F_x/F_t and -F_b/F_t.
    f = rows(y, y_dense, t0, b_sparse, beta, slope=False)[0].sum(-1, keepdim=True) - 1
    t = t0 + f / g0
    # A second, differentiable Newton step: the first step's error is quadratic
    # in a perturbation of the inputs, so after this one t is exact to third
    # order and autograd's second derivatives (double backward, jvp of vjp)
    # are exact as well.
    pt, gt = rows(y, y_dense, t, b_sparse, beta)
    gt = gt.sum(-1, keepdim=True)
    t = t + (pt.sum(-1, keepdim=True) - 1) / torch.where(gt > 0, gt, torch.ones_like(gt))
    p = rows(y, y_dense, t, b_sparse, beta, slope=False)[0]
    p = p / p.sum(-1, keepdim=True).detach().clamp_min(1e-300)
    edge = b > 1
    if any_true(edge, under_vmap=True):
        # (Rows that are empty, hold a NaN or +inf, or take the other map are
        # evaluated on zeros at b = 2, finite, and not used.)
        ok = edge & ~empty & ~bad
        z = _rows_last(x, dim)
        z = torch.where(valid & ok, z, torch.zeros_like(z))
        p_edge = _edge_probs(z, valid | ~ok, torch.where(ok, b, torch.full_like(b, 2.0)))
        p = torch.where(edge, p_edge * valid, p)

    # Rows at α = 1: softmax, with the α-derivative of the family at α = 1,
    # dp/dα = -p/2 ((ln p)² - Σ p (ln p)²), attached to α.
    ps = softmax(y.masked_fill(~valid, -math.inf), -1)
    ln = torch.where(ps > 0, torch.log(ps.clamp_min(1e-300)), torch.zeros_like(ps))
    dpda = -0.5 * ps * (ln * ln - (ps * ln * ln).sum(-1, keepdim=True))
    p_soft = ps + (a - a.detach()) * dpda
    p = torch.where(soft, p_soft, p)
    p = torch.where(empty, torch.zeros_like(p), p)
    return _finish(p, x, dim, bad)


def entmax_bisect(x: torch.Tensor, alpha=1.5, dim: int = -1) -> torch.Tensor:
    return entmax(x, alpha, dim)


# The fixed members of the family (entmax takes α).
NORMALIZE = {Family.SOFTMAX: softmax, Family.SPARSEMAX: sparsemax, Family.ENTMAX15: entmax15}


# --- fused attention ----------------------------------------------------------


def expand_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """k and v with their heads repeated to q's: with H query heads and Hk key/value
    heads (H a multiple of Hk), query head h uses key/value head h // (H // Hk).
    A single key/value head (Hk = 1) and tensors under 3 dims broadcast as they are."""
    if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3] and k.shape[-3] > 1:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    return k, v


def attention_scores(q: torch.Tensor, k: torch.Tensor, attn_mask=None, is_causal: bool = False,
                     scale=None) -> torch.Tensor:
    """The attention scores s = scale·q·kᵀ (..., L, S) in q's dtype, with the
    masks: is_causal sets s_ij = -inf for j > i (top-left alignment), a bool
    attn_mask sets -inf where it is False, a float one is added. k has q's heads
    (expand_kv_heads); scale defaults to 1/sqrt(E)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = scale * (q @ k.transpose(-2, -1))
    if is_causal:
        L, S = s.shape[-2:]
        allowed = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, -math.inf)
        else:
            s = s + attn_mask.to(s.dtype)
    return s


def band_allows(i, j, L: int, sb, *, is_causal: bool = False, window=None) -> torch.Tensor:
    """Whether query rows i may see keys j (broadcastable integer tensors)
    under is_causal and window, sb the valid key count (broadcastable):
    band_mask's rule, for callers that need it at chosen positions only."""
    allowed = j < sb
    if is_causal:
        allowed = allowed & (j <= i)
    if window is not None:
        left, right = window
        diag = i + sb - L
        if left >= 0:
            allowed = allowed & (j >= diag - left)
        if right >= 0:
            allowed = allowed & (j <= diag + right)
    return allowed


def band_mask(L: int, S: int, *, is_causal: bool = False, window=None, cache_seqlens=None,
              device=None) -> torch.Tensor:
    """Which keys each query may see, as a dense bool mask (True = allowed):
    (L, S), or (B, 1, L, S) with cache_seqlens (B,) valid keys per batch
    element. is_causal: j <= i (top-left). window (left, right), -1 for
    unbounded: i + S_b - L - left <= j <= i + S_b - L + right, S_b the batch
    element's key count (bottom-right alignment); keys j >= S_b are never
    allowed. The oracle of the kernels' key bands."""
    i = torch.arange(L, device=device).view(-1, 1)
    j = torch.arange(S, device=device).view(1, -1)
    if cache_seqlens is None:
        sb = torch.tensor(S, device=device)
    else:
        sb = cache_seqlens.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    allowed = band_allows(i, j, L, sb, is_causal=is_causal, window=window)
    # (Without a term in i the mask has not grown to the query rows yet.)
    return allowed.expand((L, S) if cache_seqlens is None else (sb.shape[0], 1, L, S))


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
              is_causal: bool = False, scale=None, *, normalizer: str = "softmax", alpha=None, lam=None,
              dropout_p: float = 0.0, dropout_mask: torch.Tensor | None = None, return_weights: bool = False):
    """Unfused attention in float64: p = normalizer(scale·q·kᵀ + mask) along keys, out = p·v.

    query (..., H, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev) with H a
    multiple of Hk (query head h uses key/value head h // (H // Hk)); leading
    dims broadcast. attn_mask: None, bool (True = takes part) or float (added),
    broadcastable to (..., H, L, S). is_causal: query i sees keys j <= i.
    alpha ("entmax" only): float, or tensor broadcastable to (..., H, 1, 1).
    lam ("fusedmax", "oscarmax" only): the same (None: 1.0); each row of scores
      goes through the row-wise reference of that name.
    dropout_p: dropout on p before p·v (as torch's MultiheadAttention): each
      weight is kept with probability 1 - dropout_p and scaled by 1 / (1 - dropout_p).
    dropout_mask: the keep mask (bool, broadcastable to (..., H, L, S)) to use
      instead of drawing one, e.g. the one a kernel drew
      (attnkern.testing.attention_dropout_mask).
    A query with no allowed key gets p = 0 and output 0.
    Returns out (..., H, L, Ev) in query's dtype, and p (the weights used) if
    return_weights.
    """
    q, k, v = query.to(torch.float64), key.to(torch.float64), value.to(torch.float64)
    k, v = expand_kv_heads(q, k, v)
    s = attention_scores(q, k, attn_mask, is_causal, scale)
    # Rows with no allowed key are normalized as zeros here and zeroed after,
    # so that no gradient (in α either) goes through them.
    empty = (s == -math.inf).all(-1, keepdim=True)
    s = torch.where(empty, torch.zeros_like(s), s)
    if normalizer in STRUCTURED_NORMALIZERS:
        lam = 1.0 if lam is None else lam
        lam = lam.to(device=s.device, dtype=torch.float64) if isinstance(lam, torch.Tensor) else lam
        p = (fusedmax if normalizer == "fusedmax" else oscarmax)(s, lam, -1)
    elif (family := Family.of(normalizer)).takes_alpha:
        a = alpha if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=torch.float64)
        p = entmax(s, a.to(device=s.device, dtype=torch.float64), -1)
    else:
        p = NORMALIZE[family](s, -1)
    p = torch.where(empty, torch.zeros_like(p), p)
    if dropout_mask is not None:
        p = p * dropout_mask.to(device=p.device, dtype=p.dtype) / (1.0 - dropout_p)
    elif dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    out = (p @ v).to(query.dtype)
    return (out, p.to(query.dtype)) if return_weights else out


# --- budget-sparsemax (attnkern.budget_bisect) ------------------------------------------------

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


def budget_sparsemax(X: torch.Tensor, budget, dim: int = -1) -> torch.Tensor:
    """budget-sparsemax along `dim`, p = clip(X - τ, 0, 1) with Σ p = budget, in
    vectorized torch ops (float64): a bracketed active-set Newton iteration for
    τ, then τ rebuilt from the active set so that autograd gives the exact
    gradient in X and the budget. budget: a float ≥ 0 or a tensor broadcastable
    to X with size 1 along `dim`. Serves the reference backend and devices
    without a kernel."""
    if not X.numel():
        # No entries (rows of length 0, or no rows): an empty output, computed
        # from X and the budget so that backward gives them their gradients.
        p = X * 0
        return p + (budget * 0).to(X.dtype) if isinstance(budget, torch.Tensor) else p
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
    # Only the active entries move with z and τ (slope 1, their values clamped
    # to [0, 1] against rounding without touching that slope); the others are
    # constants 0 or 1. (Not left to clamp's gradient at its bounds, which
    # torch versions differ on.)
    d_act = z_safe - tau
    d_act = d_act + (d_act.clamp(0, 1) - d_act).detach()
    p = torch.where(inside, d_act, capped.to(z.dtype))
    # A budget at or above the number of finite entries: all of them get 1.
    p = torch.where(valid & (b.detach() >= n_valid), torch.ones_like(p), p)
    if b.requires_grad:
        # Budget 0: p = 0, and its slope in the budget is e_argmax (split over ties),
        # unless the threshold search stopped just below the max, where the active
        # set (the max alone) already gives that slope.
        zero = (b.detach() == 0) & (k == 0)
        top = valid & (z == z.detach().where(valid, torch.full_like(z, -math.inf)).amax(-1, keepdim=True))
        share = top.to(z.dtype) / top.sum(-1, keepdim=True).clamp_min(1).to(z.dtype)
        p = p + torch.where(zero & top, (b - b.detach()) * share, torch.zeros_like(p))
    p = torch.where(nan_rows, torch.full_like(p, math.nan), p)
    p = p.to(X.dtype)
    return p.movedim(-1, dim) if X.dim() else p.reshape(())


# --- structured normalizers ---------------------------------------------------------------------


def _tv_segments(x: list[float], lam: float) -> list[tuple[int, int, float]]:
    """The segments (first, last, value) of prox_{lam·TV}(x), the 1-D total
    variation denoising, by the taut string: the running sum of the solution
    is the shortest path from (0, 0) to (n, Σx) that stays within lam of the
    running sums of x at the interior points, and y is its slope. (The kernels
    run Condat's algorithm instead.) O(n²) at worst: an oracle, not a kernel."""
    n = len(x)
    cum = [0.0]
    for v in x:
        cum.append(cum[-1] + v)
    segments = []
    start, height = 0, 0.0
    while start < n:
        # The steepest slope the upper tube allows so far and the flattest the
        # lower one demands, with the points that set them.
        up, up_at, down, down_at = math.inf, start, -math.inf, start
        knot = None
        for k in range(start + 1, n + 1):
            top, bottom = (cum[n], cum[n]) if k == n else (cum[k] + lam, cum[k] - lam)
            s_top, s_bottom = (top - height) / (k - start), (bottom - height) / (k - start)
            if s_bottom > up:  # must rise past the upper tube's tightest point: bend there
                knot = (up_at, up, cum[up_at] + lam)
                break
            if s_top < down:  # must fall past the lower tube's tightest point
                knot = (down_at, down, cum[down_at] - lam)
                break
            if s_top < up:
                up, up_at = s_top, k
            if s_bottom > down:
                down, down_at = s_bottom, k
        if knot is None:
            knot = (n, (cum[n] - height) / (n - start), cum[n])
        end, slope, height = knot
        segments.append((start, end - 1, slope))
        start = end
    return segments


def _oscar_clusters(x: list[float], lam: float) -> list[tuple[list[int], float, float]]:
    """The clusters of prox_{lam·OSCAR}(x): (indices, magnitude before the clip
    at 0, mean OWL weight / lam) in decreasing |x|, by a stack of pooled blocks
    over |x|_(k) - lam·(m-1-k) merged while they increase (pool adjacent
    violators, from scratch: the kernels keep running sums instead)."""
    m = len(x)
    order = sorted(range(m), key=lambda i: -abs(x[i]))

    def level(block):
        return sum(abs(x[order[j]]) - lam * (m - 1 - j) for j in block) / len(block)

    blocks: list[list[int]] = []  # positions k in the sorted order
    for k in range(m):
        blocks.append([k])
        while len(blocks) >= 2 and level(blocks[-2]) < level(blocks[-1]):
            blocks[-2:] = [blocks[-2] + blocks[-1]]
    return [([order[j] for j in block], level(block), sum(m - 1 - j for j in block) / len(block))
            for block in blocks]


def _structured_rows(x: torch.Tensor, lam, dim: int, row_prox) -> torch.Tensor:
    """sparsemax(row_prox(finite entries, lam of the row)) along dim, -inf entries
    removed; NaN and +inf rows give NaN (as sparsemax gives them)."""
    if not x.numel():
        return _no_entries(x, dim)
    z = _rows_last(x, dim)
    n = z.shape[-1]
    rows = z.reshape(-1, n)
    row_shape = list(x.shape)
    if row_shape:
        row_shape[dim] = 1
    lam_t = lam if isinstance(lam, torch.Tensor) else torch.tensor(float(lam), dtype=torch.float64, device=z.device)
    lam_rows = lam_t.to(torch.float64).expand(row_shape)
    lam_rows = (lam_rows.movedim(dim, -1) if lam_rows.dim() else lam_rows.reshape(1)).reshape(-1)
    ys = []
    for r in range(rows.shape[0]):
        row = rows[r]
        finite = row > -math.inf
        if bool(torch.isnan(row).any()) or bool((row == math.inf).any()) or not bool(finite.any()):
            ys.append(row)  # sparsemax gives the NaN row, or the zeros of a row of -inf
            continue
        pos = finite.nonzero().squeeze(-1)
        ys.append(torch.full_like(row, -math.inf).index_put((pos,), row_prox(row[pos], lam_rows[r])))
    p = sparsemax(torch.stack(ys).reshape(z.shape), -1)
    return (p.movedim(-1, dim) if x.dim() else p.reshape(())).to(x.dtype)


def _tv_prox_row(xs: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    # The taut string can bend where its slope does not change (collinear
    # tube points, as on rows of plateaus); such pieces are one segment of y,
    # whose value the formula below needs whole (the dual between them is not
    # ±lam), so pieces of equal slope, up to rounding, are merged first.
    segments = []
    for a, b, value in _tv_segments(xs.detach().tolist(), float(lam.detach())):
        if segments and abs(segments[-1][2] - value) <= 1e-12 * (1.0 + abs(value)):
            first, _, previous = segments[-1]
            segments[-1] = (first, b, previous)
        else:
            segments.append((a, b, value))
    pieces = []
    def jump(lower, upper):  # sign(upper - lower), 0 when equal
        return float((upper > lower) - (upper < lower))

    for j, (a, b, value) in enumerate(segments):
        left = 0.0 if j == 0 else jump(segments[j - 1][2], value)
        right = 0.0 if j == len(segments) - 1 else jump(value, segments[j + 1][2])
        size = b - a + 1
        pieces.append((xs[a:b + 1].mean() + lam * (right - left) / size).expand(size))
    return torch.cat(pieces)


def _oscar_prox_row(xs: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(xs)
    for idx, level, weight in _oscar_clusters(xs.detach().tolist(), float(lam.detach())):
        if level > 0:
            at = torch.tensor(idx, device=xs.device)
            y = y.index_put((at,), torch.sign(xs[at]) * (xs[at].abs().mean() - lam * weight))
    return y


def fusedmax(x: torch.Tensor, lam, dim: int = -1) -> torch.Tensor:
    """fusedmax along `dim`: argmin_{p in Δ} ½||p - x||² + lam Σ|p_{i+1} - p_i|
    (Niculae & Blondel, 2017), computed as sparsemax(prox_{lam·TV}(x)) with -inf
    entries removed (the finite ones are neighbours). lam: a float or a tensor
    broadcastable to x with size 1 along dim, >= 0. Differentiable by autograd
    in x and lam: the prox's segments are found without a graph, then each
    segment's value is written as its mean plus lam·(σ_right - σ_left)/|G|
    (σ: the sign of y's jump at each end), which holds on the whole piece."""
    return _structured_rows(x, lam, dim, _tv_prox_row)


def oscarmax(x: torch.Tensor, lam, dim: int = -1) -> torch.Tensor:
    """oscarmax along `dim`: sparsemax(prox of lam Σ_{i<j} max(|y_i|, |y_j|)) over
    the finite entries (Niculae & Blondel, 2017). Differentiable by autograd in x
    and lam: the clusters are found without a graph, then each nonzero one's
    magnitude is written as its mean |x| minus lam times its mean rank weight."""
    return _structured_rows(x, lam, dim, _oscar_prox_row)


# --- linear-chain CRF marginals ---------------------------------------------------------------


def _chain_rows(unary: torch.Tensor, pairwise: torch.Tensor, dim: int):
    """The chain ops' inputs as rows: (unary in float64 with dim last, its rows
    (rows, n), the 2×2 scores of each row (rows, 2, 2))."""
    z = _rows_last(unary, dim)
    rows = z.reshape(-1, z.shape[-1])
    w = pairwise.to(torch.float64).expand(*z.shape[:-1], 2, 2).reshape(-1, 2, 2)
    return z, rows, w


def _chain_log_partition(u: torch.Tensor, w: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """log Z of each row's binary chain over its finite entries: u (rows, n),
    any value where `finite` is False; w (rows, 2, 2). A removed entry leaves
    the messages as they were, so its finite neighbours are linked directly."""
    rows, n = u.shape
    messages = u.new_zeros(rows, 2)  # log-sums over the labelings so far, by the last label
    started = torch.zeros(rows, dtype=torch.bool, device=u.device)
    for i in range(n):
        emit = torch.stack([torch.zeros_like(u[:, i]), u[:, i]], -1)
        carried = _log_sum_exp(messages.unsqueeze(-1) + w, 1)  # over the previous label
        step = emit + torch.where(started.unsqueeze(-1), carried, torch.zeros_like(carried))
        messages = torch.where(finite[:, i:i + 1], step, messages)
        started = started | finite[:, i]
    return torch.where(started, _log_sum_exp(messages, -1), torch.zeros_like(messages[:, 0]))


def _log_sum_exp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """logsumexp whose value is -inf, with zero gradients (also second ones),
    where every term is -inf (torch.logsumexp's gradient is NaN there)."""
    top = t.detach().amax(dim, keepdim=True)
    top = torch.where(top > -math.inf, top, torch.zeros_like(top))
    total = torch.exp(t - top).sum(dim, keepdim=True)
    some = total > 0
    out = torch.where(some, top + torch.log(torch.where(some, total, torch.ones_like(total))),
                      torch.full_like(total, -math.inf))
    return out.squeeze(dim)


def crf_marginals(unary: torch.Tensor, pairwise: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """P(z_i = 1) of the binary linear-chain CRF along dim (unary scores for
    z_i = 1, pairwise 2×2 transition scores broadcast per row), -inf entries
    removed. Computed as the gradient of log Z in the unary scores (the forward
    algorithm in log space, differentiated by autograd; the kernels run
    forward-backward instead), with a graph when derivatives are wanted, so
    autograd differentiates it once more for the backward."""
    if not unary.numel():
        return torch.zeros_like(unary)
    z, rows, w = _chain_rows(unary, pairwise, dim)
    finite = rows > -math.inf
    bad = rows.isnan().any(-1) | (rows == math.inf).any(-1)
    u = torch.where(finite & ~bad.unsqueeze(-1), rows, torch.zeros_like(rows))
    graph = torch.is_grad_enabled() and (u.requires_grad or w.requires_grad)
    with torch.enable_grad():
        scores = u if u.requires_grad else u.detach().requires_grad_()
        log_z = _chain_log_partition(scores, w, finite)
        (mu,) = torch.autograd.grad(log_z.sum(), scores, create_graph=graph)
    if not graph:
        mu = mu.detach()
    mu = torch.where((bad | (log_z.detach() == -math.inf)).unsqueeze(-1), torch.full_like(mu, math.nan), mu)
    p = mu.reshape(z.shape)
    return (p.movedim(-1, dim) if unary.dim() else p.reshape(())).to(unary.dtype)


# --- SparseMAP over the binary chain ----------------------------------------------------------


def _chain_best_labeling(c: list[float], w: list[list[float]]) -> tuple[float, tuple[int, ...]]:
    """The labeling z of the chain maximising Σ c_i z_i + Σ w[z_i][z_{i+1}] and
    its value, by dynamic programming (ties to the smaller label)."""
    best = [0.0, c[0]]
    back = []
    for ci in c[1:]:
        step, choice = [], []
        for t in (0, 1):
            from0, from1 = best[0] + w[0][t], best[1] + w[1][t]
            choice.append(1 if from1 > from0 else 0)
            step.append(max(from0, from1) + (ci if t else 0.0))
        back.append(choice)
        best = step
    z = [1 if best[1] > best[0] else 0]
    for choice in reversed(back):
        z.append(choice[z[-1]])
    return max(best), tuple(reversed(z))


def _chain_score(z, u: list[float], w: list[list[float]]) -> float:
    return sum(ui for ui, zi in zip(u, z, strict=True) if zi) + sum(w[a][b] for a, b in zip(z, z[1:], strict=False))


def _ordered_projection(x: list[float], rises: list[bool]) -> list[float]:
    """argmin ½‖y − x‖² subject to y_k ≤ y_{k+1} where rises[k], else y_k ≥ y_{k+1}:
    y = y_0 + Σ signed steps e_k ≥ 0, a least-squares problem in (y_0, e) with e ≥ 0
    solved exactly by Lawson and Hanson's active set, y_0 free. (The kernels run a
    dynamic program over the forward message instead; pooling adjacent violators
    is not enough once the constraints change direction.)"""
    n = len(x)
    target = torch.tensor(x, dtype=torch.float64)
    design = torch.zeros(n, n, dtype=torch.float64)
    design[:, 0] = 1.0
    for k, rise in enumerate(rises):
        design[k + 1:, k + 1] = 1.0 if rise else -1.0
    active = [0]  # y_0 and the steps allowed to be positive
    theta = torch.zeros(n, dtype=torch.float64)
    scale = 1e-12 * max(1.0, float(target.abs().max())) * n
    for _ in range(10 * n + 10):
        slope = design.T @ (target - design @ theta)
        candidates = [j for j in range(1, n) if j not in active and slope[j] > scale]
        if not candidates:
            # (summed in order, so that a step of exactly 0 gives exactly equal neighbours)
            y = [float(theta[0])]
            for k, rise in enumerate(rises):
                y.append(y[-1] + (float(theta[k + 1]) if rise else -float(theta[k + 1])))
            return y
        active.append(max(candidates, key=lambda j: float(slope[j])))
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[active] = torch.linalg.lstsq(design[:, active], target.unsqueeze(-1), driver="gelsd").solution[:, 0]
            blocked = [j for j in active[1:] if z[j] <= 0]
            if not blocked:
                theta = z
                break
            step = min(float(theta[j] / (theta[j] - z[j])) for j in blocked)
            theta = theta + step * (z - theta)
            active = [0] + [j for j in active[1:] if theta[j] > 0]
            theta[[j for j in range(1, n) if j not in active]] = 0.0
    raise RuntimeError("attnkern.sparsemap_chain (reference): the ordered projection did not converge")


def _sparsemap_closed_form(u: list[float], w: list[list[float]]) -> tuple[list[tuple[int, ...]], list[float]] | None:
    """SparseMAP's solution for a row with at most one forbidden transition, as
    labelings and weights (docs/algorithms.md, section 12); None with more. μ is
    the clamp to [0, 1] of the TV prox (strength |c|/2, c = W00 − W01 − W10 +
    W11; every transition allowed) or of the ordered projection (one forbidden,
    which fixes the edge's table and constrains a ≤ b, b ≤ a, a + b ≤ 1 or
    a + b ≥ 1) of u shifted by W's linear part, every odd entry mirrored
    (x ↦ 1 − x) when c < 0 or the constraint is on a + b; then one labeling per
    gap between consecutive distinct values of the (mirrored) μ, its entries
    those at or above the gap."""
    m = len(u)
    forbidden = [(a, b) for a in (0, 1) for b in (0, 1) if w[a][b] == -math.inf]
    if len(forbidden) > 1:
        return None
    (w00, w01), (w10, w11) = w
    if not forbidden:
        c = w00 - w01 - w10 + w11
        left, right, mirrored = (w10 + w11 - w00 - w01) / 2, (w01 + w11 - w00 - w10) / 2, c < 0
    else:  # the table's fixed (1, 1) entry t and the shifts it leaves on a and b
        left, right = {(1, 1): (w10 - w00, w01 - w00),  # t = 0
                       (0, 0): (w11 - w01, w11 - w10),  # t = a + b − 1
                       (1, 0): (w11 - w01, w01 - w00),  # t = a
                       (0, 1): (w10 - w00, w11 - w10)}[forbidden[0]]  # t = b
        mirrored = forbidden[0] in ((1, 1), (0, 0))
    mirror = [mirrored and i % 2 == 1 for i in range(m)]
    x = []
    for i in range(m):
        shifted = u[i] + (left if i + 1 < m else 0.0) + (right if i > 0 else 0.0)
        x.append(1.0 - shifted if mirror[i] else shifted)
    if not forbidden:
        nu = [0.0] * m
        for first, last, value in _tv_segments(x, abs(c) / 2):
            nu[first:last + 1] = [value] * (last - first + 1)
    else:
        # a ≤ b and (mirrored, from an even entry) a + b ≤ 1 make ν rise along the edge
        rises_even = forbidden[0] in ((1, 1), (1, 0))
        nu = _ordered_projection(x, [rises_even != (mirrored and k % 2 == 1) for k in range(m - 1)])
    # One labeling per step down a ranking of the runs of equal neighbours inside
    # (0, 1), by value (ties by position): a run enters at its value, so weights
    # are the gaps between consecutive values, 0 where separate runs tie. Those
    # zero weights keep each run free to move on its own in the KKT system that
    # sparsemap_chain differentiates (one labeling per distinct value would tie
    # separate runs together and give the derivative of a smaller problem).
    runs = []
    for i, v in enumerate(nu):
        if runs and v == nu[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    nu = [min(1.0, max(0.0, v)) for v in nu]
    inner = sorted((r for r in runs if 0.0 < nu[r[0]] < 1.0), key=lambda r: (-nu[r[0]], r[0]))
    ones = [v == 1.0 for v in nu]
    support, xi = [], []
    upper = 1.0
    for run in inner + [None]:
        lower = nu[run[0]] if run else 0.0
        support.append(tuple(int(on != flip) for on, flip in zip(ones, mirror, strict=True)))
        xi.append(upper - lower)
        if run:
            for i in run:
                ones[i] = True
            upper = lower
    return support, xi


def _sparsemap_support(u: list[float], w: list[list[float]]) -> list[tuple[int, ...]] | None:
    """The labelings in SparseMAP's solution for one row (None if no labeling is
    feasible). The closed form's labelings when at most one transition is forbidden,
    checked (and, if rounding left some labeling with excess value, improved)
    by conditional gradient steps towards Viterbi's most violating labeling on
    the active set, with the restricted QP solved by a dense least-squares KKT
    solve and labelings with nonpositive weight dropped, until no labeling
    improves the objective. (The kernels keep the active set affinely
    independent and step exactly; this search only has to find the support,
    and the exact weights are then computed with a graph.)"""
    closed = _sparsemap_closed_form(u, w)
    if closed is not None:
        support, xi = closed
    else:
        value, z = _chain_best_labeling(u, w)
        if value == -math.inf:
            return None
        support, xi = [z], [1.0]
    scale = max([1.0] + [abs(v) for v in u] + [abs(v) for row in w for v in row if v > -math.inf])
    tol = 1e-12 * (len(u) + 1) * scale
    for _ in range(100 + 20 * len(u)):
        mu = [sum(x * s[i] for x, s in zip(xi, support, strict=True)) for i in range(len(u))]
        tau = sum(x * (_chain_score(s, u, w) - sum(m for m, si in zip(mu, s, strict=True) if si))
                  for x, s in zip(xi, support, strict=True))
        value, z = _chain_best_labeling([a - b for a, b in zip(u, mu, strict=True)], w)
        if value <= tau + tol or z in support:
            return support
        support.append(z)
        xi.append(0.0)
        while True:  # the restricted QP by primal active-set steps
            new = _sparsemap_weights(support, u, w)
            neg = [(x / (x - y), j) for j, (x, y) in enumerate(zip(xi, new, strict=True)) if y < 0]
            if not neg:
                xi = new
                break
            step, j = min(neg)
            xi = [x + step * (y - x) for x, y in zip(xi, new, strict=True)]
            del support[j], xi[j]
    raise RuntimeError("attnkern.sparsemap_chain (reference): the active set did not converge")


def _sparsemap_weights(support, u, w) -> list[float]:
    """The weights of the QP restricted to `support` without their sign
    constraints: the KKT system [G 1; 1ᵀ 0][ξ; τ] = [θ; 1] by least squares."""
    z = torch.tensor(support, dtype=torch.float64)
    theta = torch.tensor([_chain_score(s, u, w) for s in support], dtype=torch.float64)
    k = len(support)
    kkt = torch.zeros(k + 1, k + 1, dtype=torch.float64)
    kkt[:k, :k] = z @ z.T
    kkt[:k, k] = kkt[k, :k] = 1.0
    rhs = torch.cat([theta, torch.ones(1, dtype=torch.float64)])
    return torch.linalg.lstsq(kkt, rhs.unsqueeze(-1), driver="gelsd").solution[:k, 0].tolist()


def sparsemap_chain(unary: torch.Tensor, pairwise: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SparseMAP's unary marginals over the binary chain (see attnkern.sparsemap_chain),
    -inf entries removed. The support is found without a graph; the weights
    on it are then the KKT solution written with torch.linalg.solve from the
    labelings' scores θ_s = u·z_s + Σ W[a][b]·#ab(s), so autograd
    differentiates it in unary and pairwise."""
    if not unary.numel():
        return torch.zeros_like(unary)
    z, rows, w = _chain_rows(unary, pairwise, dim)
    out = []
    for r in range(rows.shape[0]):
        row = rows[r]
        finite = row > -math.inf
        if bool(row.isnan().any()) or bool((row == math.inf).any()):
            out.append(torch.full_like(row, math.nan))
            continue
        if not bool(finite.any()):
            out.append(torch.zeros_like(row))
            continue
        pos = finite.nonzero().squeeze(-1)
        u = row[pos]
        support = _sparsemap_support(u.detach().tolist(), w[r].detach().tolist())
        if support is None:
            out.append(torch.full_like(row, math.nan))
            continue
        labels = torch.tensor(support, dtype=torch.float64, device=row.device)  # (k, m)
        transitions = torch.zeros(len(support), 2, 2, dtype=torch.float64, device=row.device)
        for j, s in enumerate(support):
            for a, b in zip(s, s[1:], strict=False):
                transitions[j, a, b] += 1.0
        # Forbidden transitions (-inf) never occur in the support: count them as 0.
        w_used = torch.where(transitions.sum(0) > 0, w[r], torch.zeros_like(w[r]))
        theta = labels @ u + (transitions * w_used).sum((-2, -1))
        k = len(support)
        kkt = torch.zeros(k + 1, k + 1, dtype=torch.float64, device=row.device)
        kkt[:k, :k] = labels @ labels.T
        kkt[:k, k] = kkt[k, :k] = 1.0
        rhs = torch.cat([theta, torch.ones(1, dtype=torch.float64, device=row.device)])
        xi = torch.linalg.solve(kkt, rhs)[:k]
        out.append(torch.zeros_like(row).index_put((pos,), labels.T @ xi))
    p = torch.stack(out).reshape(z.shape)
    return (p.movedim(-1, dim) if unary.dim() else p.reshape(())).to(unary.dtype)
