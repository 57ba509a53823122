"""FlexAttention's BlockMask as the CPU kernels' key bounds.

A BlockMask (torch.nn.attention.flex_attention.create_block_mask) lists, per
block of query rows, the key blocks that are fully allowed and those that
are partly allowed, with a mask_mod for the partial ones. The kernels take
one run of keys [lo, hi) per query row, computing only the tiles that run
reaches: so mask_mod is evaluated on the partial blocks alone and each row's
allowed keys are counted. A mask with a row whose keys are not one run
(global tokens plus a local window, say) goes through attention_by_blocks:
each block of query rows against its own listed key blocks, gathered, with
the mask inside them as a dense boolean mask."""

from __future__ import annotations

import torch

__all__ = ["is_block_mask", "row_bounds", "bounds_mask", "attention_by_blocks"]

# Partial blocks evaluated per mask_mod call: bounds the (blocks, rows, keys)
# index tensors mask_mod builds to about 16 Mi entries.
_BLOCKS_PER_CALL = 1024


def is_block_mask(obj) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # (a torch without FlexAttention)
        return False
    return isinstance(obj, BlockMask)


def _listed(num, idx, n_kv: int):
    """(B, H, nQ, n_kv) bool: key block j is among the first num[b, h, q]
    entries of idx[b, h, q]."""
    cols = torch.arange(idx.shape[-1], device=idx.device)
    target = torch.where(cols < num[..., None].long(), idx.long(), n_kv)
    out = torch.zeros(idx.shape[:-1] + (n_kv + 1,), dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, target.clamp(0, n_kv), True)[..., :n_kv]


def _vmapped(mask_mod, *batched):
    """mask_mod(b, h, q, kv) over index tensors: vmapped over kv, then q, then
    each of `batched` in turn (tuples of which arguments carry that dim)."""
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    for args in batched:
        fn = torch.vmap(fn, in_dims=tuple(0 if i in args else None for i in range(4)))
    return fn


def _evaluate(mask_mod, blocks, QB: int, KB: int, L: int, S: int):
    """mask_mod on the partial blocks (P, 4: b, h, q block, kv block):
    (P, QB, KB) bool, False outside the sequences."""
    fn = _vmapped(mask_mod, (0, 1, 2, 3))  # (a partial block's batch, head, rows and keys)
    rows = blocks[:, 2:3] * QB + torch.arange(QB, device=blocks.device)
    keys = blocks[:, 3:4] * KB + torch.arange(KB, device=blocks.device)
    inside = (rows < L)[:, :, None] & (keys < S)[:, None, :]
    # (Indices past the ends are clamped before mask_mod sees them: it may
    # index tensors of the sequences' length.)
    allowed = fn(blocks[:, 0], blocks[:, 1], rows.clamp(max=L - 1), keys.clamp(max=S - 1))
    return allowed.to(torch.bool) & inside


def _dense_row_stats(mask_mod, full, partial, QB: int, KB: int, L: int, S: int):
    """(count, lo, hi) per row, (Bm, Hm, L) each, from mask_mod on the whole
    grid: the static-shape way (torch.compile), where picking out the
    partial blocks would give shapes that depend on data."""
    Bm, Hm = full.shape[:2]
    i, j = torch.arange(L, device=full.device), torch.arange(S, device=full.device)
    fn = _vmapped(mask_mod, (1,), (0,))  # (heads, then batch)
    mod = fn(torch.arange(Bm, device=full.device), torch.arange(Hm, device=full.device), i, j).to(torch.bool)
    qb, kb = i // QB, j // KB
    allowed = full[:, :, qb][:, :, :, kb] | (partial[:, :, qb][:, :, :, kb] & mod)
    count = allowed.sum(-1)
    lo = torch.where(allowed, j, S).amin(-1)
    hi = torch.where(allowed, j + 1, 0).amax(-1)
    return count, lo, hi


