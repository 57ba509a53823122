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


def test_rows_that_are_not_one_run_are_refused():
    def global_and_local(b, h, q, kv):
        return (kv < 4) | ((q >= kv) & (q - kv < 50))

    q, k, v = make_qkv(1, 2, 2, 600, 600, 8, 8)
    bm = flex.create_block_mask(global_and_local, None, None, 600, 600, device="cpu")
    with pytest.raises(ValueError, match="not one run.*dense boolean attn_mask"):
        attnkern.attention(q, k, v, bm)


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
