"""Packed documents (attnkern.attention_varlen, FlashAttention's and
torch's varlen arguments), nested jagged tensors and paged key caches,
against per-document calls and the float64 reference."""

from __future__ import annotations

import pytest
import torch
from helpers import alpha_for, assert_close_tol, assert_same_with_1_and_2_threads, ref_attention

import attnkern
from attnkern import _extension
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
    pool = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="block_table names pages outside the pool of 2"):
        attnkern.attention_varlen(q, pool, pool, cu_q, None, seqused_k=torch.tensor([3, 4]),
                                  block_table=torch.tensor([[0], [2]]))


def _shared_page_pool(k, v, cu_k, page):
    """k, v packed as a pool of pages whose first page is shared by every
    document (a common prompt prefix): pool, block table and key counts."""
    H, E = k.shape[1], k.shape[2]
    lk = (cu_k[1:] - cu_k[:-1]).tolist()
    prefix = k[:page], v[:page]
    pools_k, pools_v, rows = [prefix[0]], [prefix[1]], []
    for d, n in enumerate(lk):
        a = int(cu_k[d])
        mine = max(0, n - page)
        pad = (-mine) % page
        first = 1 + sum(len(r) - 1 for r in rows)  # page 0 is the shared one
        rows.append([0] + list(range(first, first + (mine + pad) // page)))
        pools_k.append(torch.cat([k[a + page:a + n], k.new_zeros(pad, H, E)]))
        pools_v.append(torch.cat([v[a + page:a + n], v.new_zeros(pad, H, v.shape[2])]))
    table = torch.zeros(len(lk), max(len(r) for r in rows), dtype=torch.int32)
    for d, r in enumerate(rows):
        table[d, :len(r)] = torch.tensor(r)
    pool_k = torch.cat(pools_k).reshape(-1, page, H, E)
    pool_v = torch.cat(pools_v).reshape(-1, page, H, v.shape[2])
    return pool_k, pool_v, table, torch.tensor(lk)


def test_paged_cache_with_a_shared_page_gradients():
    """Three documents read the same first page (a shared prefix): the pool's
    gradient at that page is the sum of the three documents' gradients."""
    page, H, E = 4, 2, 8
    lk = [6, 9, 4]
    q, k, v, cu_q, cu_k = _packed([2, 3, 1], lk, H, H, E, E, seed=11)
    for d in range(1, 3):  # every document starts with the first document's first page
        k[int(cu_k[d]):int(cu_k[d]) + page] = k[:page]
        v[int(cu_k[d]):int(cu_k[d]) + page] = v[:page]
    pool_k, pool_v, table, used = _shared_page_pool(k, v, cu_k, page)
    pool_k, pool_v, q = (t.requires_grad_() for t in (pool_k, pool_v, q))
    out = attnkern.attention_varlen(q, pool_k, pool_v, cu_q, None, seqused_k=used, block_table=table,
                                    normalizer="entmax15", is_causal=True)
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    want = attnkern.attention_varlen(q, kk, vv, cu_q, cu_k, normalizer="entmax15", is_causal=True,
                                     backend="reference")
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, pool_k, pool_v), go)
    exp = torch.autograd.grad(want, (q, kk, vv), go)
    assert_close_tol(got[0], exp[0], tolerance(torch.float64, "attention", "gradient"), "dq")
    for g_pool, g_packed, name in ((got[1], exp[1], "dk"), (got[2], exp[2], "dv")):
        shared = sum(g_packed[int(cu_k[d]):int(cu_k[d]) + page] for d in range(3))
        assert_close_tol(g_pool[0], shared, tolerance(torch.float64, "attention", "gradient"), name + " shared")
        # Document 1's own pages (it is the longest) hold its remaining keys' gradients.
        own = g_pool[table[1, 1:3].long()].reshape(-1, H, E)[:lk[1] - page]
        assert_close_tol(own, g_packed[int(cu_k[1]) + page:int(cu_k[2])],
                         tolerance(torch.float64, "attention", "gradient"), name + " own")


@pytest.mark.parametrize("normalizer,alpha", [("softmax", None), ("sparsemax", None),
                                              ("entmax", (1.25, 2.0, 1.5, 1.0))],
                         ids=["softmax", "sparsemax", "entmax-per-head"])
def test_varlen_compiles_fullgraph(normalizer, alpha):
    """One op whose output shape ignores the lengths' values: fullgraph
    compilation gives the eager values and gradients, also for α."""
    lq = [5, 0, 33, 1, 20]
    H, Hk, E = 4, 2, 16
    q, k, v, cu_q, cu_k = _packed(lq, [7, 2, 33, 0, 25], H, Hk, E, E, dtype=torch.float32, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    a = alpha_for(normalizer, H, alpha, requires_grad=True, dtype=torch.float32) if alpha else None
    used = torch.tensor([7, 2, 30, 0, 11])

    def f(q, k, v, a, cu_q, cu_k, used):
        return attnkern.attention_varlen(q, k, v, cu_q, cu_k, 33, 33, is_causal=True, window=(9, 0), alpha=a,
                                         normalizer=normalizer, enable_gqa=True, seqused_k=used)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    inputs = [q, k, v] + ([a] if a is not None else [])
    got, want = compiled(q, k, v, a, cu_q, cu_k, used), f(q, k, v, a, cu_q, cu_k, used)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    go = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, inputs, go), torch.autograd.grad(want, inputs, go), strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    # Other lengths with the same number of documents: no recompilation needed.
    torch._dynamo.config.error_on_recompile = True
    try:
        cu2 = torch.tensor([0, 10, 20, 40, 50, 59], dtype=torch.int32)
        torch.testing.assert_close(compiled(q, k, v, a, cu2, cu_k, used), f(q, k, v, a, cu2, cu_k, used),
                                   atol=0, rtol=0)
    finally:
        torch._dynamo.config.error_on_recompile = False


def test_varlen_ops_pass_opcheck():
    q, k, v, cu_q, cu_k = _packed([3, 0, 8], [4, 2, 8], 2, 1, 8, 4, dtype=torch.float32, seed=4)
    alpha = torch.tensor([1.5, 1.2])
    fwd_args = (q, k, v, cu_q, cu_k, torch.tensor([4, 1, 6]), None, alpha, 0.4, "entmax", "ops", 0.0, None,
                3, 0, None, None)
    torch.library.opcheck(torch.ops.attnkern.attention_varlen_fwd.default, fwd_args)
    out, shift = torch.ops.attnkern.attention_varlen_fwd(*fwd_args)
    bwd_args = (torch.randn_like(out), q, k, v, out, shift, cu_q, cu_k, torch.tensor([4, 1, 6]), None, alpha,
                True, 0.4, "entmax", "ops", 0.0, None, 3, 0)
    torch.library.opcheck(torch.ops.attnkern.attention_varlen_bwd.default, bwd_args)


def test_varlen_dropout_is_the_per_document_calls():
    """Each document draws its own seed from torch's generator, in order:
    under one manual seed, the packed call is the per-document calls."""
    lq = [6, 17, 9]
    q, k, v, cu_q, cu_k = _packed(lq, lq, 2, 2, 8, 8, dtype=torch.float32, seed=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(123)
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.3, normalizer="sparsemax")
    torch.manual_seed(123)
    want = _per_document(q, k, v, cu_q, cu_k, lambda qd, kd, vd: attnkern.attention(
        qd, kd, vd, dropout_p=0.3, normalizer="sparsemax"))
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert (out == 0).any() or not torch.equal(out, attnkern.attention_varlen(q, k, v, cu_q, cu_k,
                                                                             normalizer="sparsemax"))
    go = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go),
                    strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("normalizer", ["fusedmax", "oscarmax"])
