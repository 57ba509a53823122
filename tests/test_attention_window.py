"""Key bands: sliding windows (FlashAttention's window_size, bottom-right
alignment), causal biases and per-batch cache lengths (cache_seqlens),
against the float64 reference run with the dense mask they stand for
(attnkern.backends.reference.band_mask)."""

from __future__ import annotations

import pytest
import torch
from helpers import alpha_for, assert_close_tol, assert_same_with_1_and_2_threads, dalpha_tol, make_qkv, ref_attention
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnkern
from attnkern.attention import draw_dropout_seed
from attnkern.backends import reference
from attnkern.testing import attention_dropout_mask, tolerance

# (normalizer, α per head or None)
CASES = [("softmax", None), ("sparsemax", None), ("entmax15", None), ("entmax", (1.25, 2.0, 1.5, 1.0))]
CASE_IDS = ["softmax", "sparsemax", "entmax15", "entmax-per-head"]

# (L, S, window, is_causal): the band's shapes, past tile and block edges.
BANDS = {
    "diagonal-only": (97, 97, (0, 0), False),
    "width-1": (97, 97, (1, 0), False),
    "right-only": (97, 97, (0, 3), False),
    "left-unbounded": (97, 97, (-1, 2), False),
    "right-unbounded": (97, 97, (7, -1), False),
    "wider-than-S": (40, 40, (100, 100), False),
    "sliding-causal": (300, 300, (70, 0), False),
    "window-and-causal": (97, 97, (5, 9), True),
    "L<S": (23, 150, (9, 0), False),
    "L>S rows-without-keys": (150, 23, (3, 2), False),
    "decode": (1, 301, (64, 0), False),
    "few-rows": (3, 301, (100, 0), False),
}


def _run(q, k, v, normalizer, alpha, backend="cpu", **kw):
    return attnkern.attention(q, k, v, enable_gqa=True, normalizer=normalizer, alpha=alpha, backend=backend, **kw)


def _reference(q, k, v, normalizer, alpha, *, window=None, is_causal=False, cache_seqlens=None, **kw):
    L, S = q.shape[-2], k.shape[-2]
    band = reference.band_mask(L, S, is_causal=is_causal, window=window, cache_seqlens=cache_seqlens)
    return ref_attention(q, k, v, band, False, normalizer, alpha, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
def test_window_matches_reference(normalizer, alpha, band, dtype):
    L, S, window, causal = BANDS[band]
    B, H, Hk, E, Ev = 2, 4, 2, 59, 40
    q, k, v, go = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, seed=3, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    a = alpha_for(normalizer, H, alpha, requires_grad=True) if alpha else None
    out = _run(q, k, v, normalizer, a, window=window, is_causal=causal)
    want = _reference(q, k, v, normalizer, a, window=window, is_causal=causal)
    assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), f"{band} out")
    inputs = [q, k, v] + ([a] if a is not None else [])
    got = torch.autograd.grad(out, inputs, go)
    ref = torch.autograd.grad(want, inputs, go.double())
    for name, g, w in zip(("dq", "dk", "dv", "dalpha")[:len(got)], got, ref, strict=True):
        tol = tolerance(dtype, "attention", "gradient")
        if name == "dalpha":
            tol = dalpha_tol(tol, B * L)
        assert_close_tol(g, w, tol, f"{band} {name}")


@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
def test_long_sliding_window_matches_reference(normalizer, alpha):
    """N = 1025, window (256, 0): key blocks that start inside the band,
    tiles wholly inside it (no per-entry mask) and wholly outside (skipped)."""
    B, H, N, E = 1, 2, 1025, 64
    q, k, v, go = make_qkv(B, H, H, N, N, E, E, dtype=torch.float32, seed=5, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    a = alpha_for(normalizer, H, alpha) if alpha else None
    out = _run(q, k, v, normalizer, a, window=(256, 0))
    want = _reference(q, k, v, normalizer, a, window=(256, 0))
    assert_close_tol(out, want, tolerance(torch.float32, "attention", "forward"), "out")
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), go),
                          torch.autograd.grad(want, (q, k, v), go.double()), strict=True):
        assert_close_tol(g, w, tolerance(torch.float32, "attention", "gradient"), name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(300, 300), (2, 300)], ids=["rows", "decode"])
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_window_half_types(normalizer, shape, dtype):
    L, S = shape
    B, H, E = 2, 2, 64
    q, k, v, go = make_qkv(B, H, H, L, S, E, E, dtype=dtype, seed=7, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lengths = torch.tensor([S, S // 2 + 3])
    out = _run(q, k, v, normalizer, None, window=(80, 0), cache_seqlens=lengths)
    want = _reference(q, k, v, normalizer, None, window=(80, 0), cache_seqlens=lengths)
    assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), "out")
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), go),
                          torch.autograd.grad(want, (q, k, v), go.double()), strict=True):
        assert_close_tol(g, w, tolerance(dtype, "attention", "gradient"), name)


