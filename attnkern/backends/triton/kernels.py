"""Triton kernels for fused softmax / sparsemax / α-entmax attention.

Importing this module defines the kernels, and `triton.jit` decides at that
moment whether they are compiled for a GPU or run by the interpreter
(TRITON_INTERPRET=1). `INTERPRETED` records which; the launchers in
`attention.py` reload this module when the setting has changed since.

Every kernel works on one (batch, head) pair and a block of query rows (or of
keys), in the shift form of docs/algorithms.md: p_ij = φ_b(s_ij - c_i) with
φ_b(y) = [1 + b·y]_+^(1/b) and φ_0 = exp. The row shift c is what the forward
saves (sparsemax saves its threshold θ = c - 1 instead, p = [s - θ]_+: 1 + (s
- c) would round every p at the scale of 1); the backward recomputes the
scores s = scale·q·kᵀ + mask and p from it (_probs).

Heads with α > 2 are the exception: the shift form cannot resolve the edge of
their support, and with EDGE set (by the launcher, when some head has α > 2)
their rows are solved in p-space (_edge_solve below); the saved shift is then
only the starting point of the backward's own solve.

FAMILY selects the normalizer at compile time, with the codes of
attnkern.family.Family: SOFTMAX, SPARSEMAX (b = 1), ENTMAX15 (b = 1/2), ENTMAX
with one b = α - 1 per head read at run time (b = 0 exactly behaves as
softmax).

DOT is the input precision of every tl.dot ("ieee", or "tf32" for float32 when
the launcher follows PyTorch's TF32 switch); L_TUNE and S_TUNE feed only the
autotune key (launch configurations, below).
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl
from triton import knobs

from attnkern import family

INTERPRETED = bool(knobs.runtime.interpret)

# The family codes (attnkern.family) as compile-time
# constants of the kernels.
SOFTMAX = tl.constexpr(int(family.Family.SOFTMAX))
SPARSEMAX = tl.constexpr(int(family.Family.SPARSEMAX))
ENTMAX15 = tl.constexpr(int(family.Family.ENTMAX15))
ENTMAX = tl.constexpr(int(family.Family.ENTMAX))


@triton.jit
def _log1p(x):
    # log(1 + x) without the cancellation of log(fl(1 + x)) for small x: the
    # ratio x / (u - 1) corrects for the rounding of u = 1 + x.
    u = 1.0 + x
    d = u - 1.0
    small = d == 0.0
    return tl.where(small, x, tl.log(u) * (x / tl.where(small, 1.0, d)))


@triton.jit
def _expm1(x):
    # exp(x) - 1 without the cancellation for small x (Kahan): with u = fl(exp(x)),
    # (u - 1)·x / log(u) is accurate to a few ulps.
    u = tl.exp(x)
    d = u - 1.0
    small = d == 0.0
    big = tl.abs(x) > 0.5
    lg = tl.log(u)
    return tl.where(small, x, tl.where(big, d, d * (x / tl.where(lg == 0.0, 1.0, lg))))


@triton.jit
def _expm1_excess(x):
    # φ(x) = (eˣ - 1 - x)/x² (float64): its Taylor series Σ x^k/(k+2)!, k <= 8,
    # for |x| < 0.1, the closed form beyond (AlphaGradSums in entmax_math.h).
    small = tl.abs(x) < 0.1
    xs = tl.where(small, x, 0.0)
    s = 1.0 / 3628800.0
    s = s * xs + 1.0 / 362880.0
    s = s * xs + 1.0 / 40320.0
    s = s * xs + 1.0 / 5040.0
    s = s * xs + 1.0 / 720.0
    s = s * xs + 1.0 / 120.0
    s = s * xs + 1.0 / 24.0
    s = s * xs + 1.0 / 6.0
    s = s * xs + 0.5
    xl = tl.where(small, 1.0, x)
    return tl.where(small, s, (_expm1(xl) - xl) / (xl * xl))


@triton.jit
def _expm1_ratio(x):
    # ψ(x) = (eˣ - 1)/x, ψ(0) = 1.
    nz = x != 0.0
    return tl.where(nz, _expm1(x) / tl.where(nz, x, 1.0), 1.0)


@triton.jit
def _phi_g(y, b, FAMILY: tl.constexpr):
    """p = φ_b(y) and g = p^(2-α) = p / (1 + b·y) on the support, 0 elsewhere.

    y = s - c may be -inf (a masked key, or a row without support): p = g = 0.
    """
    if FAMILY == SOFTMAX:
        p = tl.exp(y)
        g = p
    elif FAMILY == SPARSEMAX:
        p = tl.maximum(1.0 + y, 0.0)
        g = tl.where(p > 0.0, 1.0, 0.0).to(p.dtype)
    elif FAMILY == ENTMAX15:
        d = tl.maximum(1.0 + 0.5 * y, 0.0)
        p = d * d
        g = d
    else:
        finite = y > -float("inf")
        by = b * tl.where(finite, y, 0.0)
        inside = (by > -1.0) & finite
        by_safe = tl.where(inside, by, 0.0)
        ln_d = _log1p(by_safe)
        inv_b = 1.0 / tl.where(b == 0.0, 1.0, b)
        p_ent = tl.where(inside, tl.exp(ln_d * inv_b), 0.0)
        g_ent = tl.where(inside, tl.exp(ln_d * (inv_b - 1.0)), 0.0)
        soft = b == 0.0
        p_soft = tl.exp(y)
        p = tl.where(soft, p_soft, p_ent)
        g = tl.where(soft, p_soft, g_ent)
    if FAMILY != SOFTMAX:
        # A NaN score (or shift) gives p = NaN, as exp does for softmax.
        p = tl.where(y != y, y, p)
        g = tl.where(y != y, y, g)
    return p, g


@triton.jit
def _probs(s, shift, b, FAMILY: tl.constexpr):
    """p and g of a tile of scores s from its rows' saved number `shift`
    (rows × 1): the shift c of p = φ_b(s - c), or for sparsemax its threshold θ
    of p = [s - θ]_+ (1 + (s - c) would round every p at the scale of 1)."""
    if FAMILY == SPARSEMAX:
        d = s - shift
        p = tl.maximum(d, 0.0)
        g = tl.where(p > 0.0, 1.0, 0.0).to(p.dtype)
        p = tl.where(d != d, d, p)  # a NaN score (or threshold) gives NaN
        g = tl.where(d != d, d, g)
    else:
        p, g = _phi_g(s - shift, b, FAMILY)
    return p, g


@triton.jit
def _any_nonzero(p):
    # Counts NaN as nonzero, so that a NaN row is not skipped as if p were 0.
    return tl.max(tl.max(tl.where(p != 0.0, 1, 0), 1), 0) > 0


@triton.jit
def _any_support(y_max, b, rows):
    """Whether some row in `rows` can have p > 0 in a key block whose largest
    y = s - c is y_max: 1 + b·y_max > 0 (always for b <= 0, dense)."""
    finite = y_max > -float("inf")
    inside = 1.0 + b * tl.where(finite, y_max, 0.0) > 0.0
    return tl.max(tl.where(rows & inside & finite, 1, 0), 0) > 0


@triton.jit
def _dropout_scale(seed, threshold, drop_scale, row_base, offs_m, offs_n, G):
    """keep / (1 - p) for the weights (row_base + offs_m, offs_n): word j % 4 of
    Philox4x32-10 at counter row·G + j // 4 (G = ⌈S/4⌉) is kept when it is
    >= threshold; csrc/cpu/dropout.h draws the same mask."""
    rows = row_base + offs_m.to(tl.int64)
    o = rows[:, None] * G + (offs_n[None, :] // 4).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, o)
    sel = offs_n[None, :] % 4
    w = tl.where(sel == 0, r0, tl.where(sel == 1, r1, tl.where(sel == 2, r2, r3)))
    return tl.where(w.to(tl.int64) >= threshold, drop_scale, 0.0)


@triton.jit
def _load_b(Alpha, h, FAMILY: tl.constexpr, ACC: tl.constexpr):
    if FAMILY == SPARSEMAX:
        b = 1.0
    elif FAMILY == ENTMAX15:
        b = 0.5
    elif FAMILY == ENTMAX:
        b = tl.load(Alpha + h).to(tl.float32) - 1.0
    else:
        b = 0.0
    return tl.full((), b, ACC)


@triton.jit
def _load_t(X, stride_n, stride_d, offs_n, N, D, HEAD_DIM: tl.constexpr):
    """Rows offs_n of an (N, D) matrix, transposed to (HEAD_DIM, len(offs_n)), zero-padded."""
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(X + offs_n[None, :] * stride_n + offs_d[:, None] * stride_d,
                   mask=(offs_n[None, :] < N) & (offs_d[:, None] < D), other=0.0)


@triton.jit
def _load_rows(X, stride_m, stride_d, offs_m, M, D, HEAD_DIM: tl.constexpr):
    """Rows offs_m of an (M, D) matrix as (len(offs_m), HEAD_DIM), zero-padded."""
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(X + offs_m[:, None] * stride_m + offs_d[None, :] * stride_d,
                   mask=(offs_m[:, None] < M) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _store_rows(X, value, stride_m, stride_d, offs_m, M, D, HEAD_DIM: tl.constexpr):
    """Stores value (len(offs_m), HEAD_DIM) as rows offs_m of an (M, D) matrix, in X's dtype."""
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(X + offs_m[:, None] * stride_m + offs_d[None, :] * stride_d, value.to(X.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_d[None, :] < D))