def test_structured_normalizers_per_document(normalizer):
    """fusedmax and oscarmax with λ per head (learnable): each document's keys
    are its own row, so the packed call is the per-document calls; nested
    tensors take λ too."""
    lq = [9, 1, 30]
    H = 2
    q, k, v, cu_q, cu_k = _packed(lq, lq, H, H, 8, 8, seed=13)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lam = torch.tensor([0.05, 0.4], dtype=torch.float64, requires_grad=True)
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True, normalizer=normalizer, lam=lam)
    want = _per_document(q, k, v, cu_q, cu_k, lambda qd, kd, vd: attnkern.attention(
        qd, kd, vd, is_causal=True, normalizer=normalizer, lam=lam, backend="reference"))
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    go = torch.randn_like(out)
    for name, g, w in zip(("dq", "dk", "dv", "dlam"), torch.autograd.grad(out, (q, k, v, lam), go),
                          torch.autograd.grad(want, (q, k, v, lam), go), strict=True):
        assert_close_tol(g, w, tolerance(torch.float64, "attention", "gradient", scale=4.0), name)

    def nest(t):
        return torch.nested.nested_tensor_from_jagged(t, cu_q.to(torch.int64)).transpose(1, 2)

    nested = attnkern.attention(nest(q), nest(k), nest(v), is_causal=True, normalizer=normalizer, lam=lam)
    torch.testing.assert_close(nested.transpose(1, 2).values(), out, atol=0, rtol=0)
    with pytest.raises(ValueError, match="lam is only used with normalizer"):
        attnkern.attention_varlen(q, k, v, cu_q, cu_k, normalizer="softmax", lam=0.5)