@pytest.mark.parametrize("L", [1, 4, 16, 97])
@pytest.mark.parametrize("window", [None, (-1, 0), (30, 0)], ids=["no-window", "causal-lower-right", "window"])
@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
def test_cache_seqlens_matches_reference(normalizer, alpha, window, L):
    """A padded cache: batch element b sees keys [0, lengths[b]), the last
    L of them its own queries' positions when a window aligns to them; a
    length of 0 (nothing to see) gives zeros."""
    B, H, Hk, S, E = 4, 4, 2, 700, 32
    q, k, v, go = make_qkv(B, H, Hk, L, S, E, E, dtype=torch.float64, seed=11, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lengths = torch.tensor([700, 513, 0, 97])
    a = alpha_for(normalizer, H, alpha, requires_grad=True, dtype=torch.float64) if alpha else None
    out = _run(q, k, v, normalizer, a, window=window, cache_seqlens=lengths)
    want = _reference(q, k, v, normalizer, a, window=window, cache_seqlens=lengths)
    assert_close_tol(out, want, tolerance(torch.float64, "attention", "forward"), "out")
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    inputs = [q, k, v] + ([a] if a is not None else [])
    got, ref = torch.autograd.grad(out, inputs, go), torch.autograd.grad(want, inputs, go)
    for name, g, w in zip(("dq", "dk", "dv", "dalpha")[:len(got)], got, ref, strict=True):
        tol = tolerance(torch.float64, "attention", "gradient")
        assert_close_tol(g, w, dalpha_tol(tol, B * L) if name == "dalpha" else tol, name)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_cache_seqlens_equals_exactly_sized_caches(backend):
    """One call over a padded cache gives, per batch element, what a call on
    that element's exactly-sized cache gives (decoding, softmax, float32); the
    reference's mask of cache lengths alone (no window) covers every query."""
    B, H, S, E = 3, 4, 900, 64
    q, k, v = make_qkv(B, H, H, 2, S, E, E, seed=2)
    lengths = torch.tensor([900, 17, 512])
    out = attnkern.attention(q, k, v, cache_seqlens=lengths, backend=backend)
    for b in range(B):
        n = int(lengths[b])
        alone = attnkern.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], backend=backend)
        torch.testing.assert_close(out[b:b + 1], alone, atol=2e-6, rtol=2e-6)


def test_band_mask_has_its_documented_shape():
    # Every combination gives (L, S), or (B, 1, L, S) with cache lengths, even
    # where no term depends on the query (cache lengths alone, no band at all).
    lengths = torch.tensor([2, 5])
    for kw in ({}, {"is_causal": True}, {"window": (1, -1)}):
        assert reference.band_mask(3, 5, **kw).shape == (3, 5)
        assert reference.band_mask(3, 5, cache_seqlens=lengths, **kw).shape == (2, 1, 3, 5)
    assert reference.band_mask(3, 5, cache_seqlens=lengths)[0, 0].tolist() == [[True, True, False, False, False]] * 3


@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
def test_window_gradcheck(normalizer, alpha):
    B, H, L, S, E = 1, 2, 9, 13, 5
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, L, S, E, E, dtype=torch.float64, seed=4))
    a = alpha_for(normalizer, H, alpha, dtype=torch.float64) if alpha else None
    lengths = torch.tensor([11])

    def f(q, k, v):
        return _run(q, k, v, normalizer, a, window=(3, 1), cache_seqlens=lengths)

    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("normalizer,alpha", CASES[:2], ids=CASE_IDS[:2])
def test_causal_bias_objects(normalizer, alpha):
    """CausalBias as attn_mask: upper left is is_causal, lower right the
    window (-1, 0); neither is materialized into a mask."""
    B, H, L, S, E = 2, 2, 37, 90, 16
    q, k, v = make_qkv(B, H, H, L, S, E, E, dtype=torch.float64, seed=8)
    upper = _run(q, k, v, normalizer, None, attn_mask=causal_upper_left(L, S))
    torch.testing.assert_close(upper, _run(q, k, v, normalizer, None, is_causal=True), atol=0, rtol=0)
    lower = _run(q, k, v, normalizer, None, attn_mask=causal_lower_right(L, S))
    torch.testing.assert_close(lower, _run(q, k, v, normalizer, None, window=(-1, 0)), atol=0, rtol=0)
    want = ref_attention(q, k, v, causal_lower_right(L, S)._materialize(), False, normalizer, None)
    assert_close_tol(lower, want, tolerance(torch.float64, "attention", "forward"), "lower right")
    with pytest.raises(ValueError, match="CausalBias for 5 queries"):
        _run(q, k, v, normalizer, None, attn_mask=causal_lower_right(5, S))