@triton.jit
def _query_head(pid_bh, H, GROUP, Q, K, V, Mask, stride_qb, stride_qh, stride_kb, stride_kh,
                stride_vb, stride_vh, stride_mb, stride_mh):
    """For program (batch · H + query head) pid_bh: Q and Mask advanced to the
    query head h, K and V to its key/value head h // GROUP; and (batch, h) in int64."""
    bi = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    return (Q + bi * stride_qb + h * stride_qh, K + bi * stride_kb + hk * stride_kh,
            V + bi * stride_vb + hk * stride_vh, Mask + bi * stride_mb + h * stride_mh, bi, h)


@triton.jit
def _mask_offsets(offs_m, offs_n, stride_mm, stride_mn):
    """Element offsets of a (query block, key block) tile of the mask, in int64:
    a mask of L·S ≥ 2³¹ entries per head would overflow int32 arithmetic."""
    return offs_m[:, None].to(tl.int64) * stride_mm + offs_n[None, :].to(tl.int64) * stride_mn


@triton.jit
def _full_width(head, rest, ACC: tl.constexpr):
    # Python floats reach a kernel as float32: the launchers pass a float as its
    # float32 head and the float32 rest (attention._split), summed here in ACC.
    return tl.full((), head, ACC) + tl.full((), rest, ACC)


# The key band (csrc/cpu/attention_problem.h, Problem::key_lo / key_hi): query i
# of batch b sees key j iff j < S_b (its valid keys: the cache length, or S) and
# i + band_lo <= j <= i + band_hi. BAND: some row sees less than [0, S_b) (a
# causal mask or a window); without it the offsets are never read.
_FAR = tl.constexpr(1 << 30)  # "unbounded" on a band side: beyond any index difference (L, S < 2^30)


@triton.jit
def _keys_valid(KeyLen, bi, S, HAS_KEYLEN: tl.constexpr):
    """S_b: batch bi's valid keys [0, S_b), from KeyLen (int64 (B,)) or all S.
    Clamped to [0, S]: the launchers do not read the lengths back to check them."""
    if HAS_KEYLEN:
        return tl.minimum(tl.maximum(tl.load(KeyLen + bi), 0), S).to(tl.int32)
    else:
        return S


@triton.jit
def _band_offsets(L, S_b, causal, win_left, win_right):
    """(band_lo, band_hi): causal, j <= i (SDPA's top-left alignment); a window of
    win_left / win_right keys (-1: unbounded) around i + S_b - L (bottom-right, as
    FlashAttention's window_size)."""
    # (As tensors: the compiler makes an int argument that equals 1 a constant.)
    zero = tl.zeros((), tl.int32)
    d = zero + S_b - L
    band_lo = tl.where(zero + win_left >= 0, d - win_left, -_FAR)
    band_hi = tl.where(zero + win_right >= 0, d + win_right, _FAR)
    band_hi = tl.where(zero + causal != 0, tl.minimum(band_hi, 0), band_hi)
    return band_lo, band_hi


