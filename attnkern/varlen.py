"""Attention over packed variable-length sequences: many documents of
different lengths in one (total_tokens, heads, dim) tensor, as
FlashAttention's flash_attn_varlen_func and torch.nn.attention.varlen's
varlen_attn take them, with every normalizer.

Each document is attended to on its own (its tiles start at its first
token), so a packed call gives, bitwise, what separate calls on the
documents give, and its cost is that of the documents' own squares, not of
a padded batch.

The kernel backends run as one pair of ops, attnkern::attention_varlen_fwd
and _bwd, which read the cumulative lengths inside: torch.compile sees one
op with a static output shape, so a packed call compiles with
fullgraph=True although the document lengths are data.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from attnkern import _extension, ops, validation
from attnkern.attention import _check_window, _intersect_windows, attention, draw_dropout_seed, head_param_vector
from attnkern.backends import registry
from attnkern.family import check_attention_normalizer, takes_lam

__all__ = ["attention_varlen"]


def _pick(name, value, alias_name, alias):
    """One argument under either of its names (ours or torch's varlen_attn's)."""
    if alias is not None and value is not None:
        raise TypeError(f"attention_varlen got both {name} and {alias_name}; they are the same argument")
    return value if value is not None else alias


def _check_lengths_tensor(cu, name):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be a 1-d integer tensor of cumulative lengths, got "
                        + (f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor)
                           else type(cu).__name__))
    if cu.numel() < 1:
        raise ValueError(f"{name} must hold at least one entry (0)")


def _lengths(cu, name, total):
    """The cumulative lengths cu (N + 1,) as a list, checked."""
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
    longest = max((b - a for a, b in zip(lengths, lengths[1:], strict=False)), default=0)
    if value < longest:
        raise ValueError(f"{name} = {value} is shorter than the longest document ({longest})")


class _Documents:
    """Where each document's queries and keys are. Built from the tensor
    arguments (their values are read here, so it runs inside the ops under
    torch.compile), with every check on those values.

    q_starts: N + 1 offsets into the packed queries. Keys, packed: k_starts
    (N + 1 offsets) and n_keys (the keys taking part, seqused_k or all);
    paged (block_table): pages[d] the pool pages of document d, in order, and
    n_keys[d] its valid keys."""

    def __init__(self, q, k, cu_q, cu_k, seqused_k, block_table, max_q=None, max_k=None):
        self.q_starts = _lengths(cu_q, "cu_seqlens_q", q.shape[0])
        N = len(self.q_starts) - 1
        used = None
        if seqused_k is not None:
            if (seqused_k.shape != (N,) or seqused_k.is_floating_point() or seqused_k.dtype == torch.bool):
                raise ValueError(f"seqused_k must be an integer tensor of shape ({N},) (one per document)")
            used = seqused_k.tolist()
            if any(n < 0 for n in used):
                raise ValueError(f"seqused_k must not be negative, got {used}")
        self.paged = block_table is not None
        if self.paged:
            if block_table.dim() != 2 or block_table.shape[0] != N or block_table.is_floating_point():
                raise ValueError(f"block_table must be an integer tensor (N = {N}, max_pages), got "
                                 f"{block_table.dtype} of shape {tuple(block_table.shape)}")
            self.page = k.shape[1]
            if any(n > block_table.shape[1] * self.page for n in used):
                raise ValueError(f"seqused_k {used} exceeds the block table's {block_table.shape[1]} pages of "
                                 f"{self.page}")
            table = block_table.to(torch.int64)
            self.pages = [table[d, :(n + self.page - 1) // self.page] for d, n in enumerate(used)]
            if any(bool(((p < 0) | (p >= k.shape[0])).any()) for p in self.pages):
                raise ValueError(f"block_table names pages outside the pool of {k.shape[0]}")
            self.n_keys = used
            k_starts = [0]
            for n in used:
                k_starts.append(k_starts[-1] + n)
        else:
            if cu_k is None:
                raise TypeError("attention_varlen needs cu_seqlens_k (or block_table with seqused_k)")
            k_starts = self.k_starts = _lengths(cu_k, "cu_seqlens_k", k.shape[0])
            if len(k_starts) != N + 1:
                raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
                                 f"got {N} and {len(k_starts) - 1}")
            spans = [b - a for a, b in zip(k_starts, k_starts[1:], strict=False)]
            if used is not None and any(n > s for n, s in zip(used, spans, strict=False)):
                raise ValueError("seqused_k must not exceed a document's keys (cu_seqlens_k)")
            self.n_keys = used if used is not None else spans
        _check_max(max_q, "max_seqlen_q", self.q_starts)
        _check_max(max_k, "max_seqlen_k", k_starts)

    def __len__(self):
        return len(self.q_starts) - 1

    def decoding_rows(self, most: int) -> int:
        """m when every document has the same m query rows, 1 <= m <= most
        (as the paged decoding op takes them); else 0."""
        if not len(self):
            return 0
        m = self.q_starts[1]
        if not 1 <= m <= most or any(b - a != m for a, b in zip(self.q_starts, self.q_starts[1:],
                                                                          strict=False)):
            return 0
        return m

    def queries(self, t: Tensor, d: int) -> Tensor:
        """Document d's rows of a packed (T, H, dim) tensor as (1, H, len, dim)."""
        return t[self.q_starts[d]:self.q_starts[d + 1]].transpose(0, 1).unsqueeze(0)

    def keys(self, t: Tensor, d: int) -> Tensor:
        """Document d's keys (or values) as (1, Hk, n_keys, dim): a view of the
        packed tensor, or its pages gathered from the pool by one index_select
        straight into that layout (gathering the pages and then laying them
        out by head would copy them twice)."""
        n = self.n_keys[d]
        if self.paged:
            page, heads, dim = t.shape[1], t.shape[2], t.shape[3]
            slot = (self.pages[d].to(t.device)[:, None] * page
                    + torch.arange(page, device=t.device)).reshape(-1)[:n]
            rows = slot[None, :] * heads + torch.arange(heads, device=t.device)[:, None]  # (heads, n)
            return t.reshape(-1, dim).index_select(0, rows.reshape(-1)).view(1, heads, n, dim)
        return t[self.k_starts[d]:self.k_starts[d] + n].transpose(0, 1).unsqueeze(0)

    def add_key_grad(self, grad: Tensor, g: Tensor, d: int) -> None:
        """Adds document d's key (or value) gradient g (1, Hk, n, dim) into grad
        (packed, or the pool: pages may be shared, so they accumulate)."""
        n = self.n_keys[d]
        rows = g[0].transpose(0, 1)
        if self.paged:
            index = (self.pages[d][:, None] * self.page
                     + torch.arange(self.page, device=grad.device)).reshape(-1)[:n]
            grad.view(-1, *grad.shape[2:]).index_add_(0, index.to(grad.device), rows)
        else:
            a = self.k_starts[d]
            grad[a:a + n] += rows