@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
def test_window_with_mask_and_dropout(normalizer, alpha):
    """A window intersected with a padding mask, under dropout: the reference
    with the kernel's recorded keep mask."""
    B, H, L, S, E, p = 2, 2, 70, 70, 16, 0.3
    q, k, v, go = make_qkv(B, H, H, L, S, E, E, dtype=torch.float64, seed=6, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    pad[1, ..., 50:] = False
    a = alpha_for(normalizer, H, alpha, dtype=torch.float64) if alpha else None
    torch.manual_seed(3)
    out = _run(q, k, v, normalizer, a, attn_mask=pad, dropout_p=p, window=(12, 4))
    torch.manual_seed(3)
    keep = attention_dropout_mask(B, H, L, S, p, draw_dropout_seed())
    band = reference.band_mask(L, S, window=(12, 4))
    want = ref_attention(q, k, v, pad & band, False, normalizer, a, dropout_p=p, dropout_mask=keep)
    tol = tolerance(torch.float64, "attention", "forward")
    assert_close_tol(out, want, tol, "out")
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), go),
                          torch.autograd.grad(want, (q, k, v), go), strict=True):
        assert_close_tol(g, w, tol, name)


def test_return_weights_follow_the_band():
    B, H, L, S, E = 1, 2, 20, 30, 8
    q, k, v = make_qkv(B, H, H, L, S, E, E, dtype=torch.float64)
    out, w = attnkern.attention(q, k, v, normalizer="sparsemax", window=(4, 0), return_weights=True)
    band = reference.band_mask(L, S, window=(4, 0))
    assert torch.all(w[..., ~band] == 0)
    torch.testing.assert_close(out, _run(q, k, v, "sparsemax", None, window=(4, 0)))


def test_bad_band_arguments_are_named():
    q, k, v = make_qkv(2, 2, 2, 5, 7, 4, 4)
    with pytest.raises(ValueError, match="window sides"):
        attnkern.attention(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match="window must be"):
        attnkern.attention(q, k, v, window=3)
    with pytest.raises(TypeError, match="window must be"):
        attnkern.attention(q, k, v, window=(True, 0))
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        attnkern.attention(q, k, v, cache_seqlens=torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="one length per batch element"):
        attnkern.attention(q, k, v, cache_seqlens=torch.tensor([3]))
    with pytest.raises(TypeError, match="cache_seqlens must be an integer tensor"):
        attnkern.attention(q, k, v, cache_seqlens=torch.tensor([3.0, 2.0]))
    # The op itself checks what reaches it.
    with pytest.raises(ValueError, match="key_lengths"):
        torch.ops.attnkern.attention_fwd(q, k, v, None, False, 0.5, "softmax", None, 0.0, None, -1, -1,
                                         torch.tensor([1, 9]))


def test_unbounded_window_is_the_plain_call():
    q, k, v = make_qkv(1, 2, 2, 33, 33, 8, 8)
    torch.testing.assert_close(attnkern.attention(q, k, v, window=(-1, -1)), attnkern.attention(q, k, v),
                               atol=0, rtol=0)
    # L = S, window (-1, 0): the causal mask, bitwise.
    torch.testing.assert_close(attnkern.attention(q, k, v, window=(-1, 0)), attnkern.attention(q, k, v, is_causal=True),
                               atol=0, rtol=0)


def test_thread_count_does_not_change_banded_results():
    assert_same_with_1_and_2_threads("""
        q, k, v, go = make_qkv(2, 4, 2, 600, 600, 64, 64, seed=1, grad_out=True)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for norm in ("softmax", "sparsemax"):
            out = attnkern.attention(q, k, v, normalizer=norm, enable_gqa=True, window=(130, 3),
                                     cache_seqlens=torch.tensor([600, 333]))
            row += [out] + list(torch.autograd.grad(out, (q, k, v), go))
    """)


def test_opcheck_and_compile_with_a_band():
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 2, 2, 20, 24, 8, 8))
    lengths = torch.tensor([24, 9])
    args = (q.detach(), k.detach(), v.detach(), None, False, 0.3, "sparsemax", None, 0.0, None, 5, 0, lengths)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd.default, args)
    out, shift = torch.ops.attnkern.attention_fwd(*args)
    torch.library.opcheck(torch.ops.attnkern.attention_bwd.default,
                          (torch.ones_like(out),) + args[:8] + (out, shift, False, 0.0, None, 5, 0, lengths))

    def f(q, k, v):
        return attnkern.attention(q, k, v, normalizer="sparsemax", window=(5, 0), cache_seqlens=lengths)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(g, w)


def test_multihead_attention_window():
    """The module's window: the same as its mask spelled out."""
    torch.manual_seed(0)
    m = attnkern.nn.MultiheadAttention(16, 2, batch_first=True, normalizer="sparsemax", window=(3, 0))
    x = torch.randn(2, 20, 16)
    out, _ = m(x, x, x, need_weights=False)
    band = reference.band_mask(20, 20, window=(3, 0))
    m.window = None
    want, _ = m(x, x, x, attn_mask=~band, need_weights=False)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="add_bias_kv"):
        attnkern.nn.MultiheadAttention(16, 2, add_bias_kv=True, window=(3, 0))