def _page_pool(k, v, cu_k, page, seed, spare=3):
    """Packed keys laid into a pool of pages in shuffled order (plus spare
    pages of noise): pool_k, pool_v, the int32 block table."""
    g = torch.Generator().manual_seed(seed)
    H, E, Ev = k.shape[1], k.shape[2], v.shape[2]
    lk = (cu_k[1:] - cu_k[:-1]).tolist()
    counts = [(n + page - 1) // page for n in lk]
    total = sum(counts) + spare
    pool_k = torch.randn(total, page, H, E, generator=g, dtype=torch.float64).to(k.dtype)
    pool_v = torch.randn(total, page, H, Ev, generator=g, dtype=torch.float64).to(v.dtype)
    order = torch.randperm(total, generator=g)
    table = torch.full((len(lk), max(max(counts), 1) + 1), -1, dtype=torch.int32)  # (unused slots: -1)
    slot = 0
    for d, n in enumerate(lk):
        for p in range(counts[d]):
            a, b = int(cu_k[d]) + p * page, min(int(cu_k[d]) + (p + 1) * page, int(cu_k[d]) + n)
            dst = int(order[slot])
            pool_k[dst, :b - a], pool_v[dst, :b - a] = k[a:b], v[a:b]
            table[d, p] = dst
            slot += 1
    return pool_k, pool_v, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,page,window", [(1, 16, None), (1, 5, (7, 0)), (3, 16, (-1, 0)), (4, 64, (20, 2))],
                         ids=["one-row", "page-5-window", "three-rows-causal", "four-rows-band"])
def test_paged_decoding_reads_pages_in_place(dtype, rows, page, window):
    """Softmax decoding from a paged cache takes one attention_decode_paged
    call, which copies the pages' rows a chunk at a time: each document gets
    bitwise what attnkern.attention gives on its keys gathered into one
    tensor (lengths 0, 1, a page's end, across decoding chunks of 512 keys;
    GQA; pages shuffled; a pool sliced out of a wider one)."""
    if not _extension.LOADED:
        pytest.skip("the compiled extension did not load")
    lk = [1, 0, page, 1100, 37]
    H, Hk, E = 4, 2, 64
    q, k, v, cu_q, _ = _packed([rows] * len(lk), lk, H, Hk, E, E, dtype=dtype, seed=13)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)))
    pool_k, pool_v, table = _page_pool(k, v, cu_k, page, seed=3)
    wide = torch.cat([pool_v, pool_v.flip(2)], dim=2)  # V's pool as a strided slice of a wider one
    pool_v = wide[:, :, :Hk]
    used = torch.tensor(lk)
    out = attnkern.attention_varlen(q, pool_k, pool_v, cu_q, None, seqused_k=used, block_table=table, window=window,
                                    enable_gqa=True)
    direct, shift = torch.ops.attnkern.attention_decode_paged(
        q.reshape(len(lk), rows, H, E).transpose(1, 2), pool_k, pool_v, table.long(), used, E ** -0.5,
        *(window or (-1, -1)))
    torch.testing.assert_close(out, direct.transpose(1, 2).reshape(out.shape), atol=0, rtol=0)
    for d, n in enumerate(lk):
        a = int(cu_k[d])
        qd = q[d * rows:(d + 1) * rows].transpose(0, 1).unsqueeze(0)
        kd, vd = (t[a:a + n].transpose(0, 1).unsqueeze(0) for t in (k, v))
        alone = attnkern.attention(qd, kd.contiguous(), vd.contiguous(), enable_gqa=True, window=window)
        torch.testing.assert_close(out[d * rows:(d + 1) * rows], alone[0].transpose(0, 1), atol=0, rtol=0,
                                   msg=f"document {d} ({n} keys)")
        if n == 0:
            assert torch.equal(out[d * rows:(d + 1) * rows], torch.zeros_like(out[:rows]))
            assert torch.isinf(shift[d]).all()
    want = attnkern.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, seqused_k=used,
                                     window=window, enable_gqa=True, backend="reference")
    assert_close_tol(out.double(), want, tolerance(dtype, "attention", "forward"), "out")


