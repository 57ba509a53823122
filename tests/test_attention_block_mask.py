"""attn_mask as a FlexAttention BlockMask: the CPU kernels compute the tiles
each row's run of keys reaches, against the float64 reference given the
mask_mod's dense boolean mask (torch's create_mask: independent of how
attnkern reads the BlockMask)."""

from __future__ import annotations

import pytest
import torch
from helpers import alpha_for, assert_close_tol, assert_same_with_1_and_2_threads, make_qkv

import attnkern
from attnkern.testing import tolerance

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def sliding(width):
    def mod(b, h, q, kv):
        return (q >= kv) & (q - kv <= width)
    return mod


def documents(lengths, causal=True):
    """Packed documents in one sequence (FlexAttention's document mask)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def mod(b, h, q, kv):
        same = doc[q] == doc[kv]
        return (same & (q >= kv)) if causal else same
    return mod


def prefix_lm(prefix):
    def mod(b, h, q, kv):
        return (kv <= q) | (kv < prefix)
    return mod


def per_head_window(b, h, q, kv):
    """A different window per head (and per batch element), bottom part causal."""
    return (q >= kv) & (q - kv <= 20 + 60 * h + 7 * b)


def rows_without_keys(b, h, q, kv):
    """Query rows 130..269 see nothing: an entirely empty block row (with 128-blocks)."""
    return ((q < 130) | (q >= 270)) & (kv <= q)


MASKS = {
    "sliding": (sliding(40), 300, 300, None, None),
    "documents": (documents([70, 1, 150, 79]), 300, 300, None, None),
    "prefix-lm": (prefix_lm(50), 257, 257, None, None),
    "L-ne-S": (lambda b, h, q, kv: (kv >= 4 * q) & (kv < 4 * q + 90), 97, 513, None, None),
    "per-head": (per_head_window, 300, 300, 2, 4),
    "empty-block-row": (rows_without_keys, 300, 300, None, None),
}


def _case(name, H=4, Hk=2, E=24, Ev=16, dtype=torch.float64, seed=0):
    mod, L, S, Bm, Hm = MASKS[name]
    B = 2
    bm = flex.create_block_mask(mod, Bm, Hm, L, S, device="cpu")
    dense = flex.create_mask(mod, Bm or 1, Hm or 1, L, S, device="cpu")
    q, k, v, go = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, seed=seed, grad_out=True)
    return bm, dense, q, k, v, go


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", "entmax"])
@pytest.mark.parametrize("name", list(MASKS))
def test_block_mask_matches_reference(name, normalizer):
    bm, dense, q, k, v, go = _case(name)
    # (A mask that differs across heads takes one α for all heads.)
    a = (1.25 if name == "per-head" else alpha_for(normalizer, 4, requires_grad=True, dtype=torch.float64)) \
        if normalizer == "entmax" else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnkern.attention(q, k, v, bm, normalizer=normalizer, alpha=a, enable_gqa=True)
    want = attnkern.attention(q, k, v, dense, normalizer=normalizer, alpha=a, enable_gqa=True, backend="reference")
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    inputs = [q, k, v] + ([a] if isinstance(a, torch.Tensor) else [])
    got, exp = torch.autograd.grad(out, inputs, go), torch.autograd.grad(want, inputs, go)
    for what, g, w in zip(("dq", "dk", "dv", "dalpha"), got, exp, strict=False):
        assert_close_tol(g, w, tolerance(torch.float64, "attention", "gradient", scale=4.0), what)
    if name == "empty-block-row":
        assert out[:, :, 130:270].abs().max() == 0


def test_block_mask_with_window_causal_and_cache_lengths():
    """A BlockMask meets is_causal, window and cache_seqlens: the keys all allow."""
    bm, dense, q, k, v, go = _case("documents")
    lengths = torch.tensor([300, 211])
    out = attnkern.attention(q, k, v, bm, window=(25, 3), cache_seqlens=lengths, enable_gqa=True,
                             normalizer="sparsemax")
    want = attnkern.attention(q, k, v, dense, window=(25, 3), cache_seqlens=lengths, enable_gqa=True,
                              normalizer="sparsemax", backend="reference")
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")


def test_block_mask_half_types_and_float32():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bm, dense, q, k, v, go = _case("sliding", E=64, Ev=64, dtype=dtype, seed=3)
        for normalizer in ("softmax", "entmax15"):
            out = attnkern.attention(q, k, v, bm, normalizer=normalizer, enable_gqa=True)
            want = attnkern.attention(q.double(), k.double(), v.double(), dense, normalizer=normalizer,
                                      enable_gqa=True, backend="reference")
            assert out.dtype == dtype
            assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), f"{dtype} {normalizer}")


def test_block_mask_dropout_is_the_dense_mask_call():
    """One seed from torch's generator and the same counters: the dropout
    keep mask of a BlockMask call is that of the dense-mask kernel call, also
    when a per-head mask folds the heads into the batch."""
    for name in ("sliding", "per-head"):
        bm, dense, q, k, v, go = _case(name, dtype=torch.float32)
        torch.manual_seed(7)
        out = attnkern.attention(q, k, v, bm, dropout_p=0.3, enable_gqa=True, normalizer="sparsemax")
        torch.manual_seed(7)
        want = attnkern.attention(q, k, v, dense, dropout_p=0.3, enable_gqa=True, normalizer="sparsemax")
        assert_close_tol(out, want, tolerance(torch.float32, "attention", "forward"), name)


def global_and_local(b, h, q, kv):
    """Global keys 0..3 plus a causal window of 50: rows with a gap."""
    return (kv < 4) | ((q >= kv) & (q - kv < 50))


def dilated(b, h, q, kv):
    """Every third key within 200 back, causal: many gaps in every row."""
    return (q >= kv) & (q - kv < 200) & ((q - kv) % 3 == 0)


def per_head_global(b, h, q, kv):
    """A different number of global keys and window per head and batch element."""
    return (kv < 2 + 3 * h) | ((q >= kv) & (q - kv < 30 + 40 * h + 9 * b))


def gaps_and_empty_block_row(b, h, q, kv):
    """Global keys plus a window, with query rows 140..299 seeing nothing."""
    return ((q < 140) | (q >= 300)) & ((kv < 3) | ((kv <= q) & (q - kv < 20)))


GAP_MASKS = {
    "global-and-local": (global_and_local, 300, 300, None, None),
    "dilated": (dilated, 300, 300, None, None),
    "per-head": (per_head_global, 300, 300, 2, 4),
    "L-ne-S": (lambda b, h, q, kv: (kv < 5) | ((kv >= 4 * q) & (kv < 4 * q + 90)), 97, 513, None, None),
    "empty-block-row": (gaps_and_empty_block_row, 420, 420, None, None),
}


def _gap_case(name, dtype=torch.float64, seed=0):
    mod, L, S, Bm, Hm = GAP_MASKS[name]
    bm = flex.create_block_mask(mod, Bm, Hm, L, S, device="cpu")
    dense = flex.create_mask(mod, Bm or 1, Hm or 1, L, S, device="cpu")
    q, k, v, go = make_qkv(2, 4, 2, L, S, 24, 16, dtype=dtype, seed=seed, grad_out=True)
    return bm, dense, q, k, v, go


# (α per head and fusedmax on two of the masks: their float64 references solve row by row in Python.)
GAP_CASES = ([(name, n) for name in GAP_MASKS for n in ("softmax", "sparsemax", "entmax15")]
             + [("per-head", "entmax"), ("L-ne-S", "entmax"), ("L-ne-S", "fusedmax")])


@pytest.mark.parametrize(("name", "normalizer"), GAP_CASES)
def test_rows_with_gaps_match_reference(name, normalizer):
    """Rows whose keys are not one run go block row by block row over the
    gathered key blocks they list; values and every gradient (α and λ per
    head too, also with a mask that differs across heads) as the reference
    given the dense mask."""
    from attnkern import block_mask

    bm, dense, q, k, v, go = _gap_case(name)
    assert block_mask.row_bounds(bm, q.shape[-2], k.shape[-2]) is None
    param = {"entmax": ("alpha", alpha_for("entmax", 4, requires_grad=True, dtype=torch.float64)),
             "fusedmax": ("lam", torch.tensor([0.05, 0.2, 0.0, 1.0], dtype=torch.float64, requires_grad=True)),
             }.get(normalizer)
    kw = {param[0]: param[1]} if param else {}
    if normalizer == "fusedmax":
        q, k, v, go = (t[:1] for t in (q, k, v, go))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnkern.attention(q, k, v, bm, normalizer=normalizer, enable_gqa=True, **kw)
    want = attnkern.attention(q, k, v, dense, normalizer=normalizer, enable_gqa=True, backend="reference", **kw)
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    inputs = [q, k, v] + ([param[1]] if param else [])
    got, exp = torch.autograd.grad(out, inputs, go), torch.autograd.grad(want, inputs, go)
    for what, g, w in zip(("dq", "dk", "dv", "dparam"), got, exp, strict=False):
        assert_close_tol(g, w, tolerance(torch.float64, "attention", "gradient", scale=4.0), what)
    if name == "empty-block-row":
        assert out[:, :, 140:300].abs().max() == 0


def test_rows_with_gaps_meet_window_causal_cache_lengths_and_weights():
    bm, dense, q, k, v, go = _gap_case("global-and-local")
    lengths = torch.tensor([300, 233])
    for kw in ({"window": (25, 3), "cache_seqlens": lengths}, {"is_causal": True}):
        out = attnkern.attention(q, k, v, bm, enable_gqa=True, normalizer="sparsemax", **kw)
        want = attnkern.attention(q, k, v, dense, enable_gqa=True, normalizer="sparsemax", backend="reference",
                                  **kw)
        assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), str(kw))
    out, w = attnkern.attention(q, k, v, bm, normalizer="entmax15", enable_gqa=True, return_weights=True)
    want, w_want = attnkern.attention(q, k, v, dense, normalizer="entmax15", enable_gqa=True, return_weights=True,
                                      backend="reference")
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    assert_close_tol(w, w_want, tolerance(torch.float64, "attention", "forward"), "weights")
    # (Unbatched (H, L, E) inputs, as attention takes them.)
    torch.testing.assert_close(attnkern.attention(q[1], k[1], v[1], bm, enable_gqa=True),
                               attnkern.attention(q[1:], k[1:], v[1:], bm, enable_gqa=True)[0])


def test_rows_with_gaps_half_types_and_dropout():
    for dtype in (torch.float32, torch.bfloat16):
        bm, dense, q, k, v, go = _gap_case("dilated", dtype=dtype, seed=3)
        out = attnkern.attention(q, k, v, bm, normalizer="entmax15", enable_gqa=True)
        want = attnkern.attention(q.double(), k.double(), v.double(), dense, normalizer="entmax15",
                                  enable_gqa=True, backend="reference")
        assert out.dtype == dtype
        assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), str(dtype))
    # Dropout is drawn in the gathered layout: reproducible under torch.manual_seed, and it drops.
    bm, dense, q, k, v, go = _gap_case("global-and-local", dtype=torch.float32)
    torch.manual_seed(5)
    a = attnkern.attention(q, k, v, bm, dropout_p=0.4, enable_gqa=True, normalizer="sparsemax")
    torch.manual_seed(5)
    b = attnkern.attention(q, k, v, bm, dropout_p=0.4, enable_gqa=True, normalizer="sparsemax")
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.allclose(a, attnkern.attention(q, k, v, bm, enable_gqa=True, normalizer="sparsemax"))


def test_bad_block_masks_are_named():
    q, k, v = make_qkv(2, 4, 4, 300, 300, 8, 8)
    bm = flex.create_block_mask(sliding(10), None, None, 256, 256, device="cpu")
    with pytest.raises(ValueError, match=r"BlockMask for \(Q_LEN, KV_LEN\) = \(256, 256\)"):
        attnkern.attention(q, k, v, bm)
    bm = flex.create_block_mask(sliding(10), 3, None, 300, 300, device="cpu")
    with pytest.raises(ValueError, match=r"BlockMask of \(B, H\) = \(3, 1\)"):
        attnkern.attention(q, k, v, bm)
    bm = flex.create_block_mask(per_head_window, None, 4, 300, 300, device="cpu")
    with pytest.raises(ValueError, match="give alpha as a float"):
        attnkern.attention(q, k, v, bm, normalizer="entmax", alpha=torch.full((4,), 1.5))
    with pytest.raises(ValueError, match="row_bounds"):
        torch.ops.attnkern.attention_fwd(q, k, v, None, False, 0.5, "softmax", None, 0.0, None, -1, -1, None,
                                         torch.zeros(2, 300, 2, dtype=torch.int64).fill_(301))


def test_block_mask_opcheck_and_compile():
    bm, dense, q, k, v, go = _case("documents", dtype=torch.float32)
    bounds = torch.zeros(2, 300, 2, dtype=torch.int64)
    bounds[:, :, 1] = torch.arange(1, 301)
    bounds[:, :, 0] = torch.arange(300) // 2
    args = (q, k, v, None, False, 0.3, "entmax15", None, 0.0, None, -1, -1, None, bounds)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd.default, args)
    out, shift = torch.ops.attnkern.attention_fwd(*args)
    torch.library.opcheck(torch.ops.attnkern.attention_bwd.default,
                          (go,) + args[:8] + (out, shift, False, 0.0, None, -1, -1, None, bounds))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return attnkern.attention(q, k, v, bm, normalizer="sparsemax", enable_gqa=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go),
                    strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_block_mask_results_do_not_depend_on_threads():
    assert_same_with_1_and_2_threads("""
        from torch.nn.attention.flex_attention import create_block_mask
        bm = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 200), None, None, 700, 700, device="cpu")
        q, k, v, go = make_qkv(2, 4, 2, 700, 700, 64, 64, seed=1, grad_out=True)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for norm in ("softmax", "entmax15"):
            out = attnkern.attention(q, k, v, bm, normalizer=norm, enable_gqa=True)
            row += [out] + list(torch.autograd.grad(out, (q, k, v), go))
    """)


@pytest.mark.parametrize("name", list(MASKS))
def test_whole_grid_bounds_equal_partial_block_bounds(name):
    """The static-shape reading (under torch.compile: mask_mod on the whole
    grid) gives the same bounds as the partial blocks alone."""
    from attnkern import block_mask

    mod, L, S, Bm, Hm = MASKS[name]
    bm = flex.create_block_mask(mod, Bm, Hm, L, S, device="cpu")
    assert torch.equal(block_mask.row_bounds(bm, L, S), block_mask.row_bounds(bm, L, S, check=False))
    bad = flex.create_block_mask(lambda b, h, q, kv: (kv < 4) | ((q >= kv) & (q - kv < 50)), None, None, 300, 300,
                                 device="cpu")
    with pytest.raises(RuntimeError, match="not one run"):
        block_mask.row_bounds(bad, 300, 300, check=False)


def test_block_mask_return_weights():
    """return_weights materializes the weights: zero outside each row's run."""
    bm, dense, q, k, v, go = _case("documents", dtype=torch.float32)
    out, w = attnkern.attention(q, k, v, bm, normalizer="entmax15", enable_gqa=True, return_weights=True)
    want, w_want = attnkern.attention(q, k, v, dense, normalizer="entmax15", enable_gqa=True, return_weights=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w, w_want)
    assert (w[..., ~dense[0, 0]] == 0).all()