@triton.jit
def _key_range(m0, L, S_b, band_lo, band_hi, BAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys [n_start, n_end) that some query row of [m0, m0 + BLOCK_M) may see,
    n_start a multiple of BLOCK_N (key blocks keep their places: the live bits
    and the dropout counters index them); empty when no row sees a key."""
    n_start = tl.zeros((), tl.int32)
    n_end = tl.zeros((), tl.int32) + S_b
    if BAND:
        last = tl.minimum(m0 + BLOCK_M, L) - 1
        n_start = (tl.maximum(m0 + band_lo, 0) // BLOCK_N) * BLOCK_N
        n_end = tl.minimum(n_end, last + band_hi + 1)
    return n_start, n_end


@triton.jit
def _query_range(n0, L, S_b, band_lo, band_hi, BAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query rows [m_start, m_end) that may see some key of [n0, n0 + BLOCK_N),
    m_start a multiple of BLOCK_M; empty when the block holds no valid key."""
    last = tl.minimum(n0 + BLOCK_N, S_b) - 1
    m_start = tl.zeros((), tl.int32)
    m_end = tl.zeros((), tl.int32) + L
    if BAND:
        m_start = (tl.maximum(n0 - band_hi, 0) // BLOCK_M) * BLOCK_M
        m_end = tl.minimum(m_end, last - band_lo + 1)
    m_end = tl.where(last >= n0, m_end, 0)
    return m_start, m_end


# Row bounds (a BlockMask's rows, csrc Problem::row_bounds): query i of batch b
# also needs RowB[b, i, 0] <= j < RowB[b, i, 1]. They enter the band as per-row
# offsets, (BLOCK_M, 1) tensors that _scores broadcasts as it does the scalars.
@triton.jit
def _row_band(RowB, bi, offs_m, L, band_lo, band_hi):
    """(band_lo, band_hi) of the rows offs_m with their own bounds, (BLOCK_M, 1)."""
    ok = offs_m < L
    at = RowB + (bi.to(tl.int64) * L + offs_m) * 2
    lo = tl.load(at, mask=ok, other=0).to(tl.int32)
    hi = tl.load(at + 1, mask=ok, other=0).to(tl.int32)
    return (tl.maximum(band_lo, lo - offs_m)[:, None], tl.minimum(band_hi, hi - 1 - offs_m)[:, None])


@triton.jit
def _key_range_rows(offs_m, L, S_b, band_lo, band_hi, BLOCK_N: tl.constexpr):
    """_key_range for rows with their own bounds (band_lo, band_hi (BLOCK_M, 1)):
    from the least first key to the greatest last one over the rows that see any."""
    first = offs_m[:, None] + band_lo
    last = tl.minimum(offs_m[:, None] + band_hi, S_b - 1)
    live = (offs_m[:, None] < L) & (tl.maximum(first, 0) <= last)
    lo = tl.min(tl.min(tl.where(live, tl.maximum(first, 0), _FAR), 1), 0)
    hi = tl.max(tl.max(tl.where(live, last + 1, 0), 1), 0)
    n_start = tl.where(hi > 0, (lo // BLOCK_N) * BLOCK_N, 0)
    return n_start, hi


@triton.jit
def _query_range_rows(RowB, bi, n0, L, S_b, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_query_range for rows with their own bounds: a scan of every row's bounds
    for those that see a key of [n0, n0 + BLOCK_N) (their ends need not grow
    with the row, so the rows are not found from the block's keys)."""
    last = tl.minimum(n0 + BLOCK_N, S_b) - 1
    m_lo = tl.zeros((), tl.int32) + L
    m_hi = tl.zeros((), tl.int32)
    for r0 in range(0, L, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        lo, hi = _row_band(RowB, bi, rows, L, band_lo, band_hi)
        first = tl.maximum(rows[:, None] + lo, n0)
        end = tl.minimum(rows[:, None] + hi, last)
        hit = (rows[:, None] < L) & (first <= end)
        m_lo = tl.minimum(m_lo, tl.min(tl.min(tl.where(hit, rows[:, None], L), 1), 0))
        m_hi = tl.maximum(m_hi, tl.max(tl.max(tl.where(hit, rows[:, None] + 1, 0), 1), 0))
    return (m_lo // BLOCK_M) * BLOCK_M, tl.where(last >= n0, m_hi, 0)


@triton.jit
def _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S, scale, band_lo, band_hi,
            HAS_MASK: tl.constexpr, BAND: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr):
    """s = scale·q·kᵀ + mask for one (query block, key block) tile, -inf where not
    allowed (S: the batch's valid keys S_b)."""
    s = tl.dot(q, kt, input_precision=DOT, out_dtype=ACC) * scale
    ok = (offs_m[:, None] < L) & (offs_n[None, :] < S)
    if BAND:
        rel = offs_n[None, :] - offs_m[:, None]
        ok = ok & (rel >= band_lo) & (rel <= band_hi)
    if HAS_MASK:
        mv = tl.load(Mask + _mask_offsets(offs_m, offs_n, stride_mm, stride_mn), mask=ok, other=0.0)
        s = s + mv.to(ACC)
    return tl.where(ok, s, -float("inf"))


@triton.jit
def _live_get(live, j, widx):
    """Bit j of the key-block bitmask `live` (int64 words of 32 bits each)."""
    j = j + tl.zeros((), tl.int64)
    word = tl.sum(tl.where(widx == j // 32, live, 0), 0)
    return ((word >> (j % 32)) & 1) != 0


@triton.jit
def _live_set(live, j, widx, on):
    """`live` with bit j set when `on`."""
    j = j + tl.zeros((), tl.int64)
    bit = tl.full((), 1, tl.int64) << (j % 32)
    return live | tl.where((widx == j // 32) & on, bit, 0)


@triton.jit
def _set_sums(y, theta, sn, sy, sy2, smin, NSETS: tl.constexpr):
    """Adds the entries y > theta_t of a tile (rows × keys) to the sums of the
    candidate sets t (count, Σy, Σy², min y), one column per set; theta is a
    (rows, NSETS) tensor."""
    cols = tl.arange(0, NSETS)[None, :]
    for t in tl.static_range(NSETS):
        th = tl.sum(tl.where(cols == t, theta, 0.0), 1)
        inside = y > th[:, None]
        ym = tl.where(inside, y, 0.0)
        sel = cols == t
        sn = tl.where(sel, sn + tl.sum(inside.to(y.dtype), 1)[:, None], sn)
        sy = tl.where(sel, sy + tl.sum(ym, 1)[:, None], sy)
        sy2 = tl.where(sel, sy2 + tl.sum(ym * ym, 1)[:, None], sy2)
        smin = tl.where(sel, tl.minimum(smin, tl.min(tl.where(inside, y, float("inf")), 1)[:, None]), smin)
    return sn, sy, sy2, smin


@triton.jit
def _set_bounds(sn, sy, sy2, smin, theta, b, inv_b, lo, hi):
    """What the candidate sets prove about the shift c (relative to the row max,
    so y <= 0), for 0 < b <= 1 (docs/algorithms.md, "Finding the shift"):

    - every set A gives c >= mean_A(y) + (1 - |A|^-b)/b (Jensen: φ_b is convex,
      so Σ_A φ(y - c) >= |A|·φ(mean y - c));
    - for b = 1/2 the root of Σ_A (1 + (y - c)/2)² = 1 is a lower bound when
      every y of A is at or above its cut c - 2 (for b = 1 Jensen's bound is the
      root on A);
    - such a root is the shift itself when, besides, no entry outside A (all <=
      theta) is above the cut: theta <= c - 1/b (the support is A);
    - a set that holds the support (theta <= lo - 1/b) gives c <= (1 - |A|^-b)/b.

    Returns (lo, hi, exact) per row, exact = NaN when no set is the support.
    """
    b = b + tl.zeros_like(sn)  # (rows, sets), like the sums
    has = sn > 0.0
    n = tl.where(has, sn, 1.0)
    mean = sy / n
    ln_n = tl.log(n)
    soft = b == 0.0
    pw = tl.where(soft, ln_n, -_expm1(-b * ln_n) * inv_b)
    jensen = mean + pw
    var = tl.maximum(sy2 / n - mean * mean, 0.0)
    disc = 1.0 / n - 0.25 * var
    quad = 2.0 + mean - 2.0 * tl.sqrt(tl.maximum(disc, 0.0))
    quad_ok = (disc >= 0.0) & (smin >= quad - 2.0) & (b == 0.5)
    root = tl.where(quad_ok, quad, jensen)
    root_ok = quad_ok | ((smin >= jensen - 1.0) & (b == 1.0))
    bound = tl.where(has, tl.maximum(root, jensen), -float("inf"))
    lo = tl.maximum(lo, tl.max(bound, 1))
    exact_c = tl.where(has & root_ok & (theta <= root - inv_b), root, -float("inf"))
    exact = tl.max(exact_c, 1)
    exact = tl.where(exact > -float("inf"), exact, float("nan"))
    holds = has & (theta <= lo[:, None] - inv_b)
    hi = tl.minimum(hi, tl.min(tl.where(holds, pw, float("inf")), 1))
    return lo, hi, exact


# --- α > 2 in p-space (csrc/include/attnkern/entmax_edge.h, docs/algorithms.md) ---------------------
#
# The shift form cannot give the edge of the support for α > 2 (1 + b(y - c) =
# p^b, 1e-36 for p = 1e-4 at α = 10); these passes find the support's smallest
# score z_r (the pivot) and q = p_r, and every p_i = (q^b + b(s_i - z_r))^(1/b),
# all in float64, as the CPU and CUDA kernels do. Each pass re-streams the keys.


@triton.jit
def _edge_load_b(Alpha, h):
    """b = α - 1 of head h in float64 (exact from the float32 α)."""
    return tl.load(Alpha + h).to(tl.float64) - 1.0


@triton.jit
def _edge_probe(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m, L, S_b, E, n_start, n_end, scale,
                band_lo, band_hi, t, lo, hi, b, HAS_MASK: tl.constexpr, BAND: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, ACC: tl.constexpr,
                DOT: tl.constexpr):
    """At t per row: S(t) = Σ_(s > t) (b(s - t))^(1/b) (a score s is in the support
    iff S(s) < 1), the scores strictly inside (lo, t) and (t, hi), the smallest score >= t."""
    inv_b = 1.0 / b
    s_t = tl.zeros_like(t)
    below = tl.zeros_like(t)
    above = tl.zeros_like(t)
    least = tl.zeros_like(t) + float("inf")
    for start_n in range(n_start, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
        s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                    HAS_MASK, BAND, ACC, DOT).to(tl.float64)
        d = s - t[:, None]
        up = d > 0.0
        s_t += tl.sum(tl.where(up, tl.exp(tl.log(tl.where(up, b * d, 1.0)) * inv_b), 0.0), 1)
        above += tl.sum(tl.where(up & (s < hi[:, None]), 1.0, 0.0), 1)
        below += tl.sum(tl.where((d < 0.0) & (s > lo[:, None]), 1.0, 0.0), 1)
        least = tl.minimum(least, tl.min(tl.where(d >= 0.0, s, float("inf")), 1))
    return s_t, below, above, least


@triton.jit
def _edge_newton(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m, L, S_b, E, n_start, n_end,
                 scale, band_lo, band_hi, pivot, qv, b, HAS_MASK: tl.constexpr, BAND: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr):
    """F(q) + 1 and F'(q) per row, F(q) = m_r q + Σ_(s > z_r) (q^b + b(s - z_r))^(1/b) - 1."""
    inv_b = 1.0 / b
    qb = tl.exp(b * tl.log(qv))
    qb1 = qb / qv
    f = tl.zeros_like(qv)
    df = tl.zeros_like(qv)
    for start_n in range(n_start, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
        s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                    HAS_MASK, BAND, ACC, DOT).to(tl.float64)
        tie = s == pivot[:, None]
        up = s > pivot[:, None]
        u = tl.where(up, qb[:, None] + b * (s - pivot[:, None]), 1.0)
        pu = tl.exp(tl.log(u) * inv_b)
        f += tl.sum(tl.where(tie, qv[:, None], tl.where(up, pu, 0.0)), 1)
        df += tl.sum(tl.where(tie, 1.0, tl.where(up, qb1[:, None] * pu / u, 0.0)), 1)
    return f, df


@triton.jit
def _edge_solve(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m, L, S_b, E, n_start, n_end, scale,
                band_lo, band_hi, zmax, hint, tol, b, rows, HAS_MASK: tl.constexpr, BAND: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
                DOT: tl.constexpr):
    """(pivot, q, q^b) per row (float64) for the rows in `rows`, whose max score is
    zmax; hint: an estimate of the threshold τ, tol about its accuracy (they only
    steer the first probes). The support is bracketed around the hint, then
    bisected until no score lies in the bracket (math::edge_solve); q by Newton's
    steps on the convex increasing F from q = 1 (no overshoot)."""
    inf = float("inf")
    lo = tl.zeros_like(zmax) - inf  # S(lo) >= 1 (-inf: not known yet)
    hi = zmax                       # S(hi) < 1
    pivot = zmax                    # the smallest score >= hi
    floor_t = zmax - 1.0625 / b     # the max alone gives S >= 1 there
    hint = tl.where(hint < hi, hint, hi)
    hint = tl.where(hint > floor_t, hint, floor_t)
    tol = tl.where(tol > 0.0, tol, 1e-300)
    down = tol
    probed_up = tl.zeros_like(zmax)
    active = rows
    it = 0
    while (it < 4096) & (tl.max(active.to(tl.int32), 0) > 0):
        unknown = lo == -inf
        t_down = hint - down
        t_down = tl.where(t_down < hi, t_down, hi - down)
        t_down = tl.where(t_down > floor_t, t_down, floor_t)
        t_up = hint + tol
        up_ok = (probed_up == 0.0) & (t_up > lo) & (t_up < hi)
        lo_known = tl.where(unknown, hi, lo)
        t_mid = lo_known + 0.5 * (hi - lo_known)
        active = active & (unknown | up_ok | ((t_mid > lo) & (t_mid < hi)))
        t = tl.where(unknown, t_down, tl.where(up_ok, t_up, t_mid))
        down = tl.where(active & unknown, down * 64.0, down)
        probed_up = tl.where(active & ~unknown & up_ok, 1.0, probed_up)
        s_t, below, above, least = _edge_probe(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m,
                                               L, S_b, E, n_start, n_end, scale, band_lo, band_hi, t, lo, hi,
                                               b, HAS_MASK, BAND, HEAD_DIM, BLOCK_N, ACC, DOT)
        inside = s_t < 1.0
        hi = tl.where(active & inside, t, hi)
        pivot = tl.where(active & inside, least, pivot)
        lo = tl.where(active & ~inside, t, lo)
        between = tl.where(inside, below, above)
        between = tl.where(inside & unknown & (t == floor_t), 0.0, between)
        active = active & (between > 0.0)
        it += 1
    qv = tl.zeros_like(zmax) + 1.0
    active = rows
    it = 0
    while (it < 200) & (tl.max(active.to(tl.int32), 0) > 0):
        f, df = _edge_newton(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m, L, S_b, E, n_start,
                             n_end, scale, band_lo, band_hi, pivot, qv, b, HAS_MASK, BAND, HEAD_DIM, BLOCK_N, ACC,
                             DOT)
        f = f - 1.0
        nxt = qv - f / tl.where(df > 0.0, df, 1.0)
        active = active & (f > 0.0) & (nxt < qv)
        qv = tl.where(active, tl.where(nxt > 0.0, nxt, 0.5 * qv), qv)
        it += 1
    return pivot, qv, tl.exp(b * tl.log(qv))


@triton.jit
def _edge_p(s, c, pivot, qv, qb, b):
    """p of a tile of scores (rows × keys, float64) from its rows' pivot, q and q^b;
    NaN in the rows whose saved number c is NaN (a NaN score), as _probs gives."""
    up = s > pivot[:, None]
    u = tl.where(up, qb[:, None] + b * (s - pivot[:, None]), 1.0)
    p = tl.where(up, tl.exp(tl.log(u) / b), 0.0)
    p = tl.where(s == pivot[:, None], qv[:, None], p)
    return tl.where(c[:, None] == c[:, None], p, float("nan"))


@triton.jit
def _edge_ds(p, dp, qv, dp_r, scaled, b):
    """The backward of α > 2 (math::edge_vjp) on a tile, float64: with g = p^(1-b),
    ĝ = g / g_r (r the pivot, p_r = q) and scaled = Σ g (dp - dp_r) / Σ ĝ,
    ds = g (dp - dp_r) - ĝ·scaled on the support, so that no huge g multiplies a
    difference of nearly equal numbers."""
    on = p > 0.0
    lp = tl.log(tl.where(on, p, 1.0))
    e = 1.0 - b
    d = dp - dp_r[:, None]
    own = tl.where(on & (d != 0.0), tl.exp(e * lp) * tl.where(d != 0.0, d, 1.0), 0.0)
    rel = tl.exp(e * (lp - tl.log(qv)[:, None]))
    return tl.where(on, own - rel * scaled[:, None], 0.0)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Mask, Alpha, Out, Shift, Counts, KeyLen, RowB,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, L, S, E, EV, scale, scale_lo, eps, seed, threshold, drop_scale, drop_lo, G, L_TUNE, S_TUNE,
    causal, win_left, win_right,
    FAMILY: tl.constexpr, HAS_MASK: tl.constexpr, BAND: tl.constexpr, HAS_KEYLEN: tl.constexpr,
    HAS_ROWB: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_ITER: tl.constexpr, ACC: tl.constexpr, DROPOUT: tl.constexpr,
    N_WORDS: tl.constexpr, NSETS: tl.constexpr, COUNT: tl.constexpr, EDGE: tl.constexpr, DOT: tl.constexpr,
):
    """out and shift for one block of query rows of one (batch, head).

    Softmax: one pass (online). The sparse normalizers: a first pass for the row
    max and bounds of the shift, passes of the threshold search, and the pass
    that forms P·V. N_WORDS: int64 words of the key-block bitmask (32 blocks
    each); NSETS: candidate sets per row. COUNT: also store, per program, the
    passes over K and the key blocks read into Counts (2 int32 each).
    """
    scale, drop_scale = _full_width(scale, scale_lo, ACC), _full_width(drop_scale, drop_lo, ACC)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    Q, K, V, Mask, bi, h = _query_head(pid_bh, H, GROUP, Q, K, V, Mask, stride_qb, stride_qh, stride_kb,
                                       stride_kh, stride_vb, stride_vh, stride_mb, stride_mh)
    Out += bi * stride_ob + h * stride_oh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L
    q = _load_rows(Q, stride_qm, stride_qd, offs_m, L, E, HEAD_DIM)
    S_b = _keys_valid(KeyLen, bi, S, HAS_KEYLEN)
    band_lo, band_hi = _band_offsets(L, S_b, causal, win_left, win_right)
    if HAS_ROWB:
        band_lo, band_hi = _row_band(RowB, bi, offs_m, L, band_lo, band_hi)
        n_start, n_end = _key_range_rows(offs_m, L, S_b, band_lo, band_hi, BLOCK_N)
    else:
        n_start, n_end = _key_range(pid_m * BLOCK_M, L, S_b, band_lo, band_hi, BAND, BLOCK_M, BLOCK_N)
    b = _load_b(Alpha, h, FAMILY, ACC)
    neg_inf = -float("inf")

    # Row max: the shift is searched relative to it, so that y = s - m <= 0.
    m = tl.full((BLOCK_M,), neg_inf, ACC)
    nan_row = offs_m < 0
    if FAMILY == SOFTMAX:
        # Online softmax: one pass, rescaling the running sums when the max grows.
        lsum = tl.zeros((BLOCK_M,), ACC)
        acc = tl.zeros((BLOCK_M, HEAD_DIM_V), ACC)
        for start_n in range(n_start, n_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
            s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                        HAS_MASK, BAND, ACC, DOT)
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new > neg_inf, m_new, 0.0)
            rescale = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            lsum = lsum * rescale + tl.sum(p, 1)
            if DROPOUT:
                p = p * _dropout_scale(seed, threshold, drop_scale, pid_bh.to(tl.int64) * L, offs_m, offs_n, G)
            v = _load_rows(V, stride_vn, stride_vd, offs_n, S_b, EV, HEAD_DIM_V)
            acc = acc * rescale[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT, out_dtype=ACC)
            m = m_new
        has = lsum > 0.0
        shift = tl.where(has, m + tl.log(tl.where(has, lsum, 1.0)), float("inf"))
        shift = tl.where(lsum != lsum, lsum, shift)  # a NaN row keeps NaN
        out = acc / tl.where(has, lsum, 1.0)[:, None]
        n_pass = 1
        n_visit = tl.cdiv(tl.maximum(n_end - n_start, 0), BLOCK_N)
    else:
        inv_b = 1.0 / tl.where(b == 0.0, 1.0, b)
        soft_head = b == 0.0
        # For 0 < b <= 1 the search runs from the left (docs/algorithms.md): every
        # iterate is a proven lower bound of the shift.
        convex = (b > 0.0) & (b <= 1.0)
        # Bracket [0, (1 - S^-b)/b] for c - m (docs/algorithms.md), softmax limit ln S;
        # widened by a relative 1e-3 against the rounding of the formula.
        ln_n = tl.log(tl.full((), 1.0, ACC) * S)
        upper = tl.where(soft_head, ln_n, -_expm1(-b * ln_n) * inv_b)
        upper = upper * 1.001 + 1e-6
        # Key blocks that may hold some row's support, one bit each: cleared once
        # a pass finds the block outside every row's support at the row's lower
        # bound of the shift, which only grows, so later passes skip the block
        # (no K or V read, no dot).
        widx = tl.arange(0, N_WORDS)
        live = tl.zeros((N_WORDS,), tl.int64)
        # Candidate sets {y > theta_t} (y = s - m): NSETS cuts spread over the
        # bracket; their sums bound the shift, and the set that is the support
        # gives it in closed form for b = 1 and b = 1/2 (_set_bounds).
        frac = tl.arange(0, NSETS)[None, :].to(ACC) / (NSETS - 1)
        sn = tl.zeros((BLOCK_M, NSETS), ACC)
        sy = tl.zeros((BLOCK_M, NSETS), ACC)
        sy2 = tl.zeros((BLOCK_M, NSETS), ACC)
        smin = tl.zeros((BLOCK_M, NSETS), ACC) + float("inf")
        theta = tl.zeros((BLOCK_M, NSETS), ACC) + (frac * upper - inv_b)
        lsum = tl.zeros((BLOCK_M,), ACC)
        # First pass: the row max, and the sums relative to the running max
        # (shifted when it grows; a set's cut moves with it, which only adds
        # entries below the final cut: every bound stays valid).
        for start_n in range(n_start, n_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
            s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                        HAS_MASK, BAND, ACC, DOT)
            nan_row = nan_row | (tl.max(tl.where(s != s, 1, 0), 1) > 0)
            m_new = tl.maximum(m, tl.max(s, 1))
            d = tl.where(m_new > neg_inf, m_new, 0.0) - tl.where(m > neg_inf, m, 0.0)
            y = s - tl.where(m_new > neg_inf, m_new, 0.0)[:, None]
            if FAMILY == ENTMAX:
                # Σ exp(y): the log-sum-exp, the shift of softmax heads and a lower
                # bound of it for b < 0 (φ_b >= exp).
                lsum = lsum * tl.exp(-d) + tl.sum(tl.exp(y), 1)
            if convex:
                dc = d[:, None]
                sy2 = sy2 - 2.0 * dc * sy + sn * dc * dc
                sy = sy - sn * dc
                smin = smin - dc
                sn, sy, sy2, smin = _set_sums(y, theta, sn, sy, sy2, smin, NSETS)
            live = _live_set(live, start_n // BLOCK_N, widx, _any_support(tl.max(y, 1), b, row_ok))
            m = m_new
        n_pass = 1
        n_visit = tl.cdiv(tl.maximum(n_end - n_start, 0), BLOCK_N)
        # A NaN score makes its row NaN (out and shift) and no other.
        has = (m > neg_inf) & ~nan_row
        m_safe = tl.where(has, m, 0.0)

        lo = tl.zeros((BLOCK_M,), ACC)
        hi = tl.zeros((BLOCK_M,), ACC) + upper
        lse = tl.log(tl.where(lsum > 0.0, lsum, 1.0))
        lo = tl.where(b < 0.0, tl.maximum(lo, lse), lo)
        active = (has & row_ok).to(tl.int32)
        tol_f = eps * (2.0 + tl.sqrt(tl.full((), 1.0, ACC) * S))
        if convex:
            lo, hi, exact = _set_bounds(sn, sy, sy2, smin, theta, b, inv_b, lo, hi)
            found = exact == exact
            c = tl.where(found, exact, lo)
            active = tl.where(found | (hi - lo <= 4.0 * eps * (1.0 + lo)), 0, active)
        else:
            c = lo
        # Softmax heads of the α-entmax family: the log-sum-exp is the shift.
        c = tl.where(soft_head, lse, c)
        active = tl.where(soft_head, 0, active)
        it = 0
        # Each step re-streams the live key blocks. 0 < b <= 1: Newton on the
        # convex (Σp)^b from the lower bound c = lo lands left of the root
        # (a new lower bound), and so do the candidate sets' bounds; the search
        # stops when a set is the support, when Σp = 1 to rounding, or when a
        # step or the bracket is below resolution. Otherwise: safeguarded
        # Newton on f(c) = Σ φ(y - c) - 1, f' = -Σ g, bisecting when a step
        # leaves the bracket.
        while (it < MAX_ITER) & (tl.max(active, 0) > 0):
            sum_p = tl.zeros((BLOCK_M,), ACC)
            sum_g = tl.zeros((BLOCK_M,), ACC)
            theta = lo[:, None] - inv_b + frac * (hi - lo)[:, None]
            sn = tl.zeros((BLOCK_M, NSETS), ACC)
            sy = tl.zeros((BLOCK_M, NSETS), ACC)
            sy2 = tl.zeros((BLOCK_M, NSETS), ACC)
            smin = tl.zeros((BLOCK_M, NSETS), ACC) + float("inf")
            next_live = tl.zeros((N_WORDS,), tl.int64)
            for start_n in range(n_start, n_end, BLOCK_N):
                j = start_n // BLOCK_N
                if _live_get(live, j, widx):
                    offs_n = start_n + tl.arange(0, BLOCK_N)
                    kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
                    s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                                HAS_MASK, BAND, ACC, DOT)
                    y = s - m_safe[:, None]
                    p, g = _phi_g(y - c[:, None], b, FAMILY)
                    sum_p += tl.sum(p, 1)
                    sum_g += tl.sum(g, 1)
                    if convex:
                        sn, sy, sy2, smin = _set_sums(y, theta, sn, sy, sy2, smin, NSETS)
                    next_live = _live_set(next_live, j, widx, _any_support(tl.max(y, 1) - lo, b, has))
                    n_visit += 1
            live = next_live
            n_pass += 1
            f = sum_p - 1.0
            tol_c = 4.0 * eps * (1.0 + c)
            small_f = tl.abs(f) <= tol_f
            ok = (sum_g > 0.0) & (sum_p > 0.0)
            if convex:
                sp = tl.where(ok, sum_p, 1.0)
                nxt = c - sp * _expm1(-b * tl.log(sp)) / (b * tl.where(ok, sum_g, 1.0))
                lo_n = tl.where(ok & (nxt > lo), tl.minimum(nxt, hi), lo)
                lo_n, hi_n, exact = _set_bounds(sn, sy, sy2, smin, theta, b, inv_b, lo_n, hi)
                found = exact == exact
                c_next = tl.where(found, exact, tl.where(small_f, c, lo_n))
                done = found | small_f | (c_next - c <= tol_c) | (hi_n - lo_n <= tol_c)
            else:
                lo_n = tl.where(f > 0.0, c, lo)
                hi_n = tl.where(f > 0.0, hi, c)
                newton = c + f / tl.where(sum_g > 0.0, sum_g, 1.0)
                inside = (newton > lo_n) & (newton < hi_n) & (sum_g > 0.0)
                c_next = tl.where(small_f, c, tl.where(inside, newton, 0.5 * (lo_n + hi_n)))
                done = small_f | (tl.abs(c_next - c) <= tol_c) | (hi_n - lo_n <= tol_c)
            lo = tl.where(active > 0, lo_n, lo)
            hi = tl.where(active > 0, hi_n, hi)
            c = tl.where(active > 0, c_next, c)
            active = tl.where(done, 0, active)
            it += 1

        if FAMILY == SPARSEMAX:
            # Sparsemax saves its threshold θ (p = [s - θ]_+), found in float64
            # by Michelot's steps θ <- (Σ_(y > θ) y - 1) / |{y > θ}| (y = s - m)
            # from a point left of it, which only grow and stop at θ: from
            # max(lo, c - margin) - 1, where every score above sits in a live
            # block. Usually one pass: done when every member is above the new θ.
            lo_d = lo.to(tl.float64)
            th = tl.maximum(lo_d, c.to(tl.float64) - 16.0 * eps * (1.0 + tl.abs(c.to(tl.float64)))) - 1.0
            act = has & row_ok
            it = 0
            while (it < MAX_ITER) & (tl.max(act.to(tl.int32), 0) > 0):
                cnt = tl.zeros((BLOCK_M,), tl.float64)
                ysum = tl.zeros((BLOCK_M,), tl.float64)
                least = tl.zeros((BLOCK_M,), tl.float64) + float("inf")
                for start_n in range(n_start, n_end, BLOCK_N):
                    if _live_get(live, start_n // BLOCK_N, widx):
                        offs_n = start_n + tl.arange(0, BLOCK_N)
                        kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
                        s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                                    HAS_MASK, BAND, ACC, DOT)
                        y = s.to(tl.float64) - m_safe.to(tl.float64)[:, None]
                        on = y > th[:, None]
                        cnt += tl.sum(on.to(tl.float64), 1)
                        ysum += tl.sum(tl.where(on, y, 0.0), 1)
                        least = tl.minimum(least, tl.min(tl.where(on, y, float("inf")), 1))
                        n_visit += 1
                n_pass += 1
                nxt = (ysum - 1.0) / tl.where(cnt > 0.0, cnt, 1.0)
                th = tl.where(act & (cnt > 0.0), nxt, th)
                act = act & (cnt > 0.0) & ~(least > nxt)
                it += 1
            shift = tl.where(nan_row, float("nan"), tl.where(has, (m_safe.to(tl.float64) + th).to(ACC),
                                                               float("inf")))
        else:
            shift = tl.where(nan_row, float("nan"), tl.where(has, m_safe + c, float("inf")))
        if EDGE:
            # A head with α > 2: the shift found above is only the hint of its
            # p-space solve, and no key block is skipped (the live bits rest on
            # the shift form's view of the edge of the support).
            b_edge = _edge_load_b(Alpha, h)
            edge_head = b_edge > 1.0
            md = m_safe.to(tl.float64)
            pivot = md
            qv = tl.zeros_like(md) + 1.0
            qb = qv
            if edge_head:
                cd = c.to(tl.float64)
                tol = 8.0 * eps * (1.0 + tl.abs(md) + tl.abs(cd) + 1.0 / b_edge)
                pivot, qv, qb = _edge_solve(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m,
                                        L, S_b, E, n_start, n_end, scale, band_lo, band_hi, md, md + cd - 1.0 / b_edge,
                                        tol, b_edge, has & row_ok, HAS_MASK, BAND, HEAD_DIM, BLOCK_N, ACC, DOT)
        acc = tl.zeros((BLOCK_M, HEAD_DIM_V), ACC)
        for start_n in range(n_start, n_end, BLOCK_N):
            visit = _live_get(live, start_n // BLOCK_N, widx)  # skip key blocks outside every row's support
            if EDGE:
                visit = visit | edge_head
            if visit:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
                s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                            HAS_MASK, BAND, ACC, DOT)
                n_visit += 1
                p, g = _probs(s, shift[:, None], b, FAMILY)
                if EDGE:
                    if edge_head:
                        p = _edge_p(s.to(tl.float64), shift, pivot, qv, qb, b_edge).to(ACC)
                if _any_nonzero(p):
                    if DROPOUT:
                        p = p * _dropout_scale(seed, threshold, drop_scale, pid_bh.to(tl.int64) * L, offs_m,
                                               offs_n, G)
                    v = _load_rows(V, stride_vn, stride_vd, offs_n, S_b, EV, HEAD_DIM_V)
                    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT, out_dtype=ACC)
        n_pass += 1
        out = tl.where(nan_row[:, None], float("nan"), acc)

    if COUNT:
        # Instrumented runs only: passes over K and key blocks read, per program.
        slot = (pid_bh * tl.num_programs(0) + pid_m) * 2
        tl.store(Counts + slot, n_pass)
        tl.store(Counts + slot + 1, n_visit)

    _store_rows(Out, out, stride_om, stride_od, offs_m, L, EV, HEAD_DIM_V)
    tl.store(Shift + pid_bh.to(tl.int64) * L + offs_m, shift.to(tl.float32), mask=row_ok)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, Mask, Alpha, DO, Shift, Delta, DAlphaRow, EdgeRows, DQ, KeyLen, RowB,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, L, S, E, EV, scale, scale_lo, eps, alpha_band, seed, threshold, drop_scale, drop_lo, G, L_TUNE, S_TUNE,
    causal, win_left, win_right,
    FAMILY: tl.constexpr, HAS_MASK: tl.constexpr, BAND: tl.constexpr, HAS_KEYLEN: tl.constexpr,
    HAS_ROWB: tl.constexpr,
    STATS: tl.constexpr, ALPHA_GRAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACC: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr, DOT: tl.constexpr,
):
    """dQ for one block of query rows; with STATS, first the row reductions.

    STATS (sparse normalizers): one pass over the keys for Σg and Σ g·dp, giving
    delta = Σ g dp / Σ g (stored for the dK/dV kernel) and, with ALPHA_GRAD, the
    per-row gradient in α (docs/algorithms.md, section 4, as AlphaGradSums in C++).
    Without STATS, delta was computed by the launcher (softmax: dO·O). With EDGE,
    the rows of heads with α > 2 are solved again in
    p-space from the saved shift (a pass for the row max, the passes of
    _edge_solve, one for the pivot's dp), their backward takes _edge_ds's form,
    and (pivot, q, dp_r, Σ g (dp - dp_r) / Σ ĝ) go to EdgeRows (rows × 4,
    float64) for the dK/dV kernel.
    """
    scale, drop_scale = _full_width(scale, scale_lo, ACC), _full_width(drop_scale, drop_lo, ACC)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    Q, K, V, Mask, bi, h = _query_head(pid_bh, H, GROUP, Q, K, V, Mask, stride_qb, stride_qh, stride_kb,
                                       stride_kh, stride_vb, stride_vh, stride_mb, stride_mh)
    DO += bi * stride_ob + h * stride_oh
    DQ += bi * stride_dqb + h * stride_dqh
    row_base = pid_bh.to(tl.int64) * L

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L
    q = _load_rows(Q, stride_qm, stride_qd, offs_m, L, E, HEAD_DIM)
    do = _load_rows(DO, stride_om, stride_od, offs_m, L, EV, HEAD_DIM_V)
    c = tl.load(Shift + row_base + offs_m, mask=row_ok, other=float("inf")).to(ACC)
    S_b = _keys_valid(KeyLen, bi, S, HAS_KEYLEN)
    band_lo, band_hi = _band_offsets(L, S_b, causal, win_left, win_right)
    if HAS_ROWB:
        band_lo, band_hi = _row_band(RowB, bi, offs_m, L, band_lo, band_hi)
        n_start, n_end = _key_range_rows(offs_m, L, S_b, band_lo, band_hi, BLOCK_N)
    else:
        n_start, n_end = _key_range(pid_m * BLOCK_M, L, S_b, band_lo, band_hi, BAND, BLOCK_M, BLOCK_N)
    b = _load_b(Alpha, h, FAMILY, ACC)
    if EDGE:
        b_edge = _edge_load_b(Alpha, h)
        edge_head = b_edge > 1.0
        pivot = tl.zeros((BLOCK_M,), tl.float64)
        qv = pivot + 1.0
        qb = qv
        dp_r = pivot
        edge_n = pivot
        edge_g = pivot
        if edge_head:
            m = tl.full((BLOCK_M,), -float("inf"), ACC)
            for start_n in range(n_start, n_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
                s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                            HAS_MASK, BAND, ACC, DOT)
                m = tl.maximum(m, tl.max(s, 1))
            has = (m > -float("inf")) & row_ok & (c == c)
            md = tl.where(has, m, 0.0).to(tl.float64)
            cd = tl.where(has, c, 0.0).to(tl.float64)
            tol = 8.0 * eps * (1.0 + tl.abs(md) + tl.abs(cd - md) + 1.0 / b_edge)
            pivot, qv, qb = _edge_solve(q, K, Mask, stride_kn, stride_kd, stride_mm, stride_mn, offs_m,
                                        L, S_b, E, n_start, n_end, scale, band_lo, band_hi, md, cd - 1.0 / b_edge,
                                        tol, b_edge, has, HAS_MASK, BAND, HEAD_DIM, BLOCK_N, ACC, DOT)
            # The pivot's dp (the largest among scores tied with it: any gives the same ds).
            dp_r = tl.zeros((BLOCK_M,), tl.float64) - float("inf")
            for start_n in range(n_start, n_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
                s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                            HAS_MASK, BAND, ACC, DOT).to(tl.float64)
                at_pivot = s == pivot[:, None]
                if tl.max(tl.max(at_pivot.to(tl.int32), 1), 0) > 0:
                    vt = _load_t(V, stride_vn, stride_vd, offs_n, S_b, EV, HEAD_DIM_V)
                    dp = tl.dot(do, vt, input_precision=DOT, out_dtype=ACC)
                    if DROPOUT:
                        dp = dp * _dropout_scale(seed, threshold, drop_scale, row_base, offs_m, offs_n, G)
                    dp_r = tl.maximum(dp_r, tl.max(tl.where(at_pivot, dp.to(tl.float64), -float("inf")), 1))
            dp_r = tl.where(has, dp_r, 0.0)

    if STATS:
        gsum = tl.zeros((BLOCK_M,), ACC)
        gdp = tl.zeros((BLOCK_M,), ACC)
        # The α-gradient sums, in float64 over the row renormalized on the sums
        # (AlphaGradSums in entmax_math.h): the closed form cancels two O(1/b)
        # terms, so near b = 0 it is taken in its form without cancellation.
        sp = tl.zeros((BLOCK_M,), tl.float64)
        gsum_d = tl.zeros((BLOCK_M,), tl.float64)
        gdp_d = tl.zeros((BLOCK_M,), tl.float64)
        pdp = tl.zeros((BLOCK_M,), tl.float64)
        pl = tl.zeros((BLOCK_M,), tl.float64)
        pldp = tl.zeros((BLOCK_M,), tl.float64)
        pq = tl.zeros((BLOCK_M,), tl.float64)
        pqdp = tl.zeros((BLOCK_M,), tl.float64)
        pr = tl.zeros((BLOCK_M,), tl.float64)
        prdp = tl.zeros((BLOCK_M,), tl.float64)
        bd = b.to(tl.float64)
        near_one = (bd > -alpha_band) & (bd < alpha_band)
        b_near = tl.where(near_one, bd, 0.0)
        for start_n in range(n_start, n_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
            s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                        HAS_MASK, BAND, ACC, DOT)
            p, g = _probs(s, c[:, None], b, FAMILY)
            if EDGE:
                p_edge = tl.zeros((BLOCK_M, BLOCK_N), tl.float64)
                if edge_head:
                    p_edge = _edge_p(s.to(tl.float64), c, pivot, qv, qb, b_edge)
                    p = p_edge.to(ACC)
            if _any_nonzero(p):
                vt = _load_t(V, stride_vn, stride_vd, offs_n, S_b, EV, HEAD_DIM_V)
                dp = tl.dot(do, vt, input_precision=DOT, out_dtype=ACC)
                if DROPOUT:
                    dp = dp * _dropout_scale(seed, threshold, drop_scale, row_base, offs_m, offs_n, G)
                gsum += tl.sum(g, 1)
                gdp += tl.sum(g * dp, 1)
                if EDGE:
                    # Σ g (dp - dp_r) and Σ ĝ of _edge_ds (zero for the other heads: p_edge = 0).
                    on = p_edge > 0.0
                    lp = tl.log(tl.where(on, p_edge, 1.0))
                    d = dp.to(tl.float64) - dp_r[:, None]
                    edge_n += tl.sum(tl.where(on & (d != 0.0), tl.exp((1.0 - b_edge) * lp) * d, 0.0), 1)
                    edge_g += tl.sum(tl.where(on, tl.exp((1.0 - b_edge) * (lp - tl.log(qv)[:, None])), 0.0), 1)
                if ALPHA_GRAD:
                    pd = p.to(tl.float64)
                    if EDGE:
                        pd = tl.where(edge_head, p_edge, pd)
                    dpd = dp.to(tl.float64)
                    lnp = tl.log(tl.where(pd > 0.0, pd, 1.0))
                    # ln g capped as AlphaGradSums::add caps it (α > 2: the pivot's g
                    # may overflow double, beside which the others' weights vanish).
                    gd = tl.where(pd > 0.0, tl.exp(tl.minimum((1.0 - bd) * lnp, 650.0)), 0.0)
                    plnp = pd * lnp
                    x = -b_near * lnp
                    qd = plnp * lnp * _expm1_excess(x)
                    rd = plnp * _expm1_ratio(x)
                    sp += tl.sum(pd, 1)
                    gsum_d += tl.sum(gd, 1)
                    gdp_d += tl.sum(gd * dpd, 1)
                    pdp += tl.sum(pd * dpd, 1)
                    pl += tl.sum(plnp, 1)
                    pldp += tl.sum(plnp * dpd, 1)
                    pq += tl.sum(qd, 1)
                    pqdp += tl.sum(qd * dpd, 1)
                    pr += tl.sum(rd, 1)
                    prdp += tl.sum(rd * dpd, 1)
        has = gsum > 0.0
        delta = tl.where(has, gdp / tl.where(has, gsum, 1.0), 0.0)
        tl.store(Delta + row_base + offs_m, delta, mask=row_ok)
        if EDGE:
            if edge_head:
                edge_n = tl.where(edge_g > 0.0, edge_n / tl.where(edge_g > 0.0, edge_g, 1.0), 0.0)
                nan_rows = c != c
                edge_n = tl.where(nan_rows, float("nan"), edge_n)
                rows4 = (row_base + offs_m) * 4
                tl.store(EdgeRows + rows4, pivot, mask=row_ok)
                tl.store(EdgeRows + rows4 + 1, qv, mask=row_ok)
                tl.store(EdgeRows + rows4 + 2, dp_r, mask=row_ok)
                tl.store(EdgeRows + rows4 + 3, edge_n, mask=row_ok)
        if ALPHA_GRAD:
            # AlphaGradSums::grad of entmax_math.h.
            ok = (sp > 0.0) & (gsum_d > 0.0)
            sp_s = tl.where(ok, sp, 1.0)
            gsum_s = tl.where(ok, gsum_d, 1.0)
            lsp = tl.log(sp_s)
            t_pdp = pdp / sp_s
            t_pldp = (pldp - lsp * pdp) / sp_s
            t_ent = -(pl / sp_s - lsp)
            t_pq = (pq - lsp * pr + 0.5 * lsp * lsp * gsum_d) / sp_s
            t_pqdp = (pqdp - lsp * prdp + 0.5 * lsp * lsp * gdp_d) / sp_s
            t_z = gsum_s * tl.exp(b_near * lsp) / sp_s
            near = (t_pdp * t_pq - t_pqdp - b_near * t_pq * t_pldp - b_near * t_ent * t_pqdp) / t_z
            ghat_dp = gdp_d / gsum_s
            b_far = tl.where(near_one, 1.0, bd)
            general = (t_pdp - ghat_dp) / (b_far * b_far) - (t_pldp + t_ent * ghat_dp) / b_far
            da = tl.where(ok, tl.where(near_one, near, general), 0.0)
            tl.store(DAlphaRow + row_base + offs_m, da, mask=row_ok)
    else:
        delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0).to(ACC)

    dq = tl.zeros((BLOCK_M, HEAD_DIM), ACC)
    for start_n in range(n_start, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
        s = _scores(q, kt, Mask, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, band_lo, band_hi,
                    HAS_MASK, BAND, ACC, DOT)
        p, g = _probs(s, c[:, None], b, FAMILY)
        if EDGE:
            p_edge = tl.zeros((BLOCK_M, BLOCK_N), tl.float64)
            if edge_head:
                p_edge = _edge_p(s.to(tl.float64), c, pivot, qv, qb, b_edge)
                p = p_edge.to(ACC)
        if _any_nonzero(p):  # every term vanishes outside the support
            vt = _load_t(V, stride_vn, stride_vd, offs_n, S_b, EV, HEAD_DIM_V)
            dp = tl.dot(do, vt, input_precision=DOT, out_dtype=ACC)
            if DROPOUT:
                dp = dp * _dropout_scale(seed, threshold, drop_scale, row_base, offs_m, offs_n, G)
            ds = scale * g * (dp - delta[:, None])
            if EDGE:
                if edge_head:
                    ds = (scale * _edge_ds(p_edge, dp.to(tl.float64), qv, dp_r, edge_n, b_edge)).to(ACC)
            if K.dtype.element_ty == tl.float16 or K.dtype.element_ty == tl.bfloat16:
                dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT, out_dtype=ACC)
            else:
                # K again, as rows: with the transposed kt as the right operand,
                # float32 dQ came out zero on an H100 (triton 3.6).
                k_rows = _load_rows(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
                dq = tl.dot(ds.to(k_rows.dtype), k_rows, dq, input_precision=DOT, out_dtype=ACC)
    _store_rows(DQ, dq, stride_dqm, stride_dqd, offs_m, L, E, HEAD_DIM)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, Mask, Alpha, DO, Shift, Delta, EdgeRows, DK, DV, KeyLen, RowB,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, GROUP, L, S, E, EV, scale, scale_lo, seed, threshold, drop_scale, drop_lo, G, L_TUNE, S_TUNE,
    causal, win_left, win_right,
    FAMILY: tl.constexpr, HAS_MASK: tl.constexpr, BAND: tl.constexpr, HAS_KEYLEN: tl.constexpr,
    HAS_ROWB: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACC: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr, DOT: tl.constexpr,
):
    """dK = Σ dsᵀ·Q and dV = Σ pᵀ·dO for one block of keys of one key/value head,
    summed over the GROUP query heads that share it (no atomics). With EDGE,
    heads with α > 2 take p and ds in p-space from the dQ kernel's EdgeRows."""
    scale, drop_scale = _full_width(scale, scale_lo, ACC), _full_width(drop_scale, drop_lo, ACC)
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    HK = H // GROUP
    bi = (pid_bhk // HK).to(tl.int64)
    hk = pid_bhk % HK
    K += bi * stride_kb + hk.to(tl.int64) * stride_kh
    V += bi * stride_vb + hk.to(tl.int64) * stride_vh
    DK += bi * stride_dkb + hk.to(tl.int64) * stride_dkh
    DV += bi * stride_dvb + hk.to(tl.int64) * stride_dvh

    S_b = _keys_valid(KeyLen, bi, S, HAS_KEYLEN)
    band_lo, band_hi = _band_offsets(L, S_b, causal, win_left, win_right)
    start_n = pid_n * BLOCK_N
    # Earlier and later query rows see none of these keys.
    if HAS_ROWB:
        m_start, m_end = _query_range_rows(RowB, bi, start_n, L, S_b, band_lo, band_hi, BLOCK_M, BLOCK_N)
    else:
        m_start, m_end = _query_range(start_n, L, S_b, band_lo, band_hi, BAND, BLOCK_M, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kt = _load_t(K, stride_kn, stride_kd, offs_n, S_b, E, HEAD_DIM)
    vt = _load_t(V, stride_vn, stride_vd, offs_n, S_b, EV, HEAD_DIM_V)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), ACC)
    dv = tl.zeros((BLOCK_N, HEAD_DIM_V), ACC)
    for j in range(0, GROUP):
        h = hk * GROUP + j
        b = _load_b(Alpha, h, FAMILY, ACC)
        if EDGE:
            b_edge = _edge_load_b(Alpha, h)
            edge_head = b_edge > 1.0
        Qh = Q + bi * stride_qb + h.to(tl.int64) * stride_qh
        DOh = DO + bi * stride_ob + h.to(tl.int64) * stride_oh
        Mh = Mask + bi * stride_mb + h.to(tl.int64) * stride_mh
        row_base = (bi * H + h).to(tl.int64) * L
        for start_m in range(m_start, m_end, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < L
            q = _load_rows(Qh, stride_qm, stride_qd, offs_m, L, E, HEAD_DIM)
            c = tl.load(Shift + row_base + offs_m, mask=row_ok, other=float("inf")).to(ACC)
            row_lo, row_hi = band_lo, band_hi
            if HAS_ROWB:
                row_lo, row_hi = _row_band(RowB, bi, offs_m, L, band_lo, band_hi)
            s = _scores(q, kt, Mh, stride_mm, stride_mn, offs_m, offs_n, L, S_b, scale, row_lo, row_hi,
                        HAS_MASK, BAND, ACC, DOT)
            p, g = _probs(s, c[:, None], b, FAMILY)
            if EDGE:
                p_edge = tl.zeros((BLOCK_M, BLOCK_N), tl.float64)
                qv = tl.zeros((BLOCK_M,), tl.float64) + 1.0
                dp_r = tl.zeros((BLOCK_M,), tl.float64)
                edge_n = dp_r
                if edge_head:
                    rows4 = (row_base + offs_m) * 4
                    pivot = tl.load(EdgeRows + rows4, mask=row_ok, other=0.0)
                    qv = tl.load(EdgeRows + rows4 + 1, mask=row_ok, other=1.0)
                    dp_r = tl.load(EdgeRows + rows4 + 2, mask=row_ok, other=0.0)
                    edge_n = tl.load(EdgeRows + rows4 + 3, mask=row_ok, other=0.0)
                    p_edge = _edge_p(s.to(tl.float64), c, pivot, qv, tl.exp(b_edge * tl.log(qv)), b_edge)
                    p = p_edge.to(ACC)
            if _any_nonzero(p):  # every term vanishes outside the support
                do = _load_rows(DOh, stride_om, stride_od, offs_m, L, EV, HEAD_DIM_V)
                delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0).to(ACC)
                dp = tl.dot(do, vt, input_precision=DOT, out_dtype=ACC)
                if DROPOUT:  # dp of the kept weights; dV from the kept weights
                    keep = _dropout_scale(seed, threshold, drop_scale, row_base, offs_m, offs_n, G)
                    dp = dp * keep
                    p_kept = p * keep
                else:
                    p_kept = p
                ds = scale * g * (dp - delta[:, None])
                if EDGE:
                    if edge_head:
                        ds = (scale * _edge_ds(p_edge, dp.to(tl.float64), qv, dp_r, edge_n, b_edge)).to(ACC)
                dv = tl.dot(tl.trans(p_kept).to(do.dtype), do, dv, input_precision=DOT, out_dtype=ACC)
                dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=DOT, out_dtype=ACC)
    _store_rows(DK, dk, stride_dkn, stride_dkd, offs_n, S, E, HEAD_DIM)
    _store_rows(DV, dv, stride_dvn, stride_dvd, offs_n, S, EV, HEAD_DIM_V)


# --- launch configurations ---------------------------------------------------------------------------
#
# On a GPU the block sizes, warps and stages are autotuned per shape, from
# candidates pruned to fit shared memory. The key holds the lengths rounded up
# to a power of two (L_TUNE, S_TUNE), the head dims, normalizer and flags, so a
# new length within a bucket is not tuned again. ATTNKERN_TRITON_AUTOTUNE picks
# the candidates: "full" (the default), "small" (three per kernel) or "one" (a
# single configuration, no timing: what a test run on a GPU wants, where every
# new shape would otherwise compile and time each candidate). Under the
# interpreter there is no timing: the prune step keeps the single configuration
# that covers the short test shapes in few blocks, so the autotuner never
# benchmarks, and the launchers run one code path in both modes.

_INTERP_SIZES = (16, 32, 64)
# The shared-memory budget of the estimate in _prune where the device does not
# say how much a block may have (the estimate runs above what the compiler
# allocates, so the device's own limit leaves room for its buffers).
_SMEM_FALLBACK = 96 * 1024

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per autotune mode, for the kernels that
# stream key blocks past a block of query rows (forward, dQ) and for dK/dV, which
# streams query blocks past a block of keys.
_ROW_CANDIDATES = {
    "full": [(bm, bn, w, st) for bm, bn, w in ((128, 64, 8), (64, 64, 4), (64, 32, 4), (32, 32, 4), (16, 16, 2))
             for st in (1, 2, 3)],
    "small": [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
    "one": [(64, 32, 4, 2)],
}
_KEY_CANDIDATES = {
    "full": [(bm, bn, w, st) for bm, bn, w in ((32, 128, 8), (64, 64, 4), (32, 64, 4), (32, 32, 4), (16, 16, 2))
             for st in (1, 2, 3)],
    "small": [(32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)],
    "one": [(32, 64, 4, 2)],
}
_TUNE_KEY = ["L_TUNE", "S_TUNE", "HEAD_DIM", "HEAD_DIM_V", "FAMILY", "HAS_MASK", "BAND", "HAS_KEYLEN", "HAS_ROWB",
             "EDGE", "DOT"]


def autotune_mode() -> str:
    """ATTNKERN_TRITON_AUTOTUNE, checked: "full" (unset), "small" or "one"."""
    mode = os.environ.get("ATTNKERN_TRITON_AUTOTUNE", "") or "full"
    if mode not in _ROW_CANDIDATES:
        raise ValueError(f"ATTNKERN_TRITON_AUTOTUNE must be one of {sorted(_ROW_CANDIDATES)}, got {mode!r}")
    return mode


AUTOTUNE = autotune_mode()


@functools.cache
def _smem_budget(device_index: int) -> int:
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or _SMEM_FALLBACK)


def _interp_block(n):
    return min(_INTERP_SIZES[-1], max(_INTERP_SIZES[0], triton.next_power_of_2(n)))


def _configs(candidates):
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}) for bm in _INTERP_SIZES for bn in _INTERP_SIZES]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in candidates[AUTOTUNE]]


def _prune(configs, nargs, kw, streamed_is_keys):
    """Keeps the configurations that fit; `streamed_is_keys`: whether the loop
    streams key blocks (forward, dQ) or query blocks (dK/dV)."""
    L, S = nargs["L"], nargs["S"]
    if INTERPRETED:
        bm, bn = _interp_block(L), _interp_block(S)
        return [c for c in configs if c.kwargs["BLOCK_M"] == bm and c.kwargs["BLOCK_N"] == bn][:1]
    elem = nargs["Q"].element_size()
    budget = _smem_budget(nargs["Q"].device.index or 0)
    hd, hdv = kw["HEAD_DIM"], kw["HEAD_DIM_V"]
    wide = 8 if kw["ACC"] == tl.float64 else 4
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        resident, streamed = (bm, bn) if streamed_is_keys else (bn, bm)
        smem = elem * (resident * (hd + hdv) + max(c.num_stages, 1) * streamed * (hd + hdv)) \
            + wide * bm * bn
        # Blocks much longer than the sequence only waste work.
        too_long = bm > max(16, triton.next_power_of_2(L)) or bn > max(16, triton.next_power_of_2(S))
        if smem <= budget and not too_long:
            kept.append(c)
    if not kept:  # the smallest configuration always runs
        kept = [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))]
    return kept


