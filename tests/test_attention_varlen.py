"""Packed documents (attnkern.attention_varlen, FlashAttention's and
torch's varlen arguments), nested jagged tensors and paged key caches,
against per-document calls and the float64 reference."""

from __future__ import annotations

import pytest
import torch
from helpers import alpha_for, assert_close_tol, ref_attention

import attnkern
from attnkern.backends import reference
from attnkern.testing import tolerance

CASES = [("softmax", None), ("sparsemax", None), ("entmax15", None), ("entmax", (1.25, 2.0, 1.5, 1.0))]
CASE_IDS = ["softmax", "sparsemax", "entmax15", "entmax-per-head"]


def _packed(lengths_q, lengths_k, H, Hk, E, Ev, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32)
    return rnd(tq, H, E), rnd(tk, Hk, E), rnd(tk, Hk, Ev), cu_q, cu_k


def _per_document(q, k, v, cu_q, cu_k, fn):
    outs = []
    for d in range(len(cu_q) - 1):
        qd = q[cu_q[d]:cu_q[d + 1]].transpose(0, 1).unsqueeze(0)
        kd = k[cu_k[d]:cu_k[d + 1]].transpose(0, 1).unsqueeze(0)
        vd = v[cu_k[d]:cu_k[d + 1]].transpose(0, 1).unsqueeze(0)
        outs.append(fn(qd, kd, vd).squeeze(0).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
def test_varlen_matches_reference(normalizer, alpha, causal):
    """Documents of length 1, 0 (empty) and with more queries than keys;
    causal aligned to each document's bottom-right corner."""
    lq, lk = [1, 37, 0, 70, 5], [1, 50, 3, 70, 0]
    H, Hk, E, Ev = 4, 2, 24, 16
    q, k, v, cu_q, cu_k = _packed(lq, lk, H, Hk, E, Ev)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    a = alpha_for(normalizer, H, alpha, requires_grad=True, dtype=torch.float64) if alpha else None
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), is_causal=causal,
                                    normalizer=normalizer, alpha=a, enable_gqa=True)

    def ref(qd, kd, vd):
        band = reference.band_mask(qd.shape[2], kd.shape[2], window=(-1, 0) if causal else None)
        return ref_attention(qd, kd, vd, band, False, normalizer, a)

    want = _per_document(q, k, v, cu_q, cu_k, ref)
    assert out.shape == (sum(lq), H, Ev)
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    go = torch.randn_like(out)
    inputs = [q, k, v] + ([a] if a is not None else [])
    got, exp = torch.autograd.grad(out, inputs, go), torch.autograd.grad(want, inputs, go)
    for name, g, w in zip(("dq", "dk", "dv", "dalpha")[:len(got)], got, exp, strict=True):
        assert_close_tol(g, w, tolerance(torch.float64, "attention", "gradient", scale=4.0), name)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15"])
def test_packed_equals_per_document_calls_bitwise(normalizer):
    """One thread, no dropout: each document's tiles start at its first token,
    so the packed call is the per-document calls, bit for bit."""
    lq = [64, 200, 1, 513, 90]
    q, k, v, cu_q, cu_k = _packed(lq, lq, 4, 4, 64, 64, dtype=torch.float32, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, 513, 513, is_causal=True, window=(100, 0),
                                        normalizer=normalizer)
        want = _per_document(q, k, v, cu_q, cu_k, lambda qd, kd, vd: attnkern.attention(
            qd, kd, vd, normalizer=normalizer, window=(100, 0)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, want)


def test_torch_varlen_argument_names():
    """torch.nn.attention.varlen.varlen_attn's names and meanings."""
    lq = [5, 9, 3]
    q, k, v, cu_q, cu_k = _packed(lq, lq, 2, 2, 8, 8, dtype=torch.float32)
    ours = attnkern.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, window=(-1, 0))
    theirs = attnkern.attention_varlen(q, k, v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=9, max_k=9,
                                       window_size=(-1, 0), num_splits=1)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, attnkern.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, is_causal=True))
    with pytest.raises(TypeError, match="both cu_seqlens_q and cu_seq_q"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, cu_seq_q=cu_q)