def _decode_rows() -> int:
    """The most query rows a document of attnkern::attention_decode_paged may have."""
    from attnkern import _C

    return _C.DECODE_ROWS


def _attention_ops(impl: str):
    from attnkern.autograd import _attention_impl

    return _attention_impl(impl)


@torch.library.custom_op("attnkern::attention_varlen_fwd", mutates_args=())
def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor | None, seqused_k: Tensor | None,
                block_table: Tensor | None, alpha: Tensor | None, scale: float, normalizer: str, impl: str,
                dropout_p: float, seeds: Tensor | None, window_left: int, window_right: int,
                max_q: int | None, max_k: int | None) -> tuple[Tensor, Tensor]:
    """Packed attention: out (T, H, Ev) and each query row's shift (H, T)
    float32, one attention_fwd call per document (one
    attention_decode_paged call for all when they decode from a paged cache)."""
    docs = _Documents(q, k, cu_q, cu_k, seqused_k, block_table, max_q, max_k)
    T, H = q.shape[0], q.shape[1]
    paged_decoding = (docs.paged and impl == "ops" and q.device.type == "cpu" and normalizer == "softmax"
                      and dropout_p == 0 and k.stride(-1) == 1 and v.stride(-1) == 1)
    rows = docs.decoding_rows(_decode_rows()) if paged_decoding else 0
    if rows:
        # Decoding from a paged cache: one call for every document, which
        # reads the keys and values in their pages (gathering each document's
        # keys into a new tensor would copy the cache on every call).
        N = len(docs)
        out, shift = torch.ops.attnkern.attention_decode_paged(
            q.reshape(N, rows, H, q.shape[2]).transpose(1, 2), k, v, block_table.to(torch.int64),
            seqused_k.to(torch.int64), scale, window_left, window_right)
        return out.transpose(1, 2).reshape(T, H, v.shape[-1]), shift.permute(1, 0, 2).reshape(H, T)
    fwd, _ = _attention_ops(impl)
    # (Every query row belongs to one document, so every row is written.)
    out = q.new_empty((T, H, v.shape[-1]))
    shift = torch.empty((H, T), dtype=torch.float32, device=q.device)
    for d in range(len(docs)):
        a, b = docs.q_starts[d], docs.q_starts[d + 1]
        if a == b:
            continue
        o, s = fwd(docs.queries(q, d), docs.keys(k, d), docs.keys(v, d), None, False, scale, normalizer, alpha,
                   dropout_p, None if seeds is None else seeds[d], window_left, window_right, None)
        out[a:b] = o[0].transpose(0, 1)
        shift[:, a:b] = s[0]
    return out, shift


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_q, cu_k, seqused_k, block_table, alpha, scale, normalizer, impl, dropout_p, seeds,
                     window_left, window_right, max_q, max_k):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[-1])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _alpha_grad_dtype(alpha):
    return torch.float64 if alpha is not None and alpha.dtype == torch.float64 else torch.float32


