"""attnkern.attention and attnkern.nn.MultiheadAttention against the float64
reference (attnkern.backends.reference.attention), torch's SDPA and torch's
MultiheadAttention; opcheck and torch.compile on the attention ops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    NORMALIZERS,
    alpha_for,
    assert_close_tol,
    attention_mask,
    dalpha_tol,
    grads_in_marked_inputs,
    make_qkv,
    ref_attention,
)

import attnkern
from attnkern import _extension
from attnkern.backends import reference
from attnkern.testing import half_rule_bound, tolerance

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

SHAPES = {
    # (B, H, Hk, L, S, E, Ev)
    "1x1": (1, 1, 1, 1, 1, 16, 16),
    "17": (2, 2, 2, 17, 17, 16, 16),
    "gqa_97x17": (1, 4, 2, 97, 17, 59, 33),
    "17x1025": (1, 2, 2, 17, 1025, 64, 48),
    "1025x97": (1, 1, 1, 1025, 97, 128, 128),
    "mqa_17x97": (2, 4, 1, 17, 97, 64, 16),
}
MASKS = ["none", "causal", "bool", "float", "key_padding", "fully_masked", "causal_float"]


# --- forward ---------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_forward_matches_reference_float32(normalizer, shape, mask_kind):
    B, H, Hk, L, S, E, Ev = SHAPES[shape]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)
    out = attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, normalizer=normalizer,
                             alpha=alpha, backend="cpu")
    assert out.dtype == q.dtype and out.shape == (B, H, L, Ev)
    assert_close_tol(out, ref_attention(q, k, v, mask, causal, normalizer, alpha),
                     tolerance(torch.float32, "attention", "forward"), normalizer)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "fully_masked", "float"])
@pytest.mark.parametrize("shape", ["17", "gqa_97x17", "17x1025"])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_forward_matches_reference_float64(normalizer, shape, mask_kind):
    B, H, Hk, L, S, E, Ev = SHAPES[shape]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=torch.float64, noncontig=True, spread=2.0)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)
    out = attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, normalizer=normalizer,
                             alpha=alpha, backend="cpu")
    assert_close_tol(out, ref_attention(q, k, v, mask, causal, normalizer, alpha),
                     tolerance(torch.float64, "attention", "forward"), normalizer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "fully_masked"])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_forward_half_types(normalizer, mask_kind, dtype):
    """FlashAttention's rule: error against float64 at most twice plain PyTorch's
    in the same dtype, plus a rounding band."""
    B, H, Hk, L, S, E, Ev = 2, 2, 2, 33, 70, 64, 32
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)
    out = attnkern.attention(q, k, v, mask, is_causal=causal, normalizer=normalizer, alpha=alpha,
                             backend="cpu")
    assert out.dtype == dtype
    exact = ref_attention(q.double(), k.double(), v.double(), mask, causal, normalizer, alpha)
    # Plain PyTorch in the same dtype: scores and p·v in dtype, the normalizer exact.
    s = reference.attention_scores(q, k, mask, causal, E**-0.5)
    if normalizer == "entmax":
        p = reference.entmax(s, alpha.view(-1, 1, 1), -1)
    else:
        p = getattr(reference, normalizer)(s, -1)
    p = p.nan_to_num(0.0)
    plain = p.to(dtype) @ v
    err_plain = (plain.double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    assert half_rule_bound(err, err_plain, dtype), (err, err_plain)
    assert torch.isfinite(out).all()


# --- invariants and edge cases ---------------------------------------------------------


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_weights_invariants(normalizer):
    B, H, L, S, E = 2, 3, 33, 70, 16
    q, k, v = make_qkv(B, H, H, L, S, E, E, spread=2.0)
    mask, _ = attention_mask("fully_masked", B, H, L, S)
    alpha = alpha_for(normalizer, H)
    out, p = attnkern.attention(q, k, v, mask, normalizer=normalizer, alpha=alpha, return_weights=True)
    _, p_ref = ref_attention(q, k, v, mask, False, normalizer, alpha, return_weights=True)
    assert (p >= 0).all()
    sums = p.sum(-1)
    empty = ~mask.any(-1)
    torch.testing.assert_close(sums[~empty], torch.ones_like(sums[~empty]), atol=1e-5, rtol=0)
    assert (p[empty] == 0).all() and (p[~mask.expand_as(p)] == 0).all()
    assert_close_tol(p, p_ref, tolerance(torch.float32, "rowwise", "forward"), "weights")
    if normalizer != "softmax":
        # The support matches wherever the reference is not at the boundary.
        clear = (p_ref > 1e-5) | (p_ref == 0)
        assert torch.equal((p > 0)[clear], (p_ref > 0)[clear])
    fused = attnkern.attention(q, k, v, mask, normalizer=normalizer, alpha=alpha)
    assert_close_tol(fused, out, tolerance(torch.float32, "attention", "forward"), "fused vs weights")


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_fully_masked_rows_are_zero_with_zero_gradient(normalizer):
    B, H, L, S, E = 1, 2, 9, 12, 8
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, L, S, E, E))
    mask = torch.ones(B, H, L, S, dtype=torch.bool)
    mask[:, :, 3] = False
    alpha = alpha_for(normalizer, H, requires_grad=True)
    out = attnkern.attention(q, k, v, mask, normalizer=normalizer, alpha=alpha, backend="cpu")
    assert (out[:, :, 3] == 0).all()
    out.sum().backward()
    for t in (q, k, v) + ((alpha,) if alpha is not None else ()):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 3] == 0).all()
    # Every key masked for every query, and S = 0 (no keys at all).
    nothing = torch.zeros(B, H, L, S, dtype=torch.bool)
    out = attnkern.attention(q, k, v, nothing, normalizer=normalizer, alpha=alpha)
    assert (out == 0).all()
    empty = attnkern.attention(q, k[:, :, :0], v[:, :, :0], normalizer=normalizer, alpha=alpha)
    assert empty.shape == (B, H, L, E) and (empty == 0).all()


def test_nan_row_stays_in_its_row():
    q, k, v = make_qkv(1, 1, 1, 5, 6, 4, 4)
    q[0, 0, 2, 0] = math.nan
    for normalizer in NORMALIZERS:
        out = attnkern.attention(q, k, v, normalizer=normalizer, alpha=alpha_for(normalizer, 1))
        assert torch.isnan(out[0, 0, 2]).all()
        assert torch.isfinite(out[0, 0, [0, 1, 3, 4]]).all()


def test_alpha_near_one_is_softmax():
    q, k, v = make_qkv(1, 2, 2, 17, 23, 8, 8)
    soft = attnkern.attention(q, k, v)
    near = attnkern.attention(q, k, v, normalizer="entmax", alpha=1.0 + 1e-7)
    # Two float32 kernels that compute the same map: agreement to rounding, not the reference rule.
    same_map = dict(atol=1e-6, rtol=1e-5)
    assert_close_tol(near, soft, same_map, "alpha=1+1e-7")
    exact = attnkern.attention(q, k, v, normalizer="entmax", alpha=torch.tensor([1.0, 2.0]))
    assert_close_tol(exact[:, 0], soft[:, 0], same_map, "alpha=1")
    sparse = attnkern.attention(q, k, v, normalizer="sparsemax")
    assert_close_tol(exact[:, 1], sparse[:, 1], same_map, "alpha=2")


def test_sparse_scores_skip_blocks_and_stay_exact():
    # Large scores: sparsemax keeps a handful of keys per query.
    q, k, v = make_qkv(1, 2, 2, 200, 700, 32, 16, spread=3.0)
    for normalizer in ("sparsemax", "entmax15"):
        out = attnkern.attention(q, k, v, normalizer=normalizer)
        # Scores of size ~10: float32 rounding of the scores scales with them (atol 2.5x the rule's).
        assert_close_tol(out, ref_attention(q, k, v, None, False, normalizer, None), dict(atol=1e-4, rtol=1e-4),
                         normalizer)
        _, p = attnkern.attention(q, k, v, normalizer=normalizer, return_weights=True)
        assert (p > 0).float().mean() < 0.1


# --- gradients ---------------------------------------------------------------------


GRAD_CASES = {
    "17_none": ((2, 2, 2, 17, 17, 16, 16), "none"),
    "gqa_causal": ((1, 4, 2, 97, 33, 59, 24), "causal"),
    "bool": ((2, 2, 2, 33, 97, 16, 8), "bool"),
    "fully_masked": ((1, 2, 1, 17, 40, 16, 16), "fully_masked"),
    "float_causal": ((1, 2, 2, 65, 65, 32, 32), "causal_float"),
    # At most kPackRows (16) query rows: K and V are not packed into panels.
    "1_gqa_float": ((2, 4, 2, 1, 97, 16, 16), "float"),
    "5_causal_e59": ((1, 2, 2, 5, 300, 59, 24), "causal"),
    "16_fully_masked": ((2, 2, 1, 16, 40, 16, 16), "fully_masked"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_gradients_match_reference(normalizer, case, dtype):
    (B, H, Hk, L, S, E, Ev), mask_kind = GRAD_CASES[case]
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, noncontig=True))
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H, requires_grad=True)
    go = torch.randn(B, H, L, Ev, generator=torch.Generator().manual_seed(5), dtype=dtype)

    def kern(q, k, v, a):
        return attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, normalizer=normalizer,
                                  alpha=a, backend="cpu")

    def ref(q, k, v, a):
        return ref_attention(q, k, v, mask, causal, normalizer, a)

    got = grads_in_marked_inputs(kern, (q, k, v, alpha), go)
    want = grads_in_marked_inputs(ref, (q, k, v, alpha), go)
    for name, g, w in zip(("dq", "dk", "dv", "dalpha")[:len(got)], got, want, strict=True):
        assert g.dtype == w.dtype
        tol = tolerance(dtype, "attention", "gradient")
        if name == "dalpha":
            # A sum over every row: scale the tolerance with the row count.
            tol = dalpha_tol(tol, B * L)
        assert_close_tol(g, w, tol, f"{normalizer} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L", [5, 16, 17])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_few_query_rows_forward_matches_reference(normalizer, L, dtype):
    """The forward on either side of kPackRows (K read as it is up to 16 query
    rows, from key panels beyond), with a float mask and a key tile boundary."""
    B, H, Hk, S, E, Ev = 1, 4, 2, 300, 59, 40
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, seed=9)
    mask, causal = attention_mask("float", B, H, L, S)
    alpha = alpha_for(normalizer, H)
    out = attnkern.attention(q, k, v, mask, enable_gqa=True, normalizer=normalizer, alpha=alpha, backend="cpu")
    want = ref_attention(q, k, v, mask, causal, normalizer, alpha)
    assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), normalizer)


# Shapes that span several query blocks (128 rows) and key tiles (256 keys) of
# the tiled softmax kernels, with partial last ones.
TILE_CASES = {
    "float": ((1, 2, 2, 300, 600, 64, 64), "float"),
    "gqa_odd_dims_fully_masked": ((2, 4, 2, 257, 513, 59, 33), "fully_masked"),
    "causal_float": ((1, 2, 2, 400, 400, 32, 48), "causal_float"),
    "key_padding": ((2, 2, 2, 129, 257, 16, 16), "key_padding"),
}


def _softmax_matches_reference(shape, mask_kind, dtype, **make):
    """Softmax attention forward and q, k, v gradients against the reference."""
    B, H, Hk, L, S, E, Ev = shape
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, **make))
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    go = torch.randn(B, H, L, Ev, generator=torch.Generator().manual_seed(5), dtype=dtype)
    out = attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, backend="cpu")
    ref = ref_attention(q, k, v, mask, causal, "softmax", None)
    assert_close_tol(out, ref, tolerance(dtype, "attention", "forward"), "out")
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), go),
                          torch.autograd.grad(ref, (q, k, v), go), strict=True):
        assert_close_tol(g, w, tolerance(dtype, "attention", "gradient"), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(TILE_CASES))
def test_softmax_tiles_match_reference(case, dtype):
    _softmax_matches_reference(*TILE_CASES[case], dtype, noncontig=True)


# Decoding (at most 4 query rows, softmax) splits each head over chunks of 512 keys.
DECODE_CASES = {
    # (B, H, Hk, L, S, E, Ev), mask kind
    "1x1": ((1, 1, 1, 1, 1, 16, 16), "none"),
    "1x1537_h1": ((1, 1, 1, 1, 1537, 59, 33), "none"),
    "3x1025_gqa": ((2, 4, 2, 3, 1025, 64, 64), "float"),
    "4x97_causal": ((1, 2, 2, 4, 97, 16, 16), "causal"),
    "2x1030_padding": ((3, 2, 2, 2, 1030, 32, 16), "key_padding"),
    "4x600_fully_masked": ((1, 2, 2, 4, 600, 16, 16), "fully_masked"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_softmax_decoding_matches_reference(case, dtype):
    _softmax_matches_reference(*DECODE_CASES[case], dtype, seed=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_softmax_decoding_half_types_read_in_place(case, dtype):
    """bfloat16 / float16 decoding reads K and V in their dtype (no widened
    copies): the same float32 computation on the exactly widened inputs, up to
    summation order, so at most one rounding step of dtype apart."""
    (B, H, Hk, L, S, E, Ev), mask_kind = DECODE_CASES[case]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, seed=7)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    out = attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, backend="cpu")
    wide = attnkern.attention(q.float(), k.float(), v.float(), mask, is_causal=causal, enable_gqa=True,
                              backend="cpu")
    assert out.dtype == dtype and out.shape == (B, H, L, Ev)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), wide.to(dtype).float(), rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_decoding_with_gradients(dtype):
    """A few query rows in a half type with gradients go to the CPU kernel as
    they are (no widening in Python): output and gradients in dtype, within
    a few roundings of the float32 computation on the widened inputs."""
    q, k, v = make_qkv(1, 2, 1, 3, 257, 64, 40, dtype=dtype, seed=5)
    go = torch.randn(1, 2, 3, 40, generator=torch.Generator().manual_seed(6))

    def grads(q, k, v):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attnkern.attention(*xs, enable_gqa=True, backend="cpu")
        return (out, *torch.autograd.grad(out, xs, go.to(out.dtype)))

    half = grads(q, k, v)
    wide = grads(q.float(), k.float(), v.float())
    for a, b in zip(half, wide, strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all()
        scale = b.abs().max().item()
        torch.testing.assert_close(a.float(), b.to(dtype).float(), rtol=4 * torch.finfo(dtype).eps,
                                   atol=4 * torch.finfo(dtype).eps * scale)


def _output_and_grads(q, k, v, go, **kwargs):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attnkern.attention(*xs, **kwargs)
    return [out, *torch.autograd.grad(out, xs, go)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, causal, normalizer", [(1, False, "softmax"), (3, True, "entmax15"),
                                                      (97, False, "sparsemax")])
def test_plain_call_skips_preparation_and_gives_the_prepared_result(dtype, rows, causal, normalizer,
                                                                     monkeypatch):
    """A plain CPU call (4-d tensors of one dtype, equal batch and heads, no
    mask, dropout or α, backend="auto") goes straight to the autograd
    Function, in each dtype the kernel takes as it is; its output and
    gradients are bitwise those of the prepared call (backend="cpu")."""
    import sys

    q, k, v = make_qkv(2, 3, 3, rows, 97, 59, 40, dtype=dtype, seed=rows)
    go = torch.randn(2, 3, rows, 40, generator=torch.Generator().manual_seed(9)).to(dtype)
    prepared = _output_and_grads(q, k, v, go, is_causal=causal, normalizer=normalizer, backend="cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("the plain call took the prepared path")

    monkeypatch.setattr(sys.modules["attnkern.attention"], "_check_inputs", refuse)
    plain = _output_and_grads(q, k, v, go, is_causal=causal, normalizer=normalizer)
    for a, b in zip(plain, prepared, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_decoding_reads_other_layouts_in_place(dtype):
    """float32 / float64 decoding reads K and V where they are when their rows
    need no padding (a token-major cache, a slice of a longer cache, a batch
    broadcast): bitwise what contiguous copies give, with masks, causal,
    window, cache lengths, GQA and dropout, and the same gradients."""
    g = torch.Generator().manual_seed(11)
    B, H, Hk, L, S = 2, 4, 2, 3, 1100
    q = torch.randn(B, H, L, 64, generator=g, dtype=torch.float64).to(dtype)
    token_major = torch.randn(B, S, Hk, 64, generator=g, dtype=torch.float64).to(dtype)
    longer = torch.randn(B, Hk, S + 37, 32, generator=g, dtype=torch.float64).to(dtype)
    layouts = {
        "token-major": (token_major.transpose(1, 2), longer[:, :, 5:S + 5]),
        "slice": (token_major.transpose(1, 2).contiguous()[:, :, :S - 100], longer[:, :, :S - 100]),
        "broadcast": (token_major[:1].transpose(1, 2).expand(B, Hk, S, 64), longer[:1, :, :S].expand(B, Hk, S, 32)),
        "odd dim": (token_major[..., :59].transpose(1, 2), longer[:, :, :S, :31]),  # (padded: copied)
    }
    mask = torch.rand(B, 1, L, S, generator=g) > 0.3
    for name, (k, v) in layouts.items():
        assert not k.is_contiguous()
        n = k.shape[2]
        kw_list = [{}, {"attn_mask": mask[..., :n]}, {"is_causal": True}, {"window": (300, 0)},
                   {"cache_seqlens": torch.tensor([n, n // 3])}]
        for kw in kw_list:
            qq = q[..., :k.shape[-1]]
            out = attnkern.attention(qq, k, v, enable_gqa=True, backend="cpu", **kw)
            want = attnkern.attention(qq, k.contiguous(), v.contiguous(), enable_gqa=True, backend="cpu", **kw)
            assert torch.equal(out, want), (name, kw)
        torch.manual_seed(3)
        out = attnkern.attention(q[..., :k.shape[-1]], k, v, dropout_p=0.2, enable_gqa=True, backend="cpu")
        torch.manual_seed(3)
        want = attnkern.attention(q[..., :k.shape[-1]], k.contiguous(), v.contiguous(), dropout_p=0.2,
                                  enable_gqa=True, backend="cpu")
        assert torch.equal(out, want), (name, "dropout")
    k, v = (t.detach().clone().requires_grad_() for t in layouts["token-major"])
    kc, vc = (t.detach().contiguous().requires_grad_() for t in layouts["token-major"])
    go = torch.randn(B, H, L, 32, generator=g, dtype=torch.float64).to(dtype)
    got = torch.autograd.grad(attnkern.attention(q, k, v, enable_gqa=True), (k, v), go)
    exp = torch.autograd.grad(attnkern.attention(q, kc, vc, enable_gqa=True), (kc, vc), go)
    for a, b in zip(got, exp, strict=True):
        assert torch.equal(a, b)


def test_softmax_decoding_large_scores_and_thread_count():
    q, k, v = make_qkv(1, 1, 1, 1, 2000, 16, 16, spread=30.0, seed=3)
    k[0, 0, 1700] = q[0, 0, 0] * 40  # one key far above the rest, in the last chunk
    outs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(attnkern.attention(q, k, v, backend="cpu"))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    ref = ref_attention(q.double(), k.double(), v.double(), None, False, "softmax", None)
    assert_close_tol(outs[0], ref, tolerance(torch.float32, "attention", "forward"), "out")
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("alpha_grad", [False, True])
def test_entmax_heads_in_the_softmax_limit(alpha_grad):
    """α = 1 heads beside sparse ones: without dα they take the tiled softmax
    backward, with dα the row path that reduces it; both match the reference."""
    B, H, L, S, E = 1, 2, 150, 300, 32
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, L, S, E, E, dtype=torch.float64))
    alpha = torch.tensor([1.0, 1.5], requires_grad=alpha_grad)
    go = torch.randn(B, H, L, E, dtype=torch.float64)
    inputs = (q, k, v, alpha) if alpha_grad else (q, k, v)
    out = attnkern.attention(q, k, v, is_causal=True, normalizer="entmax", alpha=alpha, backend="cpu")
    ref = ref_attention(q, k, v, None, True, "entmax", alpha)
    assert_close_tol(out, ref, tolerance(torch.float64, "attention", "forward"), "out")
    for name, g, w in zip(("dq", "dk", "dv", "dalpha"), torch.autograd.grad(out, inputs, go),
                          torch.autograd.grad(ref, inputs, go), strict=False):
        tol = tolerance(torch.float64, "attention", "gradient")
        assert_close_tol(g, w, tol if name != "dalpha" else dalpha_tol(tol, L), name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_gradients_half_types(normalizer, dtype):
    """Gradients in half types (computed in float32; softmax's row term uses the
    rounded output) by FlashAttention's rule against plain PyTorch in dtype."""
    B, H, L, S, E = 1, 2, 150, 300, 64
    q, k, v = make_qkv(B, H, H, L, S, E, E, dtype=dtype)
    alpha = alpha_for(normalizer, H)
    go = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grads(fn, dt):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*xs), xs, go.to(dt))

    def kern(q, k, v):
        return attnkern.attention(q, k, v, is_causal=True, normalizer=normalizer, alpha=alpha, backend="cpu")

    def plain(q, k, v):  # scores, weights and p·v in dtype
        s = reference.attention_scores(q, k, is_causal=True, scale=E**-0.5)
        if normalizer == "softmax":
            p = torch.softmax(s, -1)
        elif normalizer == "entmax":
            p = reference.entmax(s, alpha.view(-1, 1, 1), -1)
        else:
            p = getattr(reference, normalizer)(s, -1)
        return p.to(dtype) @ v

    exact = grads(lambda q, k, v: ref_attention(q, k, v, None, True, normalizer, alpha), torch.float64)
    for name, g, gp, w in zip(("dq", "dk", "dv"), grads(kern, dtype), grads(plain, dtype), exact, strict=True):
        assert g.dtype == dtype
        err = (g.double() - w).abs().max().item()
        err_plain = (gp.double() - w).abs().max().item()
        assert half_rule_bound(err, err_plain, dtype), (name, err, err_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spread", [0.2, 2.0])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_sparse_and_dense_block_paths(normalizer, spread, dtype):
    """Peaked scores (spread 2: a few keys per query) take the per-entry support
    path, flat ones (spread 0.2) the GEMMs over key blocks; both match."""
    B, H, L, S, E = 1, 2, 150, 300, 32
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, L, S, E, 24, dtype=dtype, spread=spread))
    mask, causal = attention_mask("causal", B, H, L, S)
    alpha = alpha_for(normalizer, H, requires_grad=True)
    if alpha is not None:
        alpha = torch.tensor([1.25, 1.75], requires_grad=True)
    go = torch.randn(B, H, L, 24, dtype=dtype)
    out = attnkern.attention(q, k, v, mask, is_causal=causal, normalizer=normalizer, alpha=alpha,
                             backend="cpu")
    ref = ref_attention(q, k, v, mask, causal, normalizer, alpha)
    scale = max(1.0, spread**2)
    assert_close_tol(out, ref, tolerance(dtype, "attention", "forward", scale=scale), normalizer)
    inputs = [q, k, v] + ([alpha] if alpha is not None else [])
    for name, g, w in zip(("dq", "dk", "dv", "dalpha"), torch.autograd.grad(out, inputs, go),
                          torch.autograd.grad(ref, inputs, go), strict=False):
        tol = tolerance(dtype, "attention", "gradient", scale=scale)
        if name == "dalpha":
            tol = dalpha_tol(tol, L)
        assert_close_tol(g, w, tol, f"{normalizer} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_support_lists_that_overflow_within_a_block(normalizer, dtype):
    """Query blocks whose first rows are peaked (a few keys each: their supports
    are listed) and whose later rows are flat (most keys: the lists pass the
    block's limit part way and the block's rows are written whole instead),
    rows in between interleaved; forward and backward match the reference
    (float32) and the float32 kernel on the same rounded inputs (bfloat16,
    whose scores come from bfloat16 GEMMs in both directions)."""
    B, H, L, S, E = 1, 2, 200, 333, 64
    q, k, v, go = make_qkv(B, H, H, L, S, E, E, grad_out=True, seed=3)
    row_spread = torch.full((L, 1), 3.0, dtype=torch.float64)
    row_spread[40:64] = 0.02  # the end of the first block: flat
    row_spread[64:128:2] = 0.02  # the second block: every other row flat
    q = q * row_spread
    alpha = torch.tensor([1.25, 1.75]) if normalizer == "entmax" else None

    def run(dt):
        xs = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = attnkern.attention(*xs, normalizer=normalizer, alpha=alpha, backend="cpu")
        return [out, *torch.autograd.grad(out, xs, go.to(dt))]

    got = run(dtype)
    if dtype == torch.float32:
        xs = [t.float().requires_grad_() for t in (q, k, v)]
        ref = ref_attention(*xs, None, False, normalizer, alpha)
        want = [ref, *torch.autograd.grad(ref, xs, go.float())]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            tol = tolerance(dtype, "attention", "forward" if name == "out" else "gradient")
            assert_close_tol(g, w, tol, f"{normalizer} {name}")
        return
    # The float32 kernel on the rounded inputs: the same scores up to the
    # order of their sums, the same weights and products in float32 (V read
    # as it is by the listed and the dense P·V); the half-type results
    # differ by their final rounding.
    q, k, v = (t.to(dtype).double() for t in (q, k, v))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, run(torch.float32), strict=True):
        assert g.dtype == dtype
        bound = 2 * 2.0**-8 * w.abs().max().item() + 1e-3 * w.abs().max().item()
        err = (g.float() - w).abs().max().item()
        assert err <= bound, (normalizer, name, err, bound)


