"""An extended-precision oracle of the α-entmax family, written from the
definition and independent of every attnkern code path: the shift of a row by
bisection in mpmath, with enough digits that 1 + (α-1)(z - c) = p^(α-1)
resolves every probability above 1e-15 even at α = 20; the vector-Jacobian
product from the closed-form Jacobian diag(g) - g gᵀ/Σg, g = p^(2-α); the
derivative in α by a central difference far below float64's resolution.
Rows are lists of floats (the tests keep them short: every entry costs a few
hundred high-precision powers)."""

from __future__ import annotations

import mpmath


def _digits(alpha: float) -> int:
    return int(40 + 13 * max(abs(float(alpha) - 1), 1))


def _entmax(z, a):
    one = mpmath.mpf(1)
    b = a - 1
    finite = [v for v in z if v != -mpmath.inf]
    m = max(finite)
    y = [v - m if v != -mpmath.inf else None for v in z]
    if b == 0:
        e = [mpmath.exp(v) if v is not None else mpmath.mpf(0) for v in y]
        s = sum(e)
        return [v / s for v in e]

    def probs(c):
        out = []
        for v in y:
            d = one + b * (v - c) if v is not None else mpmath.mpf(0)
            out.append(d ** (1 / b) if d > 0 else mpmath.mpf(0))
        return out

    # Σp(c) is decreasing in c, and c - max lies in [0, (1 - n^-b)/b]
    # (docs/algorithms.md): Newton's steps with slope -Σ p/d, bisecting
    # whenever a step would leave the bracket.
    lo, hi = mpmath.mpf(0), (1 - mpmath.mpf(len(finite)) ** (-b)) / b
    c, eps = (lo + hi) / 2, mpmath.mpf(2) ** (-mpmath.mp.prec + 8)
    for _ in range(4 * int(mpmath.mp.prec)):
        p = probs(c)
        f = sum(p) - 1
        if f >= 0:
            lo = c
        else:
            hi = c
        slope = sum(v / (one + b * (w - c)) for v, w in zip(p, y, strict=False) if v > 0)
        nxt = c + f / slope if slope > 0 else (lo + hi) / 2
        if not lo < nxt < hi:
            nxt = (lo + hi) / 2
        if abs(nxt - c) <= eps * (1 + abs(c)) or hi - lo <= eps:
            break
        c = nxt
    return probs(c)


def entmax(z, alpha):
    """α-entmax of one row (floats; -inf allowed), as mpmath numbers."""
    with mpmath.workdps(_digits(alpha)):
        return [+v for v in _entmax([mpmath.mpf(v) for v in z], mpmath.mpf(alpha))]


def vjp(p, dp, alpha):
    """(∂p/∂z)ᵀ dp at the output p (the Jacobian is symmetric)."""
    with mpmath.workdps(_digits(alpha)):
        a = mpmath.mpf(alpha)
        g = [v ** (2 - a) if v > 0 else mpmath.mpf(0) for v in p]
        mean = sum(gi * mpmath.mpf(d) for gi, d in zip(g, dp, strict=False)) / sum(g)
        return [+(gi * (mpmath.mpf(d) - mean)) for gi, d in zip(g, dp, strict=False)]


def alpha_vjp(z, dp, alpha):
    """Σ_i dp_i ∂p_i/∂α, by a central difference at 1e-25 (exact to ~1e-40)."""
    with mpmath.workdps(_digits(alpha) + 60):
        a, h = mpmath.mpf(alpha), mpmath.mpf("1e-25")
        zz = [mpmath.mpf(v) for v in z]
        up, down = _entmax(zz, a + h), _entmax(zz, a - h)
        return +sum((u - w) / (2 * h) * mpmath.mpf(d) for u, w, d in zip(up, down, dp, strict=False))


def near_tied_rows(gen, n: int, alpha: float, count: int):
    """Rows (float64) with two or three near-tied leaders whose gaps put the
    smaller leaders' probabilities at 1e-4 to 1e-2, the rest far out of the
    support: with leader p ≈ 1, an entry at p_i needs a gap of about
    1/(α-1) - p_i below the leader (p_0^b - p_i^b = b·gap)."""
    import torch

    b = alpha - 1
    rows = []
    for i in range(count):
        x = -1.5 / b - torch.rand(n, generator=gen, device=gen.device, dtype=torch.float64)
        x[0] = 0.0
        for j in range(1, 2 + i % 2):
            small = 10 ** (-4 + 2 * float(torch.rand((), generator=gen, device=gen.device, dtype=torch.float64)))
            x[j] = -(1.0 / b - small)
        rows.append(x[torch.randperm(n, generator=gen, device=gen.device)])
    return torch.stack(rows)


def attention(q, k, v, dout, alpha, scale):
    """out, dq, dk, dv, dα of one head of α-entmax attention from the mpmath rows
    (q (L, E), k (S, E), v (S, Ev), dout (L, Ev) tensors), float64."""
    import torch

    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    s = scale * q @ k.T  # the scores, in float64 from the inputs: exact enough beside the targets
    L = s.shape[0]
    ds, dalpha = [], mpmath.mpf(0)
    p_rows = []
    for i in range(L):
        p = entmax(s[i].tolist(), alpha)
        pt = torch.tensor([float(x) for x in p], dtype=torch.float64)
        p_rows.append(pt)
        dp = (dout[i] @ v.T).tolist()
        ds.append(torch.tensor([float(x) for x in vjp(p, dp, alpha)], dtype=torch.float64))
        dalpha += alpha_vjp(s[i].tolist(), dp, alpha)
    P, dS = torch.stack(p_rows), torch.stack(ds)
    return P @ v, scale * dS @ k, scale * dS.T @ q, P.T @ dout, float(dalpha)


def near_tied_attention(gen, alpha: float, L: int, S: int, Ev: int, scale: float):
    """q, k, v, dout (1, 2, ·, ·) float64 whose two heads' score rows are
    near_tied_rows: the keys are the identity (E = S) and the scale a power of
    two, so that scale·q·kᵀ is exactly those rows."""
    import torch

    k = torch.eye(S, dtype=torch.float64).expand(1, 2, S, S)
    q = torch.stack([near_tied_rows(gen, S, alpha, L) for _ in range(2)]).unsqueeze(0) / scale
    v, dout = (torch.randn(1, 2, n, Ev, generator=gen, device=gen.device, dtype=torch.float64) for n in (S, L))
    return q, k, v, dout