def _blocks(block_mask, L: int, S: int):
    """(QB, KB, n_q, n_kv, full, partial): the block sizes and counts, and
    which key blocks each block row lists as full and as partial, (Bm, Hm,
    n_q, n_kv) bool each. Raises ValueError when the mask's lengths disagree
    with L and S."""
    QB, KB = (int(b) for b in block_mask.BLOCK_SIZE)
    if tuple(int(n) for n in block_mask.seq_lengths) != (L, S):
        raise ValueError(f"attn_mask is a BlockMask for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, but "
                         f"the query has L = {L} and the keys S = {S}")
    n_q, n_kv = -(-L // QB), -(-S // KB)
    Bm, Hm, nq = block_mask.kv_num_blocks.shape
    if nq != n_q:
        raise ValueError(f"attn_mask is a BlockMask with {nq} query blocks of {QB}, but L = {L} needs {n_q}")
    device = block_mask.kv_num_blocks.device
    full = (_listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv)
            if block_mask.full_kv_num_blocks is not None
            else torch.zeros((Bm, Hm, n_q, n_kv), dtype=torch.bool, device=device))
    partial = _listed(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv) & ~full
    return QB, KB, n_q, n_kv, full, partial


def row_bounds(block_mask, L: int, S: int, check: bool = True):
    """(Bm, Hm, L, 2) int64: row i's allowed keys are [lo, hi) (lo = hi = 0
    when it has none), or None when some row's keys are not one run (then
    attention_by_blocks takes the mask). Raises ValueError when the mask's
    lengths disagree with L and S. check=False (under torch.compile)
    evaluates mask_mod on the whole grid, with static shapes, and turns the
    run check into an assertion in the graph (rows with gaps are refused
    there: their blocks' keys would give shapes that depend on data)."""
    QB, KB, n_q, n_kv, full, partial = _blocks(block_mask, L, S)
    Bm, Hm = full.shape[:2]
    device = full.device
    if not check:
        count, lo, hi = _dense_row_stats(block_mask.mask_mod, full, partial, QB, KB, L, S)
        none = count == 0
        lo, hi = torch.where(none, 0, lo), torch.where(none, 0, hi)
        torch._assert_async(((hi - lo) == count).all(), "attn_mask: under torch.compile, a BlockMask row whose "
                            "allowed keys are not one run is not supported (call it eagerly)")
        return torch.stack([lo, hi], dim=-1).to(torch.int64)

    # Full blocks: per block row, the first and last full key block and the keys they hold.
    widths = (torch.clamp(S - torch.arange(n_kv, device=device) * KB, max=KB)).long()
    count = (full.long() * widths).sum(-1)
    kv_ids = torch.arange(n_kv, device=device)
    big = n_kv * KB + 1
    lo = torch.where(full, kv_ids * KB, big).amin(-1)
    hi = torch.where(full, torch.clamp((kv_ids + 1) * KB, max=S), -1).amax(-1)
    # ... as rows: (Bm, Hm, n_q * QB)
    count, lo, hi = (t.repeat_interleave(QB, dim=-1) for t in (count, lo, hi))

    # Partial blocks: mask_mod per row, a chunk of blocks at a time.
    blocks = partial.nonzero()
    flat = (Bm * Hm * n_q * QB,)
    count, lo, hi = count.reshape(flat).clone(), lo.reshape(flat).clone(), hi.reshape(flat).clone()
    r = torch.arange(QB, device=device)
    for c0 in range(0, blocks.shape[0], _BLOCKS_PER_CALL):
        part = blocks[c0:c0 + _BLOCKS_PER_CALL]
        allowed = _evaluate(block_mask.mask_mod, part, QB, KB, L, S)
        n = allowed.sum(-1)
        # (Key offsets in a narrow type: these (blocks, rows, keys) tensors are the pass's traffic.)
        offsets = torch.arange(KB, device=device, dtype=torch.int16 if KB < 2**15 else torch.int32)
        first = torch.where(allowed, offsets, KB).amin(-1).long()
        last = torch.where(allowed, offsets, -1).amax(-1).long()
        k0 = part[:, 3:4] * KB
        row = (((part[:, 0] * Hm + part[:, 1]) * n_q + part[:, 2]) * QB)[:, None] + r
        has = n > 0
        count.index_add_(0, row.reshape(-1), n.reshape(-1))
        lo.scatter_reduce_(0, row.reshape(-1), torch.where(has, k0 + first, big).reshape(-1), "amin")
        hi.scatter_reduce_(0, row.reshape(-1), torch.where(has, k0 + last + 1, -1).reshape(-1), "amax")

    none = count == 0
    lo, hi = torch.where(none, 0, lo), torch.where(none, 0, hi)
    if not bool(((hi - lo) == count).all()):
        return None
    bounds = torch.stack([lo, hi], dim=-1).reshape(Bm, Hm, n_q * QB, 2)
    return bounds[:, :, :L]