@pytest.mark.parametrize("ev", [59, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_half_values_read_as_they_are(normalizer, dtype, ev):
    """Sparse heads of bfloat16 / float16 inputs read V in its own type: their
    outputs (value head dims 59 and 64, peaked and flat rows: listed and
    dense P·V) match the float32 kernel on the same rounded inputs up to the
    output's rounding, with a softmax head beside them."""
    B, H, L, S, E = 1, 2, 96, 150, 64
    q, k, v = make_qkv(B, H, H, L, S, E, ev, seed=7)
    row_spread = torch.full((L, 1), 2.5, dtype=torch.float64)
    row_spread[64:] = 1e-3  # the second block: flat rows, every key in the support
    q = (q * row_spread).to(dtype)
    k, v = k.to(dtype), v.to(dtype)
    alpha = torch.tensor([1.3, 1.0]) if normalizer == "entmax" else None
    got = attnkern.attention(q, k, v, normalizer=normalizer, alpha=alpha, backend="cpu")
    want = attnkern.attention(q.float(), k.float(), v.float(), normalizer=normalizer, alpha=alpha, backend="cpu")
    assert got.dtype == dtype and got.shape == (B, H, L, ev)
    # (bfloat16 scores come from bfloat16 GEMMs on AMX, float32's from float32 ones.)
    bound = 2 * 2.0**-8 * want.abs().max().item() + 1e-3 * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= bound


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["softmax", "causal", "float_mask", "dropout", "gqa_odd_dims", "mixed_alpha",
                                  "one_kv_head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_widened_in_the_kernel(dtype, case, threads, monkeypatch):
    """bfloat16 / float16 inputs with float32 GEMMs (the type's half GEMMs
    turned off) are widened in the kernels, q and dO a block of rows and K
    and V a head at a time, and the output written in the half type block by
    block: the softmax heads' outputs are the float32 kernel's on the widened
    inputs, rounded once, bit for bit, across heads that share a kv-head and
    heads of other families between them (whose P·V reads V as it is); the
    gradients match the float32 kernel's up to the rounding (δ = dO·O takes
    the rounded output). With fewer kv-heads than threads the operands are
    copied whole first instead (one_kv_head at 2 threads)."""
    monkeypatch.setenv("ATTNKERN_BF16_GEMM" if dtype == torch.bfloat16 else "ATTNKERN_FP16_GEMM", "0")
    # (one_kv_head at 2 threads: fewer kv-heads than threads, whole-problem copies.)
    B, H, Hk, L, S, E, Ev = {"gqa_odd_dims": (1, 4, 2, 97, 75, 59, 40), "one_kv_head": (1, 4, 1, 97, 75, 59, 40)}.get(
        case, (2, 4, 4, 80, 130, 64, 64))
    q, k, v, go = make_qkv(B, H, Hk, L, S, E, Ev, noncontig=True, seed=11, spread=1.5, grad_out=True)
    q, k, v, go = (t.to(dtype) for t in (q, k, v, go))
    mask, causal = attention_mask({"causal": "causal", "float_mask": "float"}.get(case, "none"), B, H, L, S)
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=True, backend="cpu")
    if case == "dropout":  # (the seed is drawn from torch's generator: the same for both calls)
        kw.update(dropout_p=0.3)
    softmax_heads = list(range(H))
    if case == "mixed_alpha":  # softmax-limit heads 0 and 2, sparse heads 1 and 3
        kw.update(normalizer="entmax", alpha=torch.tensor([1.0, 1.5, 1.0, 2.0]))
        softmax_heads = [0, 2]

    def run(dt):
        xs = [t.to(dt).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        out = attnkern.attention(*xs, **kw)
        return [out, *torch.autograd.grad(out, xs, go.to(dt))]

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, want = run(dtype), run(torch.float32)
    finally:
        torch.set_num_threads(saved)
    assert got[0].dtype == dtype and got[0].shape == (B, H, L, Ev)
    assert torch.equal(got[0][:, softmax_heads], want[0][:, softmax_heads].to(dtype))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == dtype
        bound = 2.0**-7 * w.abs().max().item()  # (their rounding; V read as it is by the sparse heads)
        assert (g.float() - w).abs().max().item() <= bound, name


@pytest.mark.parametrize("L", [3, 40])
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax"])
def test_float8_inputs_widened_first(normalizer, L):
    """float8 inputs, which the kernels do not read or write as they are, are
    widened to float32 first and the output rounded once: the float32
    kernel's output on the widened inputs, rounded, bit for bit (decoding and
    packed keys alike)."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in make_qkv(1, 2, 2, L, 37, 16, 16, seed=4))
    alpha = torch.tensor([1.3, 1.6]) if normalizer == "entmax" else None
    got = attnkern.attention(q, k, v, normalizer=normalizer, alpha=alpha, backend="cpu")
    want = attnkern.attention(q.float(), k.float(), v.float(), normalizer=normalizer, alpha=alpha, backend="cpu")
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_nan_row_inside_a_block_of_listed_rows(normalizer, dtype):
    """A NaN query row among rows whose supports are listed from their scores
    (S >= 64, peaked scores): the NaN row's output is NaN; the rows before it
    (listed) and after it (solved once the block gave up its lists) match the
    run without the NaN, which matches the reference (float32)."""
    q, k, v = make_qkv(1, 1, 1, 48, 200, 64, 64, spread=1.5, seed=5)
    bad = q.clone()
    bad[0, 0, 20, 3] = math.nan
    alpha = torch.tensor([1.3]) if normalizer == "entmax" else None

    def run(q):
        return attnkern.attention(q.to(dtype), k.to(dtype), v.to(dtype), normalizer=normalizer, alpha=alpha,
                                  backend="cpu").float()

    out, out_bad = run(q), run(bad)
    assert out_bad[0, 0, 20].isnan().all()
    keep = torch.ones(48, dtype=torch.bool)
    keep[20] = False
    assert torch.isfinite(out_bad[0, 0, keep]).all()
    # The same kernel with and without the NaN row: agreement to rounding, not the reference rule.
    torch.testing.assert_close(out_bad[0, 0, keep], out[0, 0, keep], atol=1e-6, rtol=1e-5)
    if dtype == torch.float32:
        assert_close_tol(out, ref_attention(q, k, v, None, False, normalizer, alpha),
                         tolerance(dtype, "attention", "forward"), normalizer)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15"])
def test_row_starts_from_strided_maxima(normalizer, magnitude):
    """The rows' searches start from the maxima of 64 strided parts of the row
    (the row's last entries, past a multiple of 64, are in none): rows whose
    largest scores sit in that tail, or are tied across parts, at large and
    tiny magnitudes, match the reference in float32 and bfloat16."""
    B, H, L, S, E = 1, 1, 8, 70, 64
    q, k, v = make_qkv(B, H, H, L, S, E, E, seed=4)
    k[..., 66:, :] = 2.0 * q[..., :4, :].transpose(0, 1).reshape(1, 1, 4, E)  # row i's best key in the tail
    k[..., 10:40:10, :] = k[..., 5:6, :]  # a key tied with three others in other parts
    q[..., 4:, :] = 3.0 * k[..., 5, :].unsqueeze(-2)  # rows whose best keys are the tied ones
    q = q * magnitude
    for dtype, tol in ((torch.float32, tolerance(torch.float32, "attention", "forward")), (torch.bfloat16, None)):
        xs = [t.to(dtype) for t in (q, k, v)]
        out = attnkern.attention(*xs, normalizer=normalizer, backend="cpu")
        ref = ref_attention(*(t.double() for t in xs), None, False, normalizer, None)
        if tol is not None:
            assert_close_tol(out, ref, tol, f"{normalizer} {magnitude}")
        else:  # the bfloat16 scores' rounding, then the output's
            assert (out.double() - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 1e-3


@pytest.mark.parametrize("mask_kind", ["none", "causal", "fully_masked"])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_gradcheck_float64(normalizer, mask_kind):
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 5, 7, 4, 3
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Hk, L, S, E, Ev, dtype=torch.float64, spread=2.0))
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)

    def f(q, k, v):
        return attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, normalizer=normalizer,
                                  alpha=alpha, backend="cpu")

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_alpha_reference_and_kernel_agree():
    """dα: gradcheck of the reference in float64, then the kernel's dα against it
    (the kernel takes α in float32, too coarse for finite differences)."""
    q, k, v = make_qkv(1, 3, 3, 6, 8, 4, 3, dtype=torch.float64, spread=2.0)
    alpha = torch.tensor([1.25, 1.5, 1.75], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a: attnkern.attention(q, k, v, normalizer="entmax", alpha=a, backend="reference"), (alpha,))
    go = torch.randn(1, 3, 6, 3, dtype=torch.float64)
    out = attnkern.attention(q, k, v, normalizer="entmax", alpha=alpha, backend="cpu")
    (da_k,) = torch.autograd.grad(out, alpha, go)
    (da_r,) = torch.autograd.grad(attnkern.attention(q, k, v, normalizer="entmax", alpha=alpha,
                                                     backend="reference"), alpha, go)
    assert_close_tol(da_k, da_r, tolerance(torch.float64, "attention", "gradient"), "dalpha")


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_large_forward_backward_matches_reference(normalizer):
    B, H, L, S, E = 1, 2, 1025, 1025 if normalizer != "entmax" else 257, 64
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, L, S, E, E))
    alpha = alpha_for(normalizer, H, requires_grad=True)
    go = torch.randn(B, H, L, E)
    for causal in (False, True):
        def kern(q, k, v, a, causal=causal):
            return attnkern.attention(q, k, v, is_causal=causal, normalizer=normalizer, alpha=a)

        def ref(q, k, v, a, causal=causal):
            return ref_attention(q, k, v, None, causal, normalizer, a)

        got = grads_in_marked_inputs(kern, (q, k, v, alpha), go)
        want = grads_in_marked_inputs(ref, (q, k, v, alpha), go)
        for name, g, w in zip(("dq", "dk", "dv", "dalpha")[:len(got)], got, want, strict=True):
            tol = tolerance(torch.float32, "attention", "gradient")
            if name == "dalpha":  # a sum over 1025 rows: its own bound (dalpha_tol's atol would be 10x this)
                tol = dict(atol=1e-2, rtol=1e-3)
            assert_close_tol(g, w, tol, f"{normalizer} {name} causal={causal}")


# --- SDPA compatibility and public API ----------------------------------------------------


SDPA_CASES = [
    # (q shape, k shape, v shape, mask shape/kind, is_causal, enable_gqa)
    ((2, 3, 17, 16), (2, 3, 23, 16), (2, 3, 23, 8), None, False, False),
    ((2, 3, 17, 16), (2, 3, 23, 16), (2, 3, 23, 8), None, True, False),
    ((17, 16), (23, 16), (23, 8), None, False, False),
    ((4, 17, 16), (4, 23, 16), (4, 23, 8), "bool", False, False),
    ((2, 5, 3, 17, 16), (2, 5, 3, 23, 16), (2, 5, 3, 23, 8), "float", False, False),
    ((2, 4, 17, 16), (2, 2, 23, 16), (2, 2, 23, 8), "bool", False, True),
    ((2, 4, 17, 16), (1, 4, 23, 16), (1, 4, 23, 8), None, True, False),
    ((1, 4, 1, 16), (1, 4, 97, 16), (1, 4, 97, 16), "key_padding", False, False),
]


@pytest.mark.parametrize("case", range(len(SDPA_CASES)))
def test_softmax_matches_sdpa(case):
    qs, ks, vs, mask_kind, causal, gqa = SDPA_CASES[case]
    g = torch.Generator().manual_seed(case)
    q, k, v = (torch.randn(s, generator=g).requires_grad_() for s in (qs, ks, vs))
    L, S = qs[-2], ks[-2]
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(L, S, generator=g) > 0.4
        mask[:, 0] = True
    elif mask_kind == "float":
        mask = torch.randn(qs[-3], L, S, generator=g)
    elif mask_kind == "key_padding":
        mask = (torch.arange(S) < S - 10).view(1, 1, 1, S)
    ours = attnkern.attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa, scale=0.3)
    theirs = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa, scale=0.3)
    torch.testing.assert_close(ours, theirs, **tolerance(torch.float32, "attention", "forward"))
    go = torch.randn(theirs.shape, generator=g)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), go), torch.autograd.grad(theirs, (q, k, v), go),
                    strict=True):
        torch.testing.assert_close(a, b, **tolerance(torch.float32, "attention", "gradient"))


@pytest.mark.parametrize("form", ["float", "per_head", "broadcast4d", "scalar_tensor", "per_batch"])
def test_alpha_forms(form):
    B, H, L, S, E = 2, 3, 9, 11, 8
    q, k, v = make_qkv(B, H, H, L, S, E, E)
    per_head = torch.tensor([1.25, 1.5, 1.75])
    alpha = {"float": 1.25, "per_head": per_head, "broadcast4d": per_head.view(1, H, 1, 1),
             "scalar_tensor": torch.tensor(1.25),
             "per_batch": torch.tensor([[1.25, 1.5, 1.75], [1.5, 1.5, 2.0]]).view(B, H, 1, 1)}[form]
    alpha = alpha.clone().requires_grad_() if isinstance(alpha, torch.Tensor) else alpha
    out = attnkern.attention(q, k, v, normalizer="entmax", alpha=alpha)
    ref_alpha = alpha if form != "per_head" else alpha.view(H, 1, 1)
    ref = reference.attention(q, k, v, normalizer="entmax", alpha=ref_alpha)
    assert_close_tol(out, ref, tolerance(torch.float32, "attention", "forward"), form)
    if isinstance(alpha, torch.Tensor):
        (da,) = torch.autograd.grad(out.sum(), alpha)
        assert da.shape == alpha.shape and torch.isfinite(da).all()
    if form == "per_batch":
        # One α per (batch, head) runs in the kernel too, with its gradient.
        out_cpu = attnkern.attention(q, k, v, normalizer="entmax", alpha=alpha, backend="cpu")
        assert_close_tol(out_cpu, ref, tolerance(torch.float32, "attention", "forward"), "per_batch cpu")
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        (da_cpu,) = torch.autograd.grad(out_cpu, alpha, go)
        ar = alpha.detach().double().requires_grad_()
        (da_ref,) = torch.autograd.grad(reference.attention(q.double(), k.double(), v.double(), normalizer="entmax",
                                                            alpha=ar), ar, go.double())
        torch.testing.assert_close(da_cpu.double(), da_ref, **tolerance(torch.float32, "attention", "gradient"))


def test_backends_and_dropout():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 8, 8)
    # A forced kernel backend takes dropout (tests/test_attention_dropout.py checks its mask).
    assert torch.isfinite(attnkern.attention(q, k, v, dropout_p=0.5, backend="cpu")).all()
    from attnkern.backends import triton as triton_backend

    if triton_backend.available()[0]:
        # Under TRITON_INTERPRET=1 (tests/conftest.py) the Triton kernels run on CPU tensors.
        tri = attnkern.attention(q, k, v, backend="triton", normalizer="sparsemax")
        cpu = attnkern.attention(q, k, v, backend="cpu", normalizer="sparsemax")
        assert_close_tol(tri, cpu, tolerance(torch.float32, "attention", "forward"), "triton vs cpu")
    else:
        with pytest.raises(RuntimeError, match="triton"):
            attnkern.attention(q, k, v, backend="triton")
    torch.manual_seed(0)
    out = attnkern.attention(q, k, v, dropout_p=0.5, normalizer="sparsemax")  # auto: the CPU kernel
    assert out.shape == (1, 2, 9, 8) and torch.isfinite(out).all()
    ref = attnkern.attention(q, k, v, backend="reference", normalizer="entmax15")
    cpu = attnkern.attention(q, k, v, backend="cpu", normalizer="entmax15")
    assert_close_tol(ref, cpu, tolerance(torch.float32, "attention", "forward"), "reference vs cpu")
    with pytest.raises(ValueError, match="backend"):
        attnkern.attention(q, k, v, backend="gpu")


@pytest.mark.parametrize("bad, exc, match", [
    (dict(query=torch.randn(2, 3, 4).int()), TypeError, "query"),
    (dict(key=torch.randn(2, 5, 7)), ValueError, "last dim"),
    (dict(value=torch.randn(2, 6, 4)), ValueError, "sequence length"),
    (dict(key=torch.randn(2, 5, 4).double()), TypeError, "one dtype"),
    (dict(attn_mask=torch.ones(3, 5).int()), TypeError, "attn_mask"),
    (dict(attn_mask=torch.ones(4, 5, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(normalizer="relu"), ValueError, "normalizer"),
    (dict(normalizer="entmax"), ValueError, "alpha"),
    (dict(normalizer="entmax", alpha=0.0), ValueError, "alpha"),
    (dict(normalizer="entmax", alpha=torch.tensor([1.5, -1.0])), ValueError, "alpha"),
    (dict(normalizer="entmax", alpha=torch.ones(5, 1, 1) * 1.5), ValueError, "alpha"),
    (dict(normalizer="softmax", alpha=1.5), ValueError, "alpha"),
    (dict(normalizer="entmax", alpha=math.inf), ValueError, "alpha"),
    (dict(normalizer="entmax", alpha=torch.tensor([math.inf, 1.5])), ValueError, "alpha"),
    (dict(normalizer="entmax", alpha=torch.tensor([1.3, 1.5], device="meta")), ValueError, "alpha is on meta"),
    (dict(dropout_p=1.5), ValueError, "dropout_p"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(scale="big"), TypeError, "scale"),
    (dict(query=torch.randn(4, 3, 4), key=torch.randn(3, 5, 4), value=torch.randn(3, 5, 4)), ValueError,
     "heads"),
])
def test_validation_errors(bad, exc, match):
    args = dict(query=torch.randn(2, 3, 4), key=torch.randn(2, 5, 4), value=torch.randn(2, 5, 4))
    args.update(bad)
    with pytest.raises(exc, match=match):
        attnkern.attention(**args)


def test_compiled_op_refuses_a_non_finite_alpha():
    # What a compiled graph calls (attention() checks α before, in eager mode).
    q = torch.randn(1, 2, 3, 4)
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match="alpha must be finite"):
            torch.ops.attnkern.attention_fwd(q, q, q, None, False, 0.5, "entmax", torch.tensor([1.5, bad]))


def test_float64_alpha_is_not_rounded_to_float32():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    alpha = torch.tensor([1.3, 1.7], dtype=torch.float64, requires_grad=True)
    out = attnkern.attention(q, k, v, normalizer="entmax", alpha=alpha)
    ref = attnkern.attention(q, k, v, normalizer="entmax", alpha=alpha, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)  # float32 α: errors ~1e-8
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, alpha), g)
    ref_grads = torch.autograd.grad(ref, (q, alpha), g)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)  # as above: a float32 α would show


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("shape", [(1, 2, 3, 0, 4, 2), (1, 0, 3, 4, 5, 2)], ids=["E=0", "H=0"])
def test_empty_head_dim_or_heads_as_sdpa(normalizer, shape):
    B, H, L, E, S, Ev = shape
    q, k, v = torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, Ev, requires_grad=True)
    out = attnkern.attention(q, k, v, normalizer=normalizer, alpha=alpha_for(normalizer, H))
    assert out.shape == (B, H, L, Ev)
    if E == 0:  # every score 0: uniform weights for every normalizer, as SDPA's softmax
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    out.sum().backward()
    assert v.grad.shape == v.shape


# --- ops: opcheck -------------------------------------------------------------------------


def _op_args(normalizer, mask_kind, noncontig):
    B, H, Hk, L, S, E, Ev = 1, 4, 2, 9, 13, 8, 6
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, noncontig=noncontig)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(1, 1, L, S).expand(B, H, L, S)  # stride-0 view
    alpha = alpha_for(normalizer, H)
    return q, k, v, mask, mask_kind == "causal", 0.35, normalizer, alpha


@pytest.mark.parametrize("case", [("softmax", "none", False), ("sparsemax", "causal", True),
                                  ("entmax15", "float", True), ("entmax", "float", False)])
def test_opcheck(case):
    q, k, v, mask, causal, scale, normalizer, alpha = _op_args(*case)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd, (q, k, v, mask, causal, scale, normalizer, alpha))
    out, shift = torch.ops.attnkern.attention_fwd(q, k, v, mask, causal, scale, normalizer, alpha)
    go = torch.randn_like(out).transpose(-1, -2).contiguous().transpose(-1, -2)
    for alpha_grad in (False, True):
        torch.library.opcheck(torch.ops.attnkern.attention_bwd,
                              (go, q, k, v, mask, causal, scale, normalizer, alpha, out, shift, alpha_grad))
    dq, dk, dv, da = torch.ops.attnkern.attention_bwd(go, q, k, v, mask, causal, scale, normalizer, alpha,
                                                      out, shift, True)
    assert da.shape == (q.shape[1],) and da.dtype == torch.float32
    assert shift.dtype == torch.float32 and shift.shape == q.shape[:3]


def test_shift_contract():
    """p = φ_b(s - shift) reproduces the weights; softmax's shift is the log-sum-exp, sparsemax's its threshold."""
    q, k, v = make_qkv(1, 2, 2, 7, 9, 8, 8, dtype=torch.float64)
    mask = torch.ones(7, 9, dtype=torch.bool)
    mask[2] = False
    fmask = torch.zeros(7, 9, dtype=torch.float64).masked_fill(~mask, -math.inf)
    s = reference.attention_scores(q, k, fmask, scale=0.5)
    _, shift = torch.ops.attnkern.attention_fwd(q, k, v, fmask, False, 0.5, "softmax", None)
    lse = torch.logsumexp(s, -1)
    assert torch.isinf(shift[..., 2]).all() and (shift[..., 2] > 0).all()
    # The shift is float32 by contract: its own rounding, not the output rule.
    torch.testing.assert_close(shift[..., [0, 1, 3]].double(), lse[..., [0, 1, 3]], atol=1e-6, rtol=1e-6)
    # (sparsemax: the threshold θ, p = [s - θ]_+)
    _, shift = torch.ops.attnkern.attention_fwd(q, k, v, fmask, False, 0.5, "sparsemax", None)
    p = (s - shift.double().unsqueeze(-1)).clamp_min(0)
    sums = p[..., [0, 1, 3], :].sum(-1)
    torch.testing.assert_close(sums, torch.ones(1, 2, 3, dtype=torch.float64), atol=1e-5, rtol=0)


# --- modules -------------------------------------------------------------------------------


MHA_CASES = [
    dict(),
    dict(batch_first=True),
    dict(kdim=12, vdim=10),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(bias=False),
]


@pytest.mark.parametrize("call", ["plain", "masks", "causal", "unbatched", "no_avg"])
@pytest.mark.parametrize("ctor", range(len(MHA_CASES)))
def test_multihead_attention_matches_torch(ctor, call):
    kw = MHA_CASES[ctor]
    E, H, N, L, S = 16, 4, 3, 7, 9
    torch.manual_seed(ctor)
    theirs = torch.nn.MultiheadAttention(E, H, **kw)
    ours = attnkern.nn.MultiheadAttention(E, H, **kw)
    ours.load_state_dict(theirs.state_dict())
    bf = kw.get("batch_first", False)
    kdim, vdim = kw.get("kdim", E), kw.get("vdim", E)

    def seq(n, d):
        return torch.randn(N, n, d) if bf else torch.randn(n, N, d)

    q, k, v = seq(L, E), seq(S, kdim), seq(S, vdim)
    fkw = {}
    if call == "masks":
        kpm = torch.zeros(N, S, dtype=torch.bool)
        kpm[0, -3:] = True
        am = torch.randn(L, S)
        fkw = dict(key_padding_mask=kpm, attn_mask=am)
    elif call == "causal":
        if L != S:
            q = seq(S, E)
        am = torch.nn.Transformer.generate_square_subsequent_mask(S)
        fkw = dict(attn_mask=am, is_causal=True)
    elif call == "unbatched":
        q, k, v = torch.randn(L, E), torch.randn(S, kdim), torch.randn(S, vdim)
    elif call == "no_avg":
        fkw = dict(average_attn_weights=False)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o1, w1 = ours(q, k, v, **fkw)
    o2, w2 = theirs(q, k, v, **fkw)
    out_tol = tolerance(torch.float32, "attention", "forward")
    torch.testing.assert_close(o1, o2, **out_tol)
    torch.testing.assert_close(w1, w2, **tolerance(torch.float32, "rowwise", "forward"))
    o1n, none = ours(q, k, v, need_weights=False, **fkw)
    assert none is None
    torch.testing.assert_close(o1n, o2, **out_tol)
    go = torch.randn_like(o2)
    g1 = torch.autograd.grad(o1n, [q, k, v, *ours.parameters()], go)
    g2 = torch.autograd.grad(o2, [q, k, v, *theirs.parameters()], go)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, **tolerance(torch.float32, "attention", "gradient"))


@pytest.mark.parametrize("normalizer, alpha", [("sparsemax", None), ("entmax15", None), ("entmax", 1.3),
                                               ("entmax", "learnable")])
def test_multihead_attention_normalizers(normalizer, alpha):
    E, H, N, L = 16, 4, 2, 11
    m = attnkern.nn.MultiheadAttention(E, H, batch_first=True, normalizer=normalizer, alpha=alpha)
    x = torch.randn(N, L, E, requires_grad=True)
    out, w = m(x, x, x, average_attn_weights=False)
    assert w.shape == (N, H, L, L)
    torch.testing.assert_close(w.sum(-1), torch.ones(N, H, L), atol=1e-5, rtol=0)
    out_fused, _ = m(x, x, x, need_weights=False)
    torch.testing.assert_close(out_fused, out, **tolerance(torch.float32, "attention", "forward"))
    out_fused.sum().backward()
    if alpha == "learnable":
        assert m.entmax_alpha.theta.grad is not None and torch.isfinite(m.entmax_alpha.theta.grad).all()
        assert m.alpha.shape == (H,)
    with pytest.raises(ValueError, match="alpha"):
        attnkern.nn.MultiheadAttention(E, H, normalizer="entmax")


# --- torch.compile -------------------------------------------------------------------------


class _Block(torch.nn.Module):
    """A pre-norm transformer block around attnkern.attention."""

    def __init__(self, d=32, heads=4, normalizer="entmax15", alpha=None):
        super().__init__()
        self.heads, self.normalizer, self.alpha = heads, normalizer, alpha
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = attnkern.attention(q, k, v, is_causal=True, normalizer=self.normalizer, alpha=self.alpha)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.norm2(x))


@pytest.mark.slow
def test_torch_compile_fullgraph_transformer_block():
    torch.manual_seed(0)
    alpha = torch.nn.Parameter(torch.full((4,), 1.3))
    block = _Block(normalizer="entmax", alpha=alpha)
    x = torch.randn(2, 19, 32, requires_grad=True)
    eager = block(x)
    ge = torch.autograd.grad(eager.sum(), [x, alpha])
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x)
    gc = torch.autograd.grad(out.sum(), [x, alpha])
    # Compiled against eager: the same kernels, only the ops around them fused; not the reference rule.
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-4)
    for a, b in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