def test_paged_decoding_odd_head_dims_threads_and_gradients():
    """Head dims 59 / 33 (rows read unpadded: close to the gathered call, not
    bitwise), 1 and 2 threads bitwise, and gradients (the backward gathers the
    pages per document) against the float64 reference."""
    if not _extension.LOADED:
        pytest.skip("the compiled extension did not load")
    lk = [700, 3, 1030]
    H, E, Ev, page = 2, 59, 33, 8
    q, k, v, cu_q, _ = _packed([1] * 3, lk, H, H, E, Ev, seed=21)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)))
    pool_k, pool_v, table = _page_pool(k, v, cu_k, page, seed=4)
    q, pool_k, pool_v = (t.float().requires_grad_() for t in (q, pool_k, pool_v))
    used = torch.tensor(lk)
    out = attnkern.attention_varlen(q, pool_k, pool_v, cu_q, None, seqused_k=used, block_table=table)
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k.float(), v.float()))
    want = attnkern.attention_varlen(qq, kk, vv, cu_q, cu_k, seqused_k=used, backend="reference")
    assert_close_tol(out.double(), want, tolerance(torch.float32, "attention", "forward"), "out")
    go = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, pool_k, pool_v), go.float())
    exp = torch.autograd.grad(want, (qq, kk, vv), go)
    tol = tolerance(torch.float32, "attention", "gradient")
    assert_close_tol(got[0].double(), exp[0], tol, "dq")
    for g_pool, g_packed, name in ((got[1], exp[1], "dk"), (got[2], exp[2], "dv")):
        for d, n in enumerate(lk):
            pages = table[d, :(n + page - 1) // page].long()
            rows_d = g_pool[pages].reshape(-1, H, g_pool.shape[-1])[:n]
            assert_close_tol(rows_d.double(), g_packed[int(cu_k[d]):int(cu_k[d]) + n], tol, f"{name} doc {d}")
    assert_same_with_1_and_2_threads("""
        import attnkern
        g = torch.Generator().manual_seed(0)
        pool_k, pool_v = torch.randn(300, 8, 2, 59, generator=g), torch.randn(300, 8, 2, 33, generator=g)
        table = torch.randperm(300, generator=g)[:288].view(3, 96)
        q = torch.randn(3, 2, 59, generator=g)
        row.append(attnkern.attention_varlen(q, pool_k, pool_v, torch.tensor([0, 1, 2, 3]), None,
                                             seqused_k=torch.tensor([700, 3, 760]), block_table=table))
    """)


def test_paged_decoding_op_checks_its_arguments():
    if not _extension.LOADED:
        pytest.skip("the compiled extension did not load")
    op = torch.ops.attnkern.attention_decode_paged
    q, pool = torch.randn(2, 2, 1, 8), torch.randn(4, 4, 2, 8)
    table, used = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8])
    op(q, pool, pool, table, used, 1.0)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 4 names a page outside the pool of 4"):
        op(q, pool, pool, torch.tensor([[0, 1], [2, 4]]), used, 1.0)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 9 lies outside \[0, 8\]"):
        op(q, pool, pool, table, torch.tensor([5, 9]), 1.0)
    with pytest.raises(ValueError, match="at most 4 query rows"):
        op(torch.randn(2, 2, 5, 8), pool, pool, table, used, 1.0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        op(torch.randn(2, 3, 1, 8), pool, pool, table, used, 1.0)
    with pytest.raises(ValueError, match="block_table must be int64"):
        op(q, pool, pool, table.int(), used, 1.0)
    with pytest.raises(ValueError, match="one floating dtype"):
        op(q.double(), pool, pool, table, used, 1.0)
    torch.library.opcheck(op, (q, pool, pool, table, used, 0.5, 3, 0))
