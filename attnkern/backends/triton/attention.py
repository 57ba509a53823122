"""Launchers for the fused attention kernels in `kernels.py`.

The functions here implement the contract of the C++ ops
`attnkern::attention_fwd` / `attnkern::attention_bwd` (see `attention_fwd`),
so `register_as_cuda_impl` can install them as those ops' CUDA kernels.
"""

from __future__ import annotations

import importlib
import math
import struct

import torch
import triton
from triton import knobs

from attnkern.family import ALPHA_GRAD_SERIES_BAND, NORMALIZERS, Family, acc_dtype

# Newton steps in the threshold search before giving up on a row (each one
# re-reads K). Rows converge in 3-11 steps for b <= 1; bisection fallbacks for
# α > 2 may need more.
_MAX_ITER = 64
# The smallest BLOCK_N of any configuration (sizes the key-block bitmask).
_MIN_BLOCK_N = 16
# Candidate sets per row in the threshold search (kernels._set_bounds). More sets save
# little in passes over K and cost much compile time; with 4 the passes stay within 7
# (sparsemax, entmax15) and 8 (α).
_NSETS = 4


def _kernels():
    """The kernels module, (re)defined so that it matches TRITON_INTERPRET now."""
    mod = importlib.import_module("attnkern.backends.triton.kernels")
    if mod.INTERPRETED != bool(knobs.runtime.interpret):
        mod = importlib.reload(mod)
    return mod


def interpreter_ready() -> tuple[bool, str]:
    """Whether kernels can run on CPU tensors now, or why not.

    triton.jit reads TRITON_INTERPRET when a function is decorated, and
    triton's own library functions (tl.zeros, tl.max, ...) are decorated when
    triton is imported, so the variable must be set before `import triton`.
    """
    if not knobs.runtime.interpret:
        return False, "TRITON_INTERPRET=1 is not set"
    import triton.language.standard as std

    if type(std.zeros).__name__ != "InterpretedFunction":
        return False, ("TRITON_INTERPRET=1 was set after triton was imported; set it before the first "
                       "`import triton` (e.g. in the environment)")
    return True, ""


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"triton attention: all tensors must be on one device, got {t.device} and {dev}")
    if dev.type == "cuda":
        return
    if dev.type == "cpu":
        ok, why = interpreter_ready()
        if ok:
            return
        raise RuntimeError(
            "triton attention: CPU tensors run only under the Triton interpreter, which is not usable: "
            f"{why} (or move the tensors to a CUDA device)")
    raise RuntimeError(f"triton attention: unsupported device {dev} (CUDA, or CPU with TRITON_INTERPRET=1)")


def _acc_dtype(q: torch.Tensor):
    """The accumulation dtype (family.acc_dtype) as a triton type."""
    import triton.language as tl

    return {torch.float64: tl.float64, torch.float32: tl.float32}[acc_dtype(q.dtype)]


def _eps(q: torch.Tensor) -> float:
    return float(torch.finfo(acc_dtype(q.dtype)).eps)


def _split(x: float) -> tuple[float, float]:
    """x as a float32 head and the float32 rest (kernels._full_width adds them
    back in the accumulation dtype): triton passes a Python float as float32,
    which would cut a float64 kernel's scale to float32's precision."""
    head = struct.unpack("f", struct.pack("f", x))[0]
    return head, struct.unpack("f", struct.pack("f", x - head))[0]


def _tune_length(n: int) -> int:
    """A length as the autotune key holds it: rounded up to a power of two, so
    that a new sequence length reuses the configuration tuned for its bucket."""
    return triton.next_power_of_2(max(n, 1))