@torch.library.custom_op("attnkern::attention_varlen_bwd", mutates_args=())
def _varlen_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, shift: Tensor, cu_q: Tensor,
                cu_k: Tensor | None, seqused_k: Tensor | None, block_table: Tensor | None,
                alpha: Tensor | None, alpha_grad: bool, scale: float, normalizer: str, impl: str,
                dropout_p: float, seeds: Tensor | None, window_left: int,
                window_right: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped as q, k, v: packed, or the page pools) and dα (H,)
    (empty without alpha_grad), one attention_bwd call per document."""
    docs = _Documents(q, k, cu_q, cu_k, seqused_k, block_table)
    _, bwd = _attention_ops(impl)
    # (dk, dv accumulate, and keys no query sees keep gradient 0; dq's rows are all written.)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dalpha = torch.zeros((q.shape[1],) if alpha_grad else (0,), dtype=_alpha_grad_dtype(alpha), device=q.device)
    for d in range(len(docs)):
        a, b = docs.q_starts[d], docs.q_starts[d + 1]
        if a == b:
            continue
        gq, gk, gv, ga = bwd(docs.queries(grad_out, d), docs.queries(q, d), docs.keys(k, d), docs.keys(v, d), None,
                             False, scale, normalizer, alpha, docs.queries(out, d).contiguous(),
                             shift[:, a:b].unsqueeze(0).contiguous(), alpha_grad, dropout_p,
                             None if seeds is None else seeds[d], window_left, window_right, None)
        dq[a:b] = gq[0].transpose(0, 1)
        docs.add_key_grad(dk, gk, d)
        docs.add_key_grad(dv, gv, d)
        if alpha_grad:
            dalpha += ga
    return dq, dk, dv, dalpha


@_varlen_bwd.register_fake
def _varlen_bwd_fake(grad_out, q, k, v, out, shift, cu_q, cu_k, seqused_k, block_table, alpha, alpha_grad, scale,
                     normalizer, impl, dropout_p, seeds, window_left, window_right):
    dalpha = q.new_empty((q.shape[1],) if alpha_grad else (0,), dtype=_alpha_grad_dtype(alpha))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dalpha


def _varlen_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, block_table, alpha, scale, normalizer, impl, dropout_p, seeds,
     window_left, window_right, _, _) = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k, seqused_k, block_table, alpha, seeds)
    ctx.settings = (scale, normalizer, impl, dropout_p, window_left, window_right)


def _varlen_backward(ctx, grad_out, _grad_shift):
    q, k, v, out, shift, cu_q, cu_k, seqused_k, block_table, alpha, seeds = ctx.saved_tensors
    scale, normalizer, impl, dropout_p, window_left, window_right = ctx.settings
    want_alpha = alpha is not None and ctx.needs_input_grad[7]
    dq, dk, dv, dalpha = _varlen_bwd(grad_out, q, k, v, out, shift, cu_q, cu_k, seqused_k, block_table, alpha,
                                     want_alpha, scale, normalizer, impl, dropout_p, seeds, window_left,
                                     window_right)
    return (dq, dk, dv, None, None, None, None, dalpha if want_alpha else None) + (None,) * 9


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def _fused(query, key, value, cu_q, cu_k, seqused_k, block_table, max_q, max_k, window, scale, normalizer, alpha,
           dropout_p, chosen):
    """The kernel backends: one attention_varlen_fwd op for all documents."""
    H = query.shape[1]
    if not ops._compiling():
        alpha = validation.check_attention_alpha(alpha, normalizer, (H, 1, 1), H, query.device)
    elif isinstance(alpha, torch.Tensor):
        alpha = validation.head_alpha_view(alpha, H)
    alpha_h = None if alpha is None else head_param_vector(alpha, H, query, chosen)
    seeds = torch.stack([draw_dropout_seed() for _ in range(cu_q.shape[0] - 1)]) if dropout_p > 0 else None
    left, right = window if window is not None else (-1, -1)
    out, _ = _varlen_fwd(query, key, value, cu_q, cu_k, seqused_k, block_table, alpha_h, scale, normalizer,
                         "triton" if chosen == "triton" else "ops", dropout_p, seeds, left, right, max_q, max_k)
    return out


def _per_document(query, key, value, docs, window, scale, normalizer, alpha, lam, dropout_p, enable_gqa, chosen):
    """The reference backend and the calls the kernels do not take as they are
    (no heads, head dim 0, query heads expanded to the key heads, λ): one
    attnkern.attention call per document."""
    H = query.shape[1]
    outs = []
    for d in range(len(docs)):
        q_d, k_d, v_d = docs.queries(query, d), docs.keys(key, d), docs.keys(value, d)
        if q_d.shape[2] == 0:
            outs.append(query.new_empty((0, H, value.shape[-1])))
            continue
        # (With dropout, each document's call draws its own seed from torch's
        # generator: independent masks, reproduced by torch.manual_seed.)
        o = attention(q_d, k_d, v_d, None, dropout_p, False, scale, enable_gqa, normalizer=normalizer,
                      alpha=alpha, lam=lam, backend=chosen, window=window)
        outs.append(o.squeeze(0).transpose(0, 1))
    if not outs:
        return query.new_empty((0, H, value.shape[-1]))
    return torch.cat(outs)


def attention_varlen(query, key, value, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, *, is_causal: bool = False, window=None, scale=None,
                     normalizer: str = "softmax", alpha=None, lam=None, dropout_p: float = 0.0,
                     enable_gqa: bool = False, backend: str = "auto", return_weights: bool = False, seqused_k=None,
                     block_table=None,
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
    within each document. scale, normalizer, alpha, lam, dropout_p,
    enable_gqa, backend: as attnkern.attention's (alpha, lam: a float or one
    value per head; lam for fusedmax and oscarmax, whose neighbours are the
    keys of the same document).
    seqused_k (N,): only the first seqused_k[d] keys of document d take part.
    block_table (N, pages) int: key and value are a pool of pages (pages,
    page_size, Hk, d) and document d's keys are its pages in order, the first
    seqused_k[d] of them valid (needs seqused_k; cu_seqlens_k may be None).
    Each document's pages are gathered into one copy before its attention
    (pages shared between documents get the sum of their gradients).
    Also accepted under the names of torch.nn.attention.varlen.varlen_attn:
    cu_seq_q, cu_seq_k, max_q, max_k, window_size; num_splits is accepted
    and has no effect (the results never depend on a split).
    Returns out (Tq, H, Ev) in query's dtype. Documents of length 0 are
    allowed; a query whose document has no keys gets zeros.
    With the kernel backends the call is one op whose output shape does not
    depend on the lengths' values, so torch.compile(fullgraph=True) takes it.
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
    for name, value_ in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value_ is not None and (isinstance(value_, bool) or not isinstance(value_, numbers.Integral)):
            raise TypeError(f"{name} must be an int, got {value_!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        validation.check_tensor(t, name)
    if query.dim() != 3:
        raise ValueError(f"query must be (total_tokens, heads, dim), got shape {tuple(query.shape)}")
    if cu_q is None:
        raise TypeError("attention_varlen needs cu_seqlens_q")
    _check_lengths_tensor(cu_q, "cu_seqlens_q")
    if cu_k is not None:
        _check_lengths_tensor(cu_k, "cu_seqlens_k")
    if seqused_k is not None and not isinstance(seqused_k, torch.Tensor):
        raise ValueError(f"seqused_k must be an integer tensor of shape ({cu_q.shape[0] - 1},) (one per document)")
    if block_table is not None:
        if seqused_k is None:
            raise ValueError("block_table needs seqused_k (the valid keys of each document)")
        if key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"with block_table, key and value are page pools (pages, page_size, heads, dim), "
                             f"got shapes {tuple(key.shape)} and {tuple(value.shape)}")
    elif key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"key and value must be (total_tokens, heads, dim), got shapes {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    elif cu_k is None:
        raise TypeError("attention_varlen needs cu_seqlens_k (or block_table with seqused_k)")
    check_attention_normalizer(normalizer)
    if is_causal:
        window = _intersect_windows(window, (-1, 0))

    H, Hk, E = query.shape[1], key.shape[-2], query.shape[2]
    if not ops._compiling():
        validation.check_attention_lam(lam, normalizer, (H, 1, 1), H, query.device)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    dropout_p = float(dropout_p)
    chosen = registry.choose(backend, query, "attention")
    heads_native = H == Hk or (Hk > 0 and H % Hk == 0 and (enable_gqa or Hk == 1))
    if (chosen != "reference" and _extension.LOADED and H > 0 and E > 0 and heads_native
            and not takes_lam(normalizer) and dropout_p < 1):
        return _fused(query, key, value, cu_q, cu_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k, window,
                      float(scale), normalizer, alpha, dropout_p, chosen)
    docs = _Documents(query, key, cu_q, cu_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
    return _per_document(query, key, value, docs, window, scale, normalizer, alpha, lam, dropout_p, enable_gqa,
                         chosen)
