"""FlexAttention's BlockMask as the CPU kernels' key bounds.

A BlockMask (torch.nn.attention.flex_attention.create_block_mask) lists, per
block of query rows, the key blocks that are fully allowed and those that
are partly allowed, with a mask_mod for the partial ones. The kernels take
one run of keys [lo, hi) per query row, computing only the tiles that run
reaches: so mask_mod is evaluated on the partial blocks alone, each row's
allowed keys are counted, and a row whose keys are not one run is refused
(such masks are given as a dense boolean attn_mask instead)."""

from __future__ import annotations

import torch

__all__ = ["is_block_mask", "row_bounds", "bounds_mask"]

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


def row_bounds(block_mask, L: int, S: int, check: bool = True):
    """(Bm, Hm, L, 2) int64: row i's allowed keys are [lo, hi) (lo = hi = 0
    when it has none). Raises ValueError when the mask's lengths disagree
    with L and S, or when some row's keys are not one run. check=False (under
    torch.compile) evaluates mask_mod on the whole grid, with static shapes,
    and turns the run check into an assertion in the graph."""
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
    if not check:
        count, lo, hi = _dense_row_stats(block_mask.mask_mod, full, partial, QB, KB, L, S)
        none = count == 0
        lo, hi = torch.where(none, 0, lo), torch.where(none, 0, hi)
        torch._assert_async(((hi - lo) == count).all(), "attn_mask: a BlockMask row whose allowed keys are not "
                            "one run")
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
    one_run = (hi - lo) == count
    if not bool(one_run.all()):
        i = int((~one_run).nonzero()[0, 0])
        b, h, row_i = i // (Hm * n_q * QB), (i // (n_q * QB)) % Hm, i % (n_q * QB)
        raise ValueError(f"attn_mask is a BlockMask whose row {row_i} (batch {b}, head {h}) allows "
                         f"{int(count[i])} keys that are not one run (from {int(lo[i])} to {int(hi[i])}): the "
                         f"kernels take one run of keys per row; give such a mask as a dense boolean attn_mask "
                         f"(torch.nn.attention.flex_attention.create_mask)")
    bounds = torch.stack([lo, hi], dim=-1).reshape(Bm, Hm, n_q * QB, 2)
    return bounds[:, :, :L]


def bounds_mask(bounds, S: int):
    """The dense (…, L, S) boolean mask of row bounds (…, L, 2)."""
    j = torch.arange(S, device=bounds.device)
    return (j >= bounds[..., :1]) & (j < bounds[..., 1:])
