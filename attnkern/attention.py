"""Fused attention with softmax, sparsemax, entmax15 or α-entmax weights.

`attention` takes the arguments of torch.nn.functional.scaled_dot_product_attention
(same shapes, broadcasting, masks and causal alignment) plus the normalizer.
"""

from __future__ import annotations

import math
import numbers

import torch

from attnkern import _extension, block_mask, ops, validation
from attnkern.backends import reference, registry
from attnkern.family import (
    ATTENTION_NORMALIZERS,
    NORMALIZERS,
    acc_dtype,
    check_attention_normalizer,
    takes_alpha,
    takes_lam,
)

__all__ = ["attention", "draw_dropout_seed", "NORMALIZERS", "ATTENTION_NORMALIZERS"]


def draw_dropout_seed() -> torch.Tensor:
    """The seed of one attention call's dropout mask: an int64 scalar drawn from
    torch's default CPU generator, so torch.manual_seed reproduces the mask.
    The kernels regenerate the mask from it (attnkern.testing.attention_dropout_mask
    returns it)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


# --- validation -----------------------------------------------------------------


def _check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, normalizer,
                  return_weights) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        validation.check_tensor(t, name)
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., seq, dim), got shape {tuple(t.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, "
                        f"{value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same last dim (E), got {query.shape[-1]} and "
                         f"{key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same sequence length (S), got {key.shape[-2]} and "
                         f"{value.shape[-2]}")
    if key.dim() >= 3 and value.dim() >= 3 and key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value must have the same number of heads, got {key.shape[-3]} and "
                         f"{value.shape[-3]}")
    validation.check_attn_mask(attn_mask, query)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    flags = (("is_causal", is_causal), ("enable_gqa", enable_gqa), ("return_weights", return_weights))
    for name, flag in flags:
        if not isinstance(flag, bool):
            kind = type(flag)
            kind_name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
            raise TypeError(f"{name} must be a Python bool, got {kind_name}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise TypeError(f"scale must be None or a finite float, got {scale!r}")
    check_attention_normalizer(normalizer)


def _check_window(window):
    """window as a pair of ints (left, right), each >= -1 (-1: unbounded), or None."""
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window)):
        raise TypeError(f"window must be None or a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0, or -1 for unbounded; got ({left}, {right})")
    return None if left == -1 and right == -1 else (left, right)


def _intersect_windows(a, b):
    """The window allowing what both allow (None: unbounded)."""
    if a is None or b is None:
        return a if b is None else b
    return tuple(min(x, y) if x >= 0 and y >= 0 else max(x, y) for x, y in zip(a, b, strict=True))


def _causal_bias(attn_mask, is_causal, window, L, S):
    """A torch.nn.attention.bias.CausalBias as attn_mask turned into is_causal
    (upper left, SDPA's alignment) or the window (-1, 0) (lower right), never
    materialized: (attn_mask, is_causal, window)."""
    # (Imported here: torch.nn.attention's modules import Triton on a GPU host,
    # which `import attnkern` must not.)
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal, window
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
        raise ValueError(f"attn_mask is a CausalBias for {attn_mask.seq_len_q} queries and "
                         f"{attn_mask.seq_len_kv} keys, but query has {L} and key {S}")
    if attn_mask.variant == CausalVariant.UPPER_LEFT:
        return None, True, window
    return None, is_causal, _intersect_windows(window, (-1, 0))


def _check_cache_seqlens(cache_seqlens, batch, S, device, compiling: bool):
    """cache_seqlens as an int64 tensor of one length per flattened batch
    element, each in [0, S]."""
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.is_floating_point() or \
            cache_seqlens.is_complex() or cache_seqlens.dtype == torch.bool:
        raise TypeError(f"cache_seqlens must be an integer tensor, got {type(cache_seqlens).__name__}"
                        + (f" of {cache_seqlens.dtype}" if isinstance(cache_seqlens, torch.Tensor) else ""))
    B = math.prod(batch)
    if tuple(cache_seqlens.shape) not in (tuple(batch), (B,)):
        raise ValueError(f"cache_seqlens must have one length per batch element, shape {tuple(batch)}, got "
                         f"{tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on the inputs' device {device}, got {cache_seqlens.device}")
    lengths = cache_seqlens.reshape(B).to(torch.int64)
    if not compiling and B > 0:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > S:
            raise ValueError(f"cache_seqlens must lie in [0, S = {S}] (the keys in the cache), got values in "
                             f"[{lo}, {hi}]")
    return lengths.contiguous()


# --- the plain call -----------------------------------------------------------------

# Normalizers that take no α: a call with one of them can skip the α handling.
_PLAIN_NORMALIZERS = frozenset({"softmax", "sparsemax", "entmax15"})
_PLAIN_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def _plain_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, normalizer, alpha,
                backend, return_weights) -> bool:
    """True for the call that needs none of attention()'s preparation: CPU
    tensors of one float32, float64, bfloat16 or float16 dtype (the kernel
    takes each as it is), all 4-d (B, H, seq, dim) with equal batch and
    heads, no mask, no dropout, no α, the default backend. These
    calls go straight to the autograd Function, skipping a validation and
    reshaping worth about 30 us a call, which at decoding sizes (one query,
    ~150 us in all) is a fifth of the time. Any other call, valid or not,
    takes the general path and its checks."""
    if not (attn_mask is None and alpha is None and backend == "auto" and enable_gqa is False
            and return_weights is False and (is_causal is True or is_causal is False)
            and normalizer in _PLAIN_NORMALIZERS and type(dropout_p) in (float, int) and dropout_p == 0
            and (scale is None or (scale.__class__ is float and math.isfinite(scale)))
            and type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
            and _extension.LOADED and query.is_cpu and key.is_cpu and value.is_cpu):
        return False
    dtype = query.dtype
    if dtype not in _PLAIN_DTYPES or key.dtype != dtype or value.dtype != dtype:
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    qs, ks, vs = query.shape, key.shape, value.shape
    return (qs[0] == ks[0] == vs[0] and qs[1] == ks[1] == vs[1] and qs[3] == ks[3] and ks[2] == vs[2]
            and qs[1] > 0 and qs[3] > 0 and not ops._compiling())


# --- the public function ----------------------------------------------------------


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
              dropout_p: float = 0.0, is_causal: bool = False, scale=None, enable_gqa: bool = False, *,
              normalizer: str = "softmax", alpha=None, lam=None, backend: str = "auto",
              return_weights: bool = False, window=None, cache_seqlens=None):
    """Attention with softmax, sparsemax, entmax15, α-entmax, fusedmax or oscarmax weights.

    Arguments as torch.nn.functional.scaled_dot_product_attention:
      query (..., H, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev); leading
      dims broadcast; Hk == H, or H a multiple of Hk with enable_gqa=True (or
      Hk == 1). attn_mask: bool (True = takes part) or float (added to the
      scores), broadcastable to (..., H, L, S), or a
      torch.nn.attention.bias.CausalBias (causal_upper_left = is_causal,
      causal_lower_right = window (-1, 0); never materialized). is_causal: query i sees keys
      j <= i (SDPA's top-left alignment). scale: default 1/sqrt(E).
      dropout_p: dropout on the weights (kept with probability 1 - dropout_p,
      scaled by 1 / (1 - dropout_p), as SDPA; 1 drops them all); the kernels regenerate the mask
      in the backward from a seed drawn from torch's generator, so
      torch.manual_seed reproduces it.
    normalizer: "softmax", "sparsemax" (Euclidean projection onto the simplex),
      "entmax15", or "entmax" with `alpha`: a float > 0, a tensor of H values
      (one per head), or a tensor broadcastable to (..., H, 1, 1); it may
      require grad. Each row of weights p solves
      argmax_{p in Δ} <p, s> + H^T_α(p) (Tsallis entropy; α = 1 Shannon).
      The structured "fusedmax" and "oscarmax" (attnkern.fusedmax,
      attnkern.oscarmax on each row of scores) take `lam` instead: a float >= 0
      (default 1.0), a tensor of H values or broadcastable to (..., H, 1, 1),
      which may require grad; λ applies to the scaled, masked scores. Their
      positions are key positions: masked keys are removed, so the allowed
      keys on either side of a masked run are neighbours (fusedmax), exactly
      as in the row-wise ops. CPU kernels only (fused, O(L + S) memory per
      block of rows); other devices take backend="reference".
    A query whose keys are all masked gets zeros (no NaN) for every normalizer.
    window: (left, right), FlashAttention's window_size: query i sees keys
      i + S - L - left <= j <= i + S - L + right (bottom-right alignment; the
      plain band for L = S); -1 leaves a side unbounded. With is_causal or a
      mask, the keys all of them allow. The kernels compute only the key
      blocks the window reaches.
    cache_seqlens: int tensor, one length per batch element (shape: the batch
      dims): batch element b sees only keys [0, cache_seqlens[b]) of a padded
      cache, no mask needed; the window then aligns to S_b = cache_seqlens[b].
    backend: "auto", "cpu", "cuda", "triton" or "reference".
    return_weights: also return the weights (..., H, L, S); this materializes
      them and runs unfused (the row-wise normalizer kernels).
    Returns out (..., H, L, Ev) in query's dtype [, weights].
    """
    if window is None and cache_seqlens is None and lam is None and _plain_call(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, normalizer, alpha, backend,
            return_weights):
        from attnkern.autograd import AttentionFunction

        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        return AttentionFunction.apply(query, key, value, None, None, is_causal, scale, normalizer, "ops", 0.0, None)
    if query.is_nested or key.is_nested or value.is_nested:
        return _nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, normalizer, alpha,
                       backend, return_weights, window, cache_seqlens, lam)
    compiling = ops._compiling()
    if not compiling:
        window = _check_window(window)
    bounds = None  # a BlockMask's rows: (Bm, Hm, L, 2) runs of keys
    if attn_mask is not None and type(attn_mask) is not torch.Tensor:
        if block_mask.is_block_mask(attn_mask):
            bounds = block_mask.row_bounds(attn_mask, query.shape[-2], key.shape[-2], check=not compiling)
            if bounds is None:  # (rows whose keys are not one run)
                return block_mask.attention_by_blocks(
                    attention, query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa, normalizer=normalizer, alpha=alpha, lam=lam,
                    backend=backend, return_weights=return_weights, window=window, cache_seqlens=cache_seqlens)
            attn_mask = None
        else:
            attn_mask, is_causal, window = _causal_bias(attn_mask, is_causal, window, query.shape[-2],
                                                        key.shape[-2])
    if not compiling:
        _check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, normalizer,
                      return_weights)
    if dropout_p == 1:
        # Every weight dropped, as SDPA and torch's module allow: zeros (and zero
        # gradients) in the shape and graph of the undropped result.
        res = attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, normalizer=normalizer,
                        alpha=alpha, lam=lam, backend=backend, return_weights=return_weights, window=window,
                        cache_seqlens=cache_seqlens)
        return tuple(r * 0 for r in res) if isinstance(res, tuple) else res * 0
    E = query.shape[-1]
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    # (E = 0: every score is 0, whatever the scale; SDPA gives uniform weights.)
    scale = (1.0 / math.sqrt(E) if E > 0 else 1.0) if scale is None else float(scale)

    # Everything as (*batch, heads, seq, dim); 2-d inputs get a unit head dim.
    added = max(0, 3 - max(query.dim(), key.dim(), value.dim()))
    q, k, v = (t if t.dim() >= 3 else t.reshape((1,) * (3 - t.dim()) + tuple(t.shape))
               for t in (query, key, value))
    H, Hk = q.shape[-3], k.shape[-3]
    q_heads_expanded = False
    if Hk != H:
        if H % Hk == 0 and (enable_gqa or Hk == 1):
            pass  # query head h uses key/value head h // (H // Hk)
        elif H == 1 and not enable_gqa:
            q = q.expand(*q.shape[:-3], Hk, L, E)
            H = Hk
            q_heads_expanded = True
        elif not compiling:
            raise ValueError(f"query has {H} heads and key/value {Hk}: they must be equal, or the query "
                             f"heads a multiple of the key/value heads with enable_gqa=True")
    try:
        if q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:  # the common case, without torch's helper
            batch = tuple(q.shape[:-3])
        else:
            batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError as exc:
        raise ValueError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not broadcast") from exc
    target = batch + (H, L, S)
    if bounds is not None and (len(batch) > 1 or bounds.shape[0] not in (1,) + batch[:1]
                               or bounds.shape[1] not in (1, H)):
        raise ValueError(f"attn_mask is a BlockMask of (B, H) = {tuple(bounds.shape[:2])}, which does not match "
                         f"the query's batch {batch} and {H} heads (FlexAttention's (B, H, L, E) layout)")
    if attn_mask is not None and not compiling:
        if not validation.broadcasts_to(attn_mask.shape, target):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {target} "
                             f"(..., heads, L, S)")
    if not compiling:
        alpha = validation.check_attention_alpha(alpha, normalizer, batch + (H, 1, 1), H, query.device)
        lam = validation.check_attention_lam(lam, normalizer, batch + (H, 1, 1), H, query.device)
    else:
        alpha = validation.head_alpha_view(alpha, H) if isinstance(alpha, torch.Tensor) else alpha
        lam = validation.head_alpha_view(lam, H) if isinstance(lam, torch.Tensor) else (
            1.0 if lam is None and takes_lam(normalizer) else lam)
    # The kernels take one parameter per head: α of α-entmax, λ of the
    # structured normalizers (in the op's alpha argument).
    has_head_param = takes_alpha(normalizer) or takes_lam(normalizer)
    head_param = lam if takes_lam(normalizer) else alpha

    alpha_batched = (isinstance(head_param, torch.Tensor) and head_param.dim() > 3
                     and any(d != 1 for d in head_param.shape[:-3]))
    key_lengths = None
    if cache_seqlens is not None:
        key_lengths = _check_cache_seqlens(cache_seqlens, batch, S, query.device, compiling)
        if alpha_batched and has_head_param:
            name = "lam" if takes_lam(normalizer) else "alpha"
            raise ValueError(f"cache_seqlens with an {name} that differs along the batch dims is not supported: "
                             f"give {name} one value per head, or call per batch element")
    mask_grad = isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad

    chosen = registry.choose(backend, query, "attention", mask_grad=mask_grad)
    if H == 0 or E == 0:
        chosen = "reference"  # nothing for a kernel to do: no heads, or scores all 0 (E = 0)
    # fusedmax on CUDA: unfused, the row kernel on materialized scores (no fused GPU kernel yet).
    rows_on_gpu = False
    if takes_lam(normalizer) and chosen not in ("cpu", "reference"):
        rows_on_gpu = (normalizer == "fusedmax" and query.device.type == "cuda"
                       and registry.why_not("cuda", query, "fusedmax") is None)
        if not rows_on_gpu:
            raise NotImplementedError(
                f"normalizer={normalizer!r} attention has CPU kernels only, and for fusedmax on CUDA tensors the "
                f"row kernel (got backend={backend!r} on {query.device}); backend='reference' runs the float64 "
                f"reference (materialized scores) on any device")
    unfused = return_weights or rows_on_gpu
    if has_head_param and chosen != "reference" and not compiling:
        _check_head_param_fits(head_param, head_param_dtype(query.dtype, chosen), query.dtype,
                               "lam" if takes_lam(normalizer) else "alpha")
    if (chosen == "reference" or unfused) and (window is not None or key_lengths is not None
                                               or bounds is not None):
        # (Unfused: the key band as a dense mask.)
        band = reference.band_mask(L, S, is_causal=is_causal, window=window, cache_seqlens=key_lengths,
                                   device=query.device)
        if key_lengths is not None:
            band = band.reshape(batch + (1, L, S))
        if bounds is not None:
            rows = block_mask.bounds_mask(bounds.to(query.device), S)
            band = band & (rows if batch else rows[0])
        attn_mask = band if attn_mask is None else (
            attn_mask & band if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~band, -math.inf))
        is_causal = False
    if chosen == "reference":
        res = reference.attention(q, k, v, attn_mask, is_causal, scale, normalizer=normalizer, alpha=alpha,
                                  lam=lam, dropout_p=float(dropout_p), return_weights=return_weights)
        return _unpad(res, added)
    if unfused:
        res = _unfused(q, k, v, attn_mask, is_causal, scale, normalizer, head_param,
                       "cuda" if rows_on_gpu else "auto" if chosen == "triton" else chosen, float(dropout_p))
        return _unpad(res if return_weights else res[0], added)

    B = math.prod(batch)
    acc = acc_dtype(query.dtype)
    # The kernels take bfloat16 and float16 as they are (the CPU kernel's
    # GEMMs run in the half type where the CPU has its dot products, else it
    # widens to float32 itself; its softmax decoding reads K and V in place).
    # The gradient of a broadcast input is a sum over the broadcast dims: take
    # it in float32 and round to the half type once.
    if query.dtype in (torch.float16, torch.bfloat16) and (
            q_heads_expanded or any(t.shape[:-3] != batch for t in (q, k, v))):
        q, k, v = q.float(), k.float(), v.float()

    def as_4d(t, heads, seq, dim):
        if t.dim() == 4 and t.shape[0] == B:  # already (B, heads, seq, dim)
            return t
        return t.expand(batch + (heads, seq, dim)).reshape(B, heads, seq, dim)

    q4, k4, v4 = as_4d(q, H, L, E), as_4d(k, Hk, S, E), as_4d(v, Hk, S, Ev)
    mask4 = None
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=acc, device=m.device).masked_fill_(~m, -math.inf)
        mask4 = m.to(acc).expand(target).reshape(B, H, L, S)
    alpha_h = None
    if has_head_param:
        alpha = head_param
        if isinstance(alpha, torch.Tensor) and alpha_batched:
            # One α per (batch, head): the kernels take one α per head, so the
            # batch is folded into the heads, (B, H) -> (1, B·H); query head
            # b·H + h still meets key/value head b·Hk + h // (H // Hk).
            alpha_h = alpha.to(head_param_dtype(query.dtype, chosen)).expand(batch + (H, 1, 1)).reshape(B * H)
            q4, k4, v4 = (t.reshape(1, B * t.shape[1], *t.shape[2:]) for t in (q4, k4, v4))
            if mask4 is not None:
                mask4 = mask4.reshape(1, B * H, L, S)
        else:
            alpha_h = head_param_vector(alpha, H, query, chosen)
    row_bounds = None
    if bounds is not None:
        q4, k4, v4, alpha_h, key_lengths, row_bounds = _fold_for_bounds(
            bounds, q4, k4, v4, alpha_h, key_lengths, head_param, normalizer)
    from attnkern.autograd import AttentionFunction

    impl = "triton" if chosen == "triton" else "ops"
    dropout_p = float(dropout_p)
    seed = draw_dropout_seed() if dropout_p > 0 else None
    out = AttentionFunction.apply(q4, k4, v4, mask4, alpha_h, is_causal, scale, normalizer, impl, dropout_p, seed,
                                  window if window is not None else (-1, -1), key_lengths, row_bounds)
    if out.shape != batch + (H, L, Ev):
        out = out.reshape(batch + (H, L, Ev))
    return _unpad(out if out.dtype == query.dtype else out.to(query.dtype), added)


def head_param_dtype(query_dtype: torch.dtype, chosen: str) -> torch.dtype:
    """The dtype of the kernels' per-head α / λ: float64 to the CPU kernels for
    float64 inputs (unrounded), else (and to the CUDA and Triton kernels) float32."""
    return torch.float64 if acc_dtype(query_dtype) == torch.float64 and chosen == "cpu" else torch.float32


def _check_head_param_fits(param, dtype: torch.dtype, query_dtype: torch.dtype, name: str) -> None:
    """α / λ (validated finite) must stay finite in the dtype the kernels take
    it in (head_param_dtype): a larger value would reach them as inf."""
    largest = torch.finfo(dtype).max
    if isinstance(param, torch.Tensor):
        too_large = param.device.type == "cpu" and param.numel() > 0 and bool(param.abs().max() > largest)
    else:
        too_large = abs(param) > largest
    if too_large:
        raise ValueError(f"{name} must be at most {largest:.4g} (the largest {dtype}, in which the kernels take it "
                         f"for {query_dtype} inputs)")


def head_param_vector(param, H: int, query: torch.Tensor, chosen: str) -> torch.Tensor:
    """α / λ as the kernels take it, one value per head (H,): from a float, or a
    tensor broadcastable to (H, 1, 1) (leading unit batch dims allowed)."""
    dtype = head_param_dtype(query.dtype, chosen)
    if not isinstance(param, torch.Tensor):
        return torch.full((H,), param, dtype=dtype, device=query.device)
    p = param.reshape(param.shape[-3:]) if param.dim() > 3 else param
    return p.to(dtype).expand(H, 1, 1).reshape(H)


def _fold_for_bounds(bounds, q4, k4, v4, alpha_h, key_lengths, head_param, normalizer):
    """The kernels' arguments for a BlockMask's row bounds (Bm, Hm, L, 2),
    which the kernels take per batch element: (q4, k4, v4, alpha_h,
    key_lengths, row_bounds). A mask that differs across heads folds the
    heads into the batch, (B, H) -> (B·H, 1), key and value heads repeated
    for grouped queries; the dropout counters, (b·H + h)·L + i, stay put."""
    B, H, L = q4.shape[0], q4.shape[1], q4.shape[2]
    if bounds.shape[1] == 1:
        if bounds.shape[0] not in (1, B):  # (B = 1: α per (batch, head) folded the batch into the heads)
            name = "lam" if takes_lam(normalizer) else "alpha"
            raise ValueError(f"a BlockMask that differs across the batch with an {name} that differs across the "
                             f"batch is not supported: give {name} one value per head")
        return (q4, k4, v4, alpha_h, key_lengths,
                bounds[:, 0].to(device=q4.device, dtype=torch.int64).expand(B, L, 2).contiguous())
    if isinstance(head_param, torch.Tensor):
        name = "lam" if takes_lam(normalizer) else "alpha"
        raise ValueError(f"a BlockMask that differs across heads folds the heads into the batch, which takes one "
                         f"{name} for all heads: give {name} as a float, or a BlockMask with H = 1")
    group = H // k4.shape[1]

    def fold(t):
        t = t.repeat_interleave(group, dim=1) if group > 1 else t
        return t.reshape(B * H, 1, *t.shape[2:])

    if key_lengths is not None:
        key_lengths = key_lengths.repeat_interleave(H)
    row_bounds = bounds.to(device=q4.device, dtype=torch.int64).expand(B, H, L, 2).reshape(B * H, L, 2)
    return (q4.reshape(B * H, 1, L, q4.shape[3]), fold(k4), fold(v4),
            None if alpha_h is None else alpha_h[:1], key_lengths, row_bounds)


def _nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, normalizer, alpha, backend,
            return_weights, window, cache_seqlens, lam):
    """Nested tensors with the jagged layout, (B, H, j, E) as SDPA takes them:
    attnkern.attention_varlen on their values and offsets, the result nested
    the same way."""
    from attnkern.varlen import attention_varlen

    for name, t in (("query", query), ("key", key), ("value", value)):
        if not (t.is_nested and t.layout == torch.jagged and t.dim() == 4 and t._ragged_idx == 2):
            raise ValueError(f"with nested tensors, query, key and value must all be jagged nested tensors "
                             f"(B, heads, j, dim) (ragged sequence dim); {name} is not")
    if attn_mask is not None or cache_seqlens is not None or return_weights:
        raise ValueError("with nested tensors, attn_mask, cache_seqlens and return_weights are not supported: "
                         "the documents' lengths already say which keys each query sees")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, j, heads, dim)
    if not torch.equal(k.offsets(), v.offsets()):
        raise ValueError("with nested tensors, key and value must have the same lengths")
    if is_causal and not torch.equal(q.offsets(), k.offsets()):
        raise ValueError("with nested tensors, is_causal needs queries and keys of the same lengths (SDPA's "
                         "top-left alignment); for bottom-right causality within each sequence use "
                         "attention_varlen(is_causal=True) or window=(-1, 0)")
    out = attention_varlen(q.values(), k.values(), v.values(), q.offsets(), k.offsets(),
                           is_causal=is_causal, window=window, scale=scale, normalizer=normalizer, alpha=alpha,
                           dropout_p=dropout_p, enable_gqa=enable_gqa, backend=backend, lam=lam)
    return torch.nested.nested_tensor_from_jagged(out, q.offsets()).transpose(1, 2)


def _unpad(res, added: int):
    """Drops the leading unit dims added to 2-d inputs."""
    if added == 0:
        return res
    if isinstance(res, tuple):
        return tuple(r.reshape(r.shape[added:]) for r in res)
    return res.reshape(res.shape[added:])


def _unfused(q, k, v, attn_mask, is_causal, scale, normalizer, param, backend, dropout_p: float):
    """Materialized weights through the row-wise normalizers (return_weights=True,
    and fusedmax on CUDA tensors; param: α of α-entmax, λ of fusedmax and
    oscarmax, else None):
    the reference's scores, in the accumulation dtype (float32 but for float64).
    With dropout_p > 0 the weights are dropped out (torch's generator) before
    p·v and returned so, as torch's MultiheadAttention returns them."""
    acc = acc_dtype(q.dtype)
    k, v = reference.expand_kv_heads(q, k.to(acc), v.to(acc))
    s = reference.attention_scores(q.to(acc), k, attn_mask, is_causal, scale)
    if takes_alpha(normalizer):
        a = param.to(acc) if isinstance(param, torch.Tensor) else param
        p = ops.entmax(s, a, -1, backend=backend)
    elif takes_lam(normalizer):
        lam = param.to(acc) if isinstance(param, torch.Tensor) else param
        p = getattr(ops, normalizer)(s, -1, lam, backend=backend)
    else:
        p = getattr(ops, normalizer)(s, -1, backend=backend)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    out = p @ v
    return out.to(q.dtype), p.to(q.dtype)