def dot_precision(q: torch.Tensor) -> str:
    """How the kernels' float32 matrix products run, following PyTorch's own
    switch for CUDA matmuls: "tf32" on the tensor cores when
    torch.backends.cuda.matmul.allow_tf32 is set (off by default), else "ieee"
    (full float32 on the CUDA cores). Half types and float64 always take "ieee",
    which for them is their only precision."""
    if q.dtype == torch.float32 and q.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _head_dim(n: int) -> int:
    # tl.arange needs a power of two, tl.dot at least 16.
    return max(16, triton.next_power_of_2(n))


def _validate(q, k, v, mask, normalizer, alpha):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("triton attention: q, k, v must be 4-D (batch, heads, seq, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, L, E = q.shape
    Bk, Hk, S, Ek = k.shape
    if Bk != B or Ek != E or v.shape[0] != B or v.shape[1] != Hk or v.shape[2] != S:
        raise ValueError(f"triton attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if Hk == 0 or H % Hk != 0:
        raise ValueError(f"triton attention: query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"triton attention: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if normalizer not in NORMALIZERS:
        raise ValueError(f"triton attention: normalizer must be one of {NORMALIZERS}, "
                         f"got {normalizer!r}")
    family = Family.of(normalizer)
    if family.takes_alpha:
        if alpha is None or alpha.shape != (H,):
            raise ValueError(f"triton attention: entmax needs alpha of shape ({H},), got "
                             f"{None if alpha is None else tuple(alpha.shape)}")
    if mask is not None:
        if not mask.is_floating_point():
            raise TypeError("triton attention: mask must be a float tensor (-inf = not allowed), "
                            f"got {mask.dtype}")
        try:
            mask = mask.expand(B, H, L, S)
        except RuntimeError as exc:
            raise ValueError(f"triton attention: mask of shape {tuple(mask.shape)} does not broadcast to "
                             f"{(B, H, L, S)}") from exc
    tensors = [q, k, v] + ([mask] if mask is not None else []) + ([alpha] if family.takes_alpha else [])
    _check_device(*tensors)
    return mask, family


def _alpha_arg(family: Family, alpha, q):
    if family.takes_alpha:
        return alpha.to(torch.float32).contiguous()
    return torch.empty(0, dtype=torch.float32, device=q.device)


def _has_edge_heads(family: Family, alpha) -> bool:
    """Whether some head has α > 2, whose rows the kernels solve in p-space
    (compiled in only then: EDGE). Reads α on the host: one synchronization."""
    return family is Family.ENTMAX and bool((alpha > 2).any())


def _interpreter_inputs(*tensors):
    """Under the interpreter, bfloat16 operands as float32 copies: its tl.dot on
    bfloat16 returns garbage (triton 3.8). Outputs keep their dtypes."""
    if knobs.runtime.interpret and tensors[0].dtype == torch.bfloat16:
        return tuple(t.float() for t in tensors)
    return tensors


def _band_args(q, is_causal, window_left, window_right, key_lengths):
    """(KeyLen, (causal, window_left, window_right), BAND, HAS_KEYLEN): the key
    band of the C++ ops as the kernels take it (kernels._band_offsets)."""
    for name, side in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(side, bool) or not isinstance(side, int) or side < -1:
            raise ValueError(f"triton attention: {name} must be an int >= -1 (-1: unbounded), got {side!r}")
    if key_lengths is not None:
        if key_lengths.dtype != torch.int64 or tuple(key_lengths.shape) != (q.shape[0],):
            raise ValueError(f"triton attention: key_lengths must be int64 of shape ({q.shape[0]},), got "
                             f"{key_lengths.dtype} {tuple(key_lengths.shape)}")
        _check_device(q, key_lengths)
        key_lengths = key_lengths.contiguous()
    band = bool(is_causal) or window_left >= 0 or window_right >= 0
    return ((key_lengths if key_lengths is not None else q), (int(bool(is_causal)), window_left, window_right),
            band, key_lengths is not None)


def _row_bounds_arg(q, row_bounds):
    """(RowB, HAS_ROWB): a BlockMask's per-row runs of keys, int64 (B, L, 2)
    on q's device, or a placeholder pointer, never read."""
    if row_bounds is None:
        return q, False
    B, L = q.shape[0], q.shape[2]
    if row_bounds.dtype != torch.int64 or tuple(row_bounds.shape) != (B, L, 2):
        raise ValueError(f"triton attention: row_bounds must be int64 of shape ({B}, {L}, 2), got "
                         f"{row_bounds.dtype} {tuple(row_bounds.shape)}")
    _check_device(q, row_bounds)
    return row_bounds.contiguous(), True


def _mask_args(mask, q):
    if mask is None:
        return q, (0, 0, 0, 0)  # a placeholder pointer, never read
    return mask, tuple(mask.stride())


def _dropout_args(dropout_p: float, dropout_seed, S: int):
    """(seed, threshold, scale, ⌈S/4⌉, on) for the kernels: the mask of csrc/cpu/dropout.h."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"triton attention: dropout_p must be in [0, 1), got {dropout_p}")
    threshold = min(math.floor(dropout_p * 2**32 + 0.5), 2**32 - 1)  # std::round, as dropout.h
    if threshold == 0:
        return 0, 0, 1.0, 1, False
    if dropout_seed is None or dropout_seed.numel() != 1 or dropout_seed.dtype != torch.int64:
        raise ValueError("triton attention: dropout_p > 0 needs dropout_seed, an int64 tensor of one element")
    return int(dropout_seed.item()), threshold, 1.0 / (1.0 - dropout_p), (S + 3) // 4, True


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool, scale: float, normalizer: str, alpha: torch.Tensor | None,
                  dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None, window_left: int = -1,
                  window_right: int = -1, key_lengths: torch.Tensor | None = None,
                  row_bounds: torch.Tensor | None = None):
    """Fused attention forward: out = p·v with p = normalizer(scale·q·kᵀ + mask) per query row.

    q: (B, H, L, E); k: (B, Hk, S, E); v: (B, Hk, S, Ev), H a multiple of Hk
    (query head h reads key/value head h // (H // Hk)); any strides.
    mask: None or a float tensor broadcastable to (B, H, L, S), added to the
    scores (-inf = not allowed). is_causal: query i sees keys j <= i.
    normalizer: "softmax", "sparsemax", "entmax15" or "entmax" (then alpha is a
    float32 tensor (H,), α per head).
    Returns out (B, H, L, Ev) in q's dtype and shift (B, H, L) float32: the c
    with p_ij = φ_b(s_ij - c_i) (the log-sum-exp for softmax; for sparsemax
    its threshold θ, p_ij = [s_ij - θ_i]_+, as the CPU kernel saves it; +inf
    for a row with no allowed key, whose output is 0).
    dropout_p, dropout_seed: dropout on the weights before p·v, the keep mask
    drawn from the seed (an int64 scalar tensor) as the CPU kernel draws it.
    window_left, window_right (-1: unbounded): query i sees keys j within
    [i + S_b - L - window_left, i + S_b - L + window_right] (bottom-right);
    key_lengths (int64 (B,) or None): batch b's keys [0, S_b) are valid, S_b = S
    without it. row_bounds (int64 (B, L, 2) or None): query i of batch b sees
    only keys [row_bounds[b, i, 0], row_bounds[b, i, 1]) (a BlockMask's rows).
    Only the key blocks some row of a query block may see are read.
    Besides out and shift it allocates nothing that grows with L·S.
    """
    out, shift, _ = _attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p, dropout_seed,
                                   (window_left, window_right, key_lengths), count=False, row_bounds=row_bounds)
    return out, shift


def forward_pass_counts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        is_causal: bool, scale: float, normalizer: str, alpha: torch.Tensor | None, *,
                        window: tuple[int, int] = (-1, -1), key_lengths: torch.Tensor | None = None,
                        row_bounds: torch.Tensor | None = None):
    """`attention_fwd` (without dropout) instrumented: (out, shift, passes, blocks).

    passes (B, H, ⌈L/BLOCK_M⌉) int32: the passes over the keys each query block
    made (each recomputes q·kᵀ on the key blocks it reads), counting the first
    one (row max and bounds) and the last (P·V); blocks: the key blocks it read
    over all passes. BLOCK_M is the one the launcher picked.
    """
    out, shift, counts = _attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, 0.0, None,
                                        (*window, key_lengths), count=True, row_bounds=row_bounds)
    return out, shift, counts[..., 0], counts[..., 1]


def _attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p, dropout_seed, band, count,
                   row_bounds=None):
    mask, family = _validate(q, k, v, mask, normalizer, alpha)
    key_len, band_ints, band_on, has_keylen = _band_args(q, is_causal, *band)
    row_b, has_rowb = _row_bounds_arg(q, row_bounds)
    seed, threshold, drop_scale, groups, dropout = _dropout_args(float(dropout_p), dropout_seed, k.shape[2])
    kern = _kernels()
    B, H, L, E = q.shape
    Hk, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((B, H, L, Ev), dtype=q.dtype, device=q.device)
    shift = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    # Filled by the kernel when `count` (it knows BLOCK_M); a placeholder otherwise.
    counts = torch.zeros((B, H, 0, 2), dtype=torch.int32, device=q.device)
    if B * H * L == 0:
        return out, shift, counts
    if S == 0:
        out.zero_()
        shift.fill_(math.inf)
        return out, shift, counts
    mask_t, mstr = _mask_args(mask, q)
    hd, hdv = _head_dim(E), _head_dim(Ev)
    grid = lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), B * H)
    q, k, v = _interpreter_inputs(q, k, v)
    if count:
        # Room for the smallest BLOCK_M; trimmed to the one used below.
        counts = torch.zeros((B, H, triton.cdiv(L, _MIN_BLOCK_N), 2), dtype=torch.int32, device=q.device)
    n_words = triton.next_power_of_2(triton.cdiv(triton.cdiv(S, _MIN_BLOCK_N), 32))
    kern.attn_fwd[grid](
        q, k, v, mask_t, _alpha_arg(family, alpha, q), out, shift, counts, key_len, row_b,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *out.stride(),
        H, H // Hk, L, S, E, Ev, *_split(scale), _eps(q), seed, threshold, *_split(drop_scale), groups,
        _tune_length(L), _tune_length(S), *band_ints,
        FAMILY=int(family), HAS_MASK=mask is not None, BAND=band_on or has_rowb, HAS_KEYLEN=has_keylen,
        HAS_ROWB=has_rowb, HEAD_DIM=hd, HEAD_DIM_V=hdv, MAX_ITER=_MAX_ITER, ACC=_acc_dtype(q), DROPOUT=dropout,
        N_WORDS=n_words, NSETS=_NSETS, COUNT=count, EDGE=_has_edge_heads(family, alpha),
        DOT=dot_precision(q),
    )
    if count:
        n_blocks_m = triton.cdiv(L, kern.attn_fwd.best_config.kwargs["BLOCK_M"])
        counts = counts.reshape(B * H * triton.cdiv(L, _MIN_BLOCK_N), 2)[:B * H * n_blocks_m]
        counts = counts.reshape(B, H, n_blocks_m, 2)
    return out, shift, counts


def attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, is_causal: bool, scale: float, normalizer: str,
                  alpha: torch.Tensor | None, out: torch.Tensor, shift: torch.Tensor, alpha_grad: bool,
                  dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None, window_left: int = -1,
                  window_right: int = -1, key_lengths: torch.Tensor | None = None,
                  row_bounds: torch.Tensor | None = None):
    """Fused attention backward, recomputing the scores from q, k and the saved shift.

    Arguments as `attention_fwd`, plus grad_out (B, H, L, Ev), the forward's
    out and shift, and alpha_grad (only for normalizer "entmax").
    Returns dq, dk, dv (the dtypes and shapes of q, k, v) and dalpha: float32
    (H,) when alpha_grad, else an empty tensor. With g = p^(2-α) on the
    support and dp = dO·vᵀ: ds = scale·g⊙(dp - Σ g dp / Σ g), dq = ds·K,
    dk = dsᵀ·Q, dv = pᵀ·dO.
    """
    mask, family = _validate(q, k, v, mask, normalizer, alpha)
    key_len, band_ints, band_on, has_keylen = _band_args(q, is_causal, window_left, window_right, key_lengths)
    row_b, has_rowb = _row_bounds_arg(q, row_bounds)
    if alpha_grad and not family.takes_alpha:
        raise ValueError(f"triton attention: alpha_grad needs normalizer 'entmax', got {normalizer!r}")
    _check_device(q, grad_out, out, shift)
    kern = _kernels()
    B, H, L, E = q.shape
    Hk, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    if grad_out.shape != (B, H, L, Ev) or shift.shape != (B, H, L):
        raise ValueError(f"triton attention: grad_out {tuple(grad_out.shape)} / shift "
                         f"{tuple(shift.shape)} do not match {(B, H, L, Ev)} / {(B, H, L)}")
    dq = torch.zeros((B, H, L, E), dtype=q.dtype, device=q.device)
    dk = torch.zeros((B, Hk, S, E), dtype=k.dtype, device=q.device)
    dv = torch.zeros((B, Hk, S, Ev), dtype=v.dtype, device=q.device)
    dalpha = (torch.zeros(H, dtype=torch.float32, device=q.device) if alpha_grad
              else torch.empty(0, dtype=torch.float32, device=q.device))
    if B * H * L == 0 or S == 0:
        return dq, dk, dv, dalpha

    seed, threshold, drop_scale, groups, dropout = _dropout_args(float(dropout_p), dropout_seed, S)
    acc_torch = acc_dtype(q.dtype)
    shift = shift.to(torch.float32).contiguous()
    grad_out = grad_out.to(q.dtype)
    stats = family is not Family.SOFTMAX
    if stats:
        delta = torch.empty((B, H, L), dtype=acc_torch, device=q.device)
    else:
        # Softmax: Σ_j p_j dp_j = dO·O (FlashAttention's delta).
        delta = (grad_out.to(acc_torch) * out.to(acc_torch)).sum(-1).contiguous()
    dalpha_rows = torch.zeros((B, H, L) if alpha_grad else (1,), dtype=torch.float64, device=q.device)
    edge = _has_edge_heads(family, alpha)
    # Per row of a head with α > 2: pivot, q, the pivot's dp, Σ g (dp - dp_r) / Σ ĝ (kernels._edge_ds).
    edge_rows = torch.zeros((B * H * L, 4) if edge else (4,), dtype=torch.float64, device=q.device)

    mask_t, mstr = _mask_args(mask, q)
    hd, hdv = _head_dim(E), _head_dim(Ev)
    alpha_t = _alpha_arg(family, alpha, q)
    q, k, v, grad_out = _interpreter_inputs(q, k, v, grad_out)
    common = dict(FAMILY=int(family), HAS_MASK=mask is not None, BAND=band_on or has_rowb, HAS_KEYLEN=has_keylen,
                  HAS_ROWB=has_rowb, HEAD_DIM=hd, HEAD_DIM_V=hdv, ACC=_acc_dtype(q), DROPOUT=dropout, EDGE=edge,
                  DOT=dot_precision(q))
    drop = (seed, threshold, *_split(drop_scale), groups, _tune_length(L), _tune_length(S), *band_ints)
    kern.attn_bwd_dq[lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), B * H)](
        q, k, v, mask_t, alpha_t, grad_out, shift, delta, dalpha_rows, edge_rows, dq, key_len, row_b,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *grad_out.stride(), *dq.stride(),
        H, H // Hk, L, S, E, Ev, *_split(scale), _eps(q), ALPHA_GRAD_SERIES_BAND, *drop,
        STATS=stats, ALPHA_GRAD=bool(alpha_grad), **common,
    )
    kern.attn_bwd_dkdv[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hk)](
        q, k, v, mask_t, alpha_t, grad_out, shift, delta, edge_rows, dk, dv, key_len, row_b,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *grad_out.stride(), *dk.stride(), *dv.stride(),
        H, H // Hk, L, S, E, Ev, *_split(scale), *drop, **common,
    )
    if alpha_grad:
        dalpha = dalpha_rows.sum(dim=(0, 2)).to(torch.float32)
    return dq, dk, dv, dalpha


# --- pass counts of the forward (benchmarks/bench_triton_passes.py, tests/test_triton_passes.py) ---

# α of the heads of the "entmax" rows of the pass-count table (one head each).
PASS_COUNT_ALPHAS = (1.25, 1.5, 1.75)


def pass_count_inputs(kind: str, L: int, S: int, E: int, H: int = 1, seed: int = 0, device=None):
    """q (1, H, L, E), k and v (1, H, S, E) in float32 for counting passes.

    kind "random": N(0, 1) entries (scores N(0, 1) at scale E^-1/2, support
    scattered over the keys). "local": q_i and k_j share a sinusoidal code of
    the position, plus noise, so scores peak near the diagonal i ≈ j·L/S and
    the support lies in a few key blocks.
    """
    if kind not in ("random", "local"):
        raise ValueError(f"pass_count_inputs: kind must be 'random' or 'local', got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        q, k, v = (torch.randn(1, H, n, E, generator=g, device=g.device) for n in (L, S, S))
    else:
        def code(pos):
            freq = torch.exp(-torch.arange(E // 2, dtype=torch.float64) / (E // 2) * math.log(max(L, S)))
            ang = pos.double()[:, None] * freq[None, :]
            return torch.cat([torch.sin(ang), torch.cos(ang)], -1).float() * 0.6

        q = code(torch.arange(L) * (S / L)) + 0.3 * torch.randn(1, H, L, E, generator=g, device=g.device)
        k = code(torch.arange(S)) + 0.3 * torch.randn(1, H, S, E, generator=g, device=g.device)
        v = torch.randn(1, H, S, E, generator=g, device=g.device)
    return tuple(t.to(device) for t in (q, k, v))


def pass_count_summary(normalizer: str, kind: str, L: int, S: int, E: int = 64, seed: int = 0,
                       query_rows: slice | None = None, device=None) -> dict:
    """Passes over K of the forward per query block on `pass_count_inputs`, in float32.

    One head per α of PASS_COUNT_ALPHAS for "entmax", one head otherwise; scale
    E^-1/2, no mask. query_rows: only these query rows (the others would make
    the same passes as in the full problem, it is not causal). Returns
    max_passes, mean_passes (over query blocks and heads), mean_blocks (key
    blocks read per query block, all passes) and key_blocks (per pass).
    """
    H = len(PASS_COUNT_ALPHAS) if normalizer == "entmax" else 1
    q, k, v = pass_count_inputs(kind, L, S, E, H, seed, device)
    if query_rows is not None:
        q = q[:, :, query_rows]
    alpha = torch.tensor(PASS_COUNT_ALPHAS, device=device) if normalizer == "entmax" else None
    _, _, passes, blocks = forward_pass_counts(q, k, v, None, False, E**-0.5, normalizer, alpha)
    block_n = _kernels().attn_fwd.best_config.kwargs["BLOCK_N"]
    return dict(max_passes=int(passes.max()), mean_passes=float(passes.float().mean()),
                mean_blocks=float(blocks.float().mean()), key_blocks=triton.cdiv(S, block_n))