def test_seqused_k_and_paged_cache():
    """seqused_k keeps the first keys of each document; a paged cache
    (block_table over a pool of pages) gives what the packed keys give."""
    H, E, page = 2, 16, 4
    lk = [11, 6, 16]
    used = torch.tensor([9, 6, 13])
    q, k, v, cu_q, cu_k = _packed([1, 1, 1], lk, H, H, E, E, dtype=torch.float32, seed=5)
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, 1, 16, seqused_k=used, normalizer="sparsemax")
    for d in range(3):
        a, n = int(cu_k[d]), int(used[d])
        alone = attnkern.attention(q[d:d + 1].transpose(0, 1).unsqueeze(0), k[a:a + n].transpose(0, 1).unsqueeze(0),
                                   v[a:a + n].transpose(0, 1).unsqueeze(0), normalizer="sparsemax")
        torch.testing.assert_close(out[d], alone[0, :, 0], atol=0, rtol=0)
    # A pool of pages in shuffled order and the block table that finds them.
    pages_per_doc = [(n + page - 1) // page for n in lk]
    pool_k = torch.zeros(sum(pages_per_doc) + 2, page, H, E)
    pool_v = torch.zeros_like(pool_k)
    order = torch.randperm(pool_k.shape[0], generator=torch.Generator().manual_seed(0))
    table = torch.zeros(3, max(pages_per_doc), dtype=torch.int32)
    slot = 0
    for d in range(len(lk)):
        for p in range(pages_per_doc[d]):
            rows = slice(int(cu_k[d]) + p * page, min(int(cu_k[d]) + (p + 1) * page, int(cu_k[d + 1])))
            dst = int(order[slot])
            pool_k[dst, :rows.stop - rows.start] = k[rows]
            pool_v[dst, :rows.stop - rows.start] = v[rows]
            table[d, p] = dst
            slot += 1
    paged = attnkern.attention_varlen(q, pool_k, pool_v, cu_q, None, 1, 16, seqused_k=used, block_table=table,
                                      normalizer="sparsemax")
    torch.testing.assert_close(paged, out, atol=0, rtol=0)


def test_nested_tensors_equal_varlen():
    lq = [7, 30, 12]
    H, E = 2, 16
    q, k, v, cu_q, cu_k = _packed(lq, lq, H, H, E, E, dtype=torch.float32, seed=9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def nest(t):
        return torch.nested.nested_tensor_from_jagged(t, cu_q.to(torch.int64)).transpose(1, 2)

    out = attnkern.attention(nest(q), nest(k), nest(v), is_causal=True, normalizer="entmax15")
    assert out.is_nested
    flat = out.transpose(1, 2).values()
    want = attnkern.attention_varlen(q, k, v, cu_q, cu_k, 30, 30, is_causal=True, normalizer="entmax15")
    torch.testing.assert_close(flat, want, atol=0, rtol=0)
    g1 = torch.autograd.grad(flat.sum(), (q, k, v))
    g2 = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bad_varlen_arguments_are_named():
    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 2, 2, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        attnkern.attention_varlen(q, k, v, cu_q + 1, cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k must not decrease"):
        attnkern.attention_varlen(q, k, v, cu_q, torch.tensor([0, 5, 4, 7]))
    with pytest.raises(ValueError, match="must end at the total number of tokens"):
        attnkern.attention_varlen(q, k, v, cu_q, torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="same number of documents"):
        attnkern.attention_varlen(q, k, v, cu_q, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="max_seqlen_q = 2 is shorter"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, 2, 4)
    with pytest.raises(ValueError, match="return_weights is not supported"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, return_weights=True)
    with pytest.raises(ValueError, match="window sides"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, window=(0, -3))
    with pytest.raises(ValueError, match="block_table needs seqused_k"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k must not exceed"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=torch.tensor([3, 5]))
