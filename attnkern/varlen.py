"""Attention over packed variable-length sequences: many documents of
different lengths in one (total_tokens, heads, dim) tensor, as
FlashAttention's flash_attn_varlen_func and torch.nn.attention.varlen's
varlen_attn take them, with every normalizer.

Each document is attended to on its own (its tiles start at its first
token), so a packed call gives, bitwise, what separate calls on the
documents give, and its cost is that of the documents' own squares, not of
a padded batch.
"""

from __future__ import annotations

import math
import numbers

import torch

from attnkern import validation
from attnkern.attention import _check_window, _intersect_windows, attention
from attnkern.backends import registry
from attnkern.family import Family

__all__ = ["attention_varlen"]

def _pick(name, value, alias_name, alias):
    """One argument under either of its names (ours or torch's varlen_attn's)."""
    if alias is not None and value is not None:
        raise TypeError(f"attention_varlen got both {name} and {alias_name}; they are the same argument")
    return value if value is not None else alias


def _lengths(cu, name, total):
    """The document lengths from cumulative lengths cu (N + 1,), checked."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be a 1-d integer tensor of cumulative lengths, got "
                        + (f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor)
                           else type(cu).__name__))
    if cu.numel() < 1:
        raise ValueError(f"{name} must hold at least one entry (0)")
    c = cu.tolist()
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {c[0]}")
    if any(b < a for a, b in zip(c, c[1:], strict=False)):
        raise ValueError(f"{name} must not decrease, got {c}")
    if c[-1] != total:
        raise ValueError(f"{name} must end at the total number of tokens ({total}), got {c[-1]}")
    return c


def _check_max(value, name, lengths):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    longest = max((b - a for a, b in zip(lengths, lengths[1:], strict=False)), default=0)
    if value < longest:
        raise ValueError(f"{name} = {value} is shorter than the longest document ({longest})")


def _paged_keys(pool, block_table, used):
    """The documents' keys gathered from a paged cache: pool (pages, page_size,
    Hk, d), block_table (N, max_pages) int, used (N,): packed (Σ used, Hk, d)."""
    page = pool.shape[1]
    parts = []
    for d, n in enumerate(used):
        pages = block_table[d, :(n + page - 1) // page].to(torch.int64)
        parts.append(pool[pages].reshape(-1, *pool.shape[2:])[:n])
    return torch.cat(parts) if parts else pool.new_empty((0,) + tuple(pool.shape[2:]))


def attention_varlen(query, key, value, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, *, is_causal: bool = False, window=None, scale=None,
                     normalizer: str = "softmax", alpha=None, dropout_p: float = 0.0, enable_gqa: bool = False,
                     backend: str = "auto", return_weights: bool = False, seqused_k=None, block_table=None,
                     num_splits=None, cu_seq_q=None, cu_seq_k=None, max_q=None, max_k=None, window_size=None):
    """Attention within each of N packed documents.

    query (Tq, H, E), key and value (Tk, Hk, E) / (Tk, Hk, Ev): the documents'
    tokens one after another; document d holds queries
    cu_seqlens_q[d]:cu_seqlens_q[d+1] and keys cu_seqlens_k[d]:cu_seqlens_k[d+1]
    (int tensors of N + 1 entries from 0, FlashAttention's meaning).
    max_seqlen_q / _k: the longest document (checked, else unused).
    is_causal: causal within each document, aligned to its bottom-right corner
    when its query and key lengths differ (FlashAttention's convention; the
    same as window (-1, 0)). window: (left, right) as attnkern.attention's,
    within each document. scale, normalizer, alpha, dropout_p, enable_gqa,
    backend: as attnkern.attention's (alpha: a float or one value per head).
    seqused_k (N,): only the first seqused_k[d] keys of document d take part.
    block_table (N, pages) int: key and value are a pool of pages (pages,
    page_size, Hk, d) and document d's keys are its pages in order, the first
    seqused_k[d] of them valid (needs seqused_k; cu_seqlens_k may be None).
    The pages are gathered into one packed copy before the attention.
    Also accepted under the names of torch.nn.attention.varlen.varlen_attn:
    cu_seq_q, cu_seq_k, max_q, max_k, window_size; num_splits is accepted
    and has no effect (the results never depend on a split).
    Returns out (Tq, H, Ev) in query's dtype. Documents of length 0 are
    allowed; a query whose document has no keys gets zeros.
    """
    cu_q = _pick("cu_seqlens_q", cu_seqlens_q, "cu_seq_q", cu_seq_q)
    cu_k = _pick("cu_seqlens_k", cu_seqlens_k, "cu_seq_k", cu_seq_k)
    max_seqlen_q = _pick("max_seqlen_q", max_seqlen_q, "max_q", max_q)
    max_seqlen_k = _pick("max_seqlen_k", max_seqlen_k, "max_k", max_k)
    window = _check_window(_pick("window", window, "window_size", window_size))
    if return_weights:
        raise ValueError("attention_varlen: return_weights is not supported (the documents' weights have no "
                         "common shape); call attnkern.attention per document for them")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)):
        raise TypeError(f"num_splits must be None or an int, got {num_splits!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        validation.check_tensor(t, name)
    if query.dim() != 3:
        raise ValueError(f"query must be (total_tokens, heads, dim), got shape {tuple(query.shape)}")
    if cu_q is None:
        raise TypeError("attention_varlen needs cu_seqlens_q")
    if block_table is not None:
        if seqused_k is None:
            raise ValueError("block_table needs seqused_k (the valid keys of each document)")
        if key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"with block_table, key and value are page pools (pages, page_size, heads, dim), "
                             f"got shapes {tuple(key.shape)} and {tuple(value.shape)}")
    elif key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"key and value must be (total_tokens, heads, dim), got shapes {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    lq = _lengths(cu_q, "cu_seqlens_q", query.shape[0])
    N = len(lq) - 1
    used = None
    if seqused_k is not None:
        if (not isinstance(seqused_k, torch.Tensor) or seqused_k.shape != (N,) or seqused_k.is_floating_point()
                or seqused_k.dtype == torch.bool):
            raise ValueError(f"seqused_k must be an integer tensor of shape ({N},) (one per document)")
        used = seqused_k.tolist()
        if any(n < 0 for n in used):
            raise ValueError(f"seqused_k must not be negative, got {used}")
    if block_table is not None:
        if block_table.dim() != 2 or block_table.shape[0] != N or block_table.is_floating_point():
            raise ValueError(f"block_table must be an integer tensor (N = {N}, max_pages), got "
                             f"{block_table.dtype} of shape {tuple(block_table.shape)}")
        page = key.shape[1]
        if any(n > block_table.shape[1] * page for n in used):
            raise ValueError(f"seqused_k {used} exceeds the block table's {block_table.shape[1]} pages of {page}")
        key, value = _paged_keys(key, block_table, used), _paged_keys(value, block_table, used)
        lk = [0]
        for n in used:
            lk.append(lk[-1] + n)
    else:
        if cu_k is None:
            raise TypeError("attention_varlen needs cu_seqlens_k (or block_table with seqused_k)")
        lk = _lengths(cu_k, "cu_seqlens_k", key.shape[0])
        if len(lk) != N + 1:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
                             f"{N} and {len(lk) - 1}")
        if used is not None and any(n > b - a for n, a, b in zip(used, lk, lk[1:], strict=False)):
            raise ValueError("seqused_k must not exceed a document's keys (cu_seqlens_k)")
    _check_max(max_seqlen_q, "max_seqlen_q", lq)
    _check_max(max_seqlen_k, "max_seqlen_k", lk)
    Family.of(normalizer)
    if is_causal:
        window = _intersect_windows(window, (-1, 0))

    H, E = query.shape[1], query.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    chosen = registry.choose(backend, query, "attention")
    # Document d: (1, heads, length, dim) views of its tokens.
    qs = torch.split(query, [b - a for a, b in zip(lq, lq[1:], strict=False)])
    ks = torch.split(key, [b - a for a, b in zip(lk, lk[1:], strict=False)])
    vs = torch.split(value, [b - a for a, b in zip(lk, lk[1:], strict=False)])
    outs = []
    for d in range(N):
        q_d, k_d, v_d = (t.transpose(0, 1).unsqueeze(0) for t in (qs[d], ks[d], vs[d]))
        if used is not None:
            k_d, v_d = k_d[:, :, :used[d]], v_d[:, :, :used[d]]
        if q_d.shape[2] == 0:
            outs.append(query.new_empty((0, H, value.shape[-1])))
            continue
        # (With dropout, each document's call draws its own seed from torch's
        # generator: independent masks, reproduced by torch.manual_seed.)
        o = attention(q_d, k_d, v_d, None, dropout_p, False, scale, enable_gqa, normalizer=normalizer,
                      alpha=alpha, backend=chosen, window=window)
        outs.append(o.squeeze(0).transpose(0, 1))
    if not outs:
        return query.new_empty((0, H, value.shape[-1]))
    return torch.cat(outs)