def bounds_mask(bounds, S: int):
    """The dense (…, L, S) boolean mask of row bounds (…, L, 2)."""
    j = torch.arange(S, device=bounds.device)
    return (j >= bounds[..., :1]) & (j < bounds[..., 1:])


# Entries of mask_mod's index tensors per call in attention_by_blocks.
_ENTRIES_PER_CALL = 1 << 24


def attention_by_blocks(attention, query, key, value, block_mask, *, dropout_p, is_causal, scale, enable_gqa,
                        normalizer, alpha, lam, backend, return_weights, window, cache_seqlens):
    """attnkern.attention with a BlockMask some of whose rows allow keys with
    gaps. Each block of query rows attends to its listed key blocks (full or
    partial, for any head) gathered side by side, with a dense boolean mask
    of what its rows allow there (mask_mod on those blocks, and is_causal,
    window and cache_seqlens at the keys' true positions): work and memory in
    proportion to the listed blocks, as FlexAttention's. Key order is kept,
    so fusedmax's neighbours are the allowed keys, as with -inf entries.
    Block rows listing as many key blocks go in one call of `attention`;
    dropout is drawn in that gathered layout (its own seed per call)."""
    from attnkern.backends.reference import band_allows

    L, S = query.shape[-2], key.shape[-2]
    QB, KB, n_q, n_kv, full, partial = _blocks(block_mask, L, S)
    Bm, Hm = full.shape[:2]
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"with a BlockMask, query, key and value are (B, H, seq, dim) or (H, seq, dim), got "
                         f"shapes {tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
    B = max(query.shape[0], key.shape[0], value.shape[0])
    H, E, Ev = query.shape[1], query.shape[3], value.shape[3]
    if Bm not in (1, B) or Hm not in (1, H) or any(t.shape[0] not in (1, B) for t in (query, key, value)):
        raise ValueError(f"attn_mask is a BlockMask of (B, H) = {(Bm, Hm)}, which does not match the query's "
                         f"batch ({B},) and {H} heads (FlexAttention's (B, H, L, E) layout)")
    query, key, value = (t.expand(B, *t.shape[1:]) for t in (query, key, value))
    device = query.device
    full, partial = full.to(device), partial.to(device)
    listed = (full | partial).any(1).expand(B, n_q, n_kv)  # (any head's)
    counts = listed.sum(-1)
    key_len = (torch.full((B,), S, dtype=torch.int64, device=device) if cache_seqlens is None
               else cache_seqlens.to(device=device, dtype=torch.int64).reshape(-1).expand(B))

    def per_batch(param):  # a tensor α / λ with batch dims: the selected rows' batch elements
        if isinstance(param, torch.Tensor) and param.dim() > 3 and param.shape[0] != 1:
            return lambda b: param.expand(B, *param.shape[1:])[b]
        return lambda b: param
    alpha_of, lam_of = per_batch(alpha), per_batch(lam)

    Hk = key.shape[1]
    q_flat = torch.nn.functional.pad(query, (0, 0, 0, n_q * QB - L)).reshape(B * H * n_q, QB * E)
    k_flat, v_flat = key.reshape(B * Hk * S, E), value.reshape(B * Hk * S, Ev)
    heads_q, heads_k = torch.arange(H, device=device), torch.arange(Hk, device=device)
    out = query.new_zeros((B, n_q, H, QB, Ev))
    weights = query.new_zeros((B, n_q, H, QB, S + 1)) if return_weights else None
    block_rows = torch.arange(QB, device=device)
    block_keys = torch.arange(KB, device=device)
    fn = _vmapped(block_mask.mask_mod, (1,), (0, 2, 3))  # (heads, then each block row's batch, rows, keys)
    for c in sorted(set(counts.reshape(-1).tolist()) - {0}):
        b_sel, qb_sel = (counts == c).nonzero(as_tuple=True)
        n = b_sel.shape[0]
        kv = listed[b_sel, qb_sel].nonzero()[:, 1].reshape(n, c)  # (ascending)
        keys = (kv[:, :, None] * KB + block_keys).reshape(n, c * KB)
        rows = qb_sel[:, None] * QB + block_rows
        bm_b = b_sel if Bm > 1 else torch.zeros_like(b_sel)
        # Full and partial per head, key by key: (n, Hm, c·KB).
        full_k = full[bm_b, :, qb_sel].gather(-1, kv[:, None, :].expand(n, Hm, c)).repeat_interleave(KB, -1)
        part_k = partial[bm_b, :, qb_sel].gather(-1, kv[:, None, :].expand(n, Hm, c)).repeat_interleave(KB, -1)
        step = max(1, _ENTRIES_PER_CALL // (Hm * QB * c * KB))
        mod = torch.cat([fn(bm_b[a:a + step], torch.arange(Hm, device=device),
                            rows[a:a + step].clamp(max=L - 1), keys[a:a + step].clamp(max=S - 1)).to(torch.bool)
                         for a in range(0, n, step)])  # (n, Hm, QB, c·KB)
        inside = (rows < L)[:, :, None] & (keys < S)[:, None, :]  # (the last blocks' padding is not)
        allowed = (full_k[:, :, None, :] | (part_k[:, :, None, :] & mod)) & inside[:, None]
        if is_causal or window is not None or cache_seqlens is not None:
            allowed = allowed & band_allows(rows[:, :, None], keys[:, None, :], L, key_len[b_sel][:, None, None],
                                            is_causal=is_causal, window=window)[:, None]
        # Rows gathered by one index_select each, straight into the (n, heads, rows, dim) layout the
        # kernels take: (B·heads·seq, dim) rows at (b·heads + h)·seq + position.
        at = (((b_sel * H)[:, None] + heads_q) * n_q + qb_sel[:, None]).reshape(-1)
        q_c = q_flat.index_select(0, at).reshape(n, H, QB, E)
        at = (((b_sel * Hk)[:, None] + heads_k)[:, :, None] * S + keys.clamp(max=S - 1)[:, None, :]).reshape(-1)
        k_c = k_flat.index_select(0, at).reshape(n, Hk, c * KB, E)
        v_c = v_flat.index_select(0, at).reshape(n, Hk, c * KB, Ev)
        res = attention(q_c, k_c, v_c, allowed, dropout_p, False, scale, enable_gqa, normalizer=normalizer,
                        alpha=alpha_of(b_sel), lam=lam_of(b_sel), backend=backend, return_weights=return_weights)
        o_c, w_c = res if return_weights else (res, None)
        out = out.index_put((b_sel, qb_sel), o_c.to(out.dtype))
        if return_weights:
            # (Keys past S, padding of the last block, go to the extra column S.)
            where = torch.where(keys < S, keys, S)[:, None, None, :].expand(n, H, QB, c * KB)
            dense = w_c.new_zeros((n, H, QB, S + 1)).scatter(-1, where, w_c)
            weights = weights.index_put((b_sel, qb_sel), dense.to(weights.dtype))
    out = out.permute(0, 2, 1, 3, 4).reshape(B, H, n_q * QB, Ev)[:, :, :L]
    if return_weights:
        weights = weights.permute(0, 2, 1, 3, 4).reshape(B, H, n_q * QB, S + 1)[:, :, :L, :S]
        return (out[0], weights[0]) if squeeze else (out, weights)
    return out[0] if squeeze else out