# The kernels' argument types as the launchers (attention.py) pass them, for
# compiling ahead of time without a GPU (tests/test_triton.py,
# benchmarks/triton_sweep.py): Python floats arrive as fp32, the dropout seed
# and threshold as int64, other scalars as int32; the buffers beside the data
# tensors have fixed dtypes, Delta the accumulation dtype.
_FLOAT_ARGS = frozenset({"scale", "scale_lo", "eps", "alpha_band", "drop_scale", "drop_lo"})
_INT64_ARGS = frozenset({"seed", "threshold"})
_BUFFER_DTYPES = {"Alpha": "fp32", "Shift": "fp32", "Counts": "i32", "DAlphaRow": "fp64", "EdgeRows": "fp64",
                  "KeyLen": "i64", "RowB": "i64"}
_DATA_POINTERS = frozenset({"Q", "K", "V", "Mask", "Out", "DO", "DQ", "DK", "DV"})


def aot_signature(fn, constexprs: dict, dtype: str) -> dict:
    """The signature of kernel `fn` for triton.compile(ASTSource(fn, signature,
    constexprs)), its data tensors (q, k, v, mask, gradients) of `dtype`
    ("bf16", "fp16", "fp32" or "fp64")."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "Delta":
            sig[name] = "*fp64" if dtype == "fp64" else "*fp32"
        elif name in _BUFFER_DTYPES:
            sig[name] = "*" + _BUFFER_DTYPES[name]
        elif name in _DATA_POINTERS:
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i64" if name in _INT64_ARGS else "i32"
    return sig


def _no_timing(kernel_call, quantiles):
    """The interpreter's stand-in for timing: its prune step leaves one
    configuration, which triton 3.6 still 'benchmarks' (3.8 does not), and
    timing needs a GPU driver. Nothing is run."""
    return [0.0 for _ in quantiles]


_BENCH = {"do_bench": _no_timing} if INTERPRETED else {}

attn_fwd = triton.autotune(
    configs=_configs(_ROW_CANDIDATES), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": lambda cs, nargs, **kw: _prune(cs, nargs, kw, True)}, **_BENCH,
)(_attn_fwd_kernel)
attn_bwd_dq = triton.autotune(
    configs=_configs(_ROW_CANDIDATES), key=_TUNE_KEY + ["STATS", "ALPHA_GRAD"],
    prune_configs_by={"early_config_prune": lambda cs, nargs, **kw: _prune(cs, nargs, kw, True)}, **_BENCH,
)(_attn_bwd_dq_kernel)
attn_bwd_dkdv = triton.autotune(
    configs=_configs(_KEY_CANDIDATES), key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": lambda cs, nargs, **kw: _prune(cs, nargs, kw, False)}, **_BENCH,
)(_attn_bwd_dkdv_kernel)
