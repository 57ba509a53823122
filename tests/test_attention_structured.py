"""attention(normalizer="fusedmax" | "oscarmax", lam=...): the fused CPU kernels
against the float64 reference (each row of scores through the row-wise
reference of that name), for masks, bands, GQA, dropout, half types and a
learnable λ per head."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_tol, assert_same_with_1_and_2_threads, dalpha_tol, make_qkv

import attnkern
from attnkern.attention import draw_dropout_seed
from attnkern.backends import reference
from attnkern.testing import attention_dropout_mask, tolerance

STRUCTURED = ("fusedmax", "oscarmax")
LAMS = (0.3, 0.0, 1.5, 0.05)


def _lam(H, dtype=torch.float64, requires_grad=False):
    return torch.tensor([LAMS[h % len(LAMS)] for h in range(H)], dtype=dtype).requires_grad_(requires_grad)


def _reference(q, k, v, mask, causal, normalizer, lam, **kw):
    lam = lam.view(-1, 1, 1) if isinstance(lam, torch.Tensor) and lam.dim() == 1 else lam
    return reference.attention(q, k, v, mask, causal, normalizer=normalizer, lam=lam, **kw)


def _padding_mask(B, L, S):
    """Bool (B, 1, L, S): batch 1 loses a run of keys in the middle and the
    last ones (the keys around the run become neighbours), and its first query
    row sees no key at all."""
    m = torch.ones(B, 1, L, S, dtype=torch.bool)
    if B > 1:
        m[1, ..., 5:11] = False
        m[1, ..., S - 3:] = False
        m[1, :, 0, :] = False
    return m


# (B, H, Hk, L, S, E, Ev, kwargs)
CASES = {
    "plain": (2, 4, 4, 19, 23, 16, 8, {}),
    "causal-gqa": (1, 4, 2, 31, 31, 59, 12, {"is_causal": True, "enable_gqa": True}),
    "padding-mask": (2, 2, 2, 17, 29, 8, 8, {"attn_mask": "padding"}),
    "float-mask": (1, 2, 2, 9, 70, 8, 5, {"attn_mask": "float"}),
    "window": (2, 2, 1, 40, 30, 8, 8, {"window": (6, 2), "enable_gqa": True}),
    "one-key": (1, 2, 2, 5, 1, 4, 4, {}),
    "decode": (2, 4, 4, 1, 97, 16, 16, {}),
}


def _case_inputs(case, dtype, seed=0):
    B, H, Hk, L, S, E, Ev, kw = CASES[case]
    q, k, v, go = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, seed=seed, grad_out=True, spread=2.0)
    kw = dict(kw)
    if kw.get("attn_mask") == "padding":
        kw["attn_mask"] = _padding_mask(B, L, S)
    elif kw.get("attn_mask") == "float":
        g = torch.Generator().manual_seed(seed + 1)
        m = torch.randn(B, H, L, S, generator=g, dtype=torch.float64).to(dtype)
        m[..., ::7] = -math.inf
        kw["attn_mask"] = m
    return (B, H, L, S), q, k, v, go, kw


def _ref_kwargs(kw, L, S):
    """The reference's mask and is_causal for attention's keyword arguments."""
    mask, causal = kw.get("attn_mask"), kw.get("is_causal", False)
    if "window" in kw:
        band = reference.band_mask(L, S, window=kw["window"])
        mask = band if mask is None else mask & band
    return mask, causal


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_fused_matches_reference(normalizer, case, dtype):
    (B, H, L, S), q, k, v, go, kw = _case_inputs(case, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lam = _lam(H, requires_grad=True)
    out = attnkern.attention(q, k, v, normalizer=normalizer, lam=lam.to(dtype), backend="cpu", **kw)
    mask, causal = _ref_kwargs(kw, L, S)
    want = _reference(q, k, v, mask, causal, normalizer, lam)
    assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), f"{case} out")
    got = torch.autograd.grad(out, (q, k, v, lam), go)
    ref = torch.autograd.grad(want, (q, k, v, lam), go.double())
    tol = tolerance(dtype, "attention", "gradient")
    for name, g, w in zip(("dq", "dk", "dv", "dlam"), got, ref, strict=True):
        assert_close_tol(g, w, dalpha_tol(tol, B * L) if name == "dlam" else tol, f"{case} {name}")


@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_gradcheck_in_every_input_and_lam(normalizer):
    q, k, v = make_qkv(1, 2, 2, 6, 9, 4, 3, dtype=torch.float64, seed=4, spread=2.0)
    lam = torch.tensor([0.2, 0.7], dtype=torch.float64)
    mask = torch.ones(1, 1, 6, 9, dtype=torch.bool)
    mask[..., 3:5] = False

    def f(q, k, v, lam):
        return attnkern.attention(q, k, v, mask, normalizer=normalizer, lam=lam, backend="cpu")

    torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in (q, k, v, lam)))


@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_lam_zero_is_sparsemax(normalizer):
    q, k, v, go = make_qkv(2, 2, 2, 33, 40, 16, 8, dtype=torch.float64, seed=2, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnkern.attention(q, k, v, normalizer=normalizer, lam=0.0, is_causal=True)
    want = attnkern.attention(q, k, v, normalizer="sparsemax", is_causal=True)
    torch.testing.assert_close(out, want)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go), strict=True):
        torch.testing.assert_close(g, w)


def test_large_lam_fuses_every_allowed_key():
    """fusedmax with a λ far above the scores' spread: one segment, uniform
    weights over each row's allowed keys."""
    q, k, v = make_qkv(1, 1, 1, 8, 12, 4, 4, dtype=torch.float64, seed=5)
    mask = torch.ones(8, 12, dtype=torch.bool)
    mask[:, 4:7] = False
    _, w = attnkern.attention(q, k, v, mask, normalizer="fusedmax", lam=1e4, return_weights=True)
    torch.testing.assert_close(w[..., mask], torch.full_like(w[..., mask], 1 / 9))
    out = attnkern.attention(q, k, v, mask, normalizer="fusedmax", lam=1e4)
    torch.testing.assert_close(out, v[..., mask[0], :].mean(-2, keepdim=True).expand_as(out))


@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_fully_masked_rows_give_zeros(normalizer):
    q, k, v, go = make_qkv(1, 2, 2, 5, 7, 4, 4, dtype=torch.float32, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    lam = torch.tensor([0.5, 1.0], requires_grad=True)
    out = attnkern.attention(q, k, v, mask, normalizer=normalizer, lam=lam)
    assert torch.all(out[..., 2, :] == 0) and not out.isnan().any()
    grads = torch.autograd.grad(out, (q, k, v, lam), go)
    assert all(not g.isnan().any() for g in grads)
    assert torch.all(grads[0][..., 2, :] == 0)


@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_dropout_matches_reference_with_the_recorded_mask(normalizer):
    B, H, L, S, E, p = 2, 2, 30, 37, 8, 0.3
    q, k, v, go = make_qkv(B, H, H, L, S, E, E, dtype=torch.float64, seed=6, grad_out=True, spread=2.0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lam = _lam(H, requires_grad=True)
    torch.manual_seed(3)
    out = attnkern.attention(q, k, v, dropout_p=p, is_causal=True, normalizer=normalizer, lam=lam)
    torch.manual_seed(3)
    keep = attention_dropout_mask(B, H, L, S, p, draw_dropout_seed())
    want = _reference(q, k, v, None, True, normalizer, lam, dropout_p=p, dropout_mask=keep)
    tol = tolerance(torch.float64, "attention", "forward")
    assert_close_tol(out, want, tol, "out")
    for name, g, w in zip(("dq", "dk", "dv", "dlam"), torch.autograd.grad(out, (q, k, v, lam), go),
                          torch.autograd.grad(want, (q, k, v, lam), go), strict=True):
        assert_close_tol(g, w, tol, name)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("supports", ["small", "small-then-wide"])
def test_fusedmax_backward_over_small_supports(supports, dropout_p):
    """fusedmax's backward walks the supports alone when every row's is small
    (peaked scores); when the rows of a block turn wide part way (flat scores
    in its later rows), it solves the block again over every key. Both
    against the reference, through the recorded dropout mask."""
    B, H, L, S, E = 1, 2, 80, 300, 16
    g = torch.Generator().manual_seed(11)
    q, k, v, go = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (L, S, S, L))
    q = q * 6.0
    if supports == "small-then-wide":
        q[:, :, L // 2:] *= 1e-3
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lam = torch.tensor([0.05, 0.3], dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    out, w = attnkern.attention(q, k, v, normalizer="fusedmax", lam=lam, dropout_p=dropout_p, return_weights=True)
    support = (w != 0).sum(-1)
    assert support[..., : L // 2].max() < S // 8
    if supports == "small-then-wide":
        assert support[..., L // 2:].min() > S // 2
    torch.manual_seed(5)
    fused = attnkern.attention(q, k, v, normalizer="fusedmax", lam=lam, dropout_p=dropout_p)
    keep = None
    if dropout_p:
        torch.manual_seed(5)
        keep = attention_dropout_mask(B, H, L, S, dropout_p, draw_dropout_seed())
    want = _reference(q, k, v, None, False, "fusedmax", lam, dropout_p=dropout_p, dropout_mask=keep)
    tol = tolerance(torch.float64, "attention", "forward")
    assert_close_tol(fused, want, tol, "out")
    for name, got, ref in zip(("dq", "dk", "dv", "dlam"), torch.autograd.grad(fused, (q, k, v, lam), go),
                              torch.autograd.grad(want, (q, k, v, lam), go), strict=True):
        assert_close_tol(got, ref, tol, name)


def test_fusedmax_backward_finds_supports_below_the_threshold():
    """fusedmax's backward solves each row again, its search narrowed by the
    threshold the forward saved: a fused segment of the support may hold
    entries whose scores lie below that threshold, positions away from any
    entry above it (here a valley of 1s between two 3s, fused at λ = 1.2 into
    one segment of weight 1/6 each, threshold 1.1). Scores set exactly through
    E = 1 and scale 1."""
    scores = torch.full((96,), -5.0, dtype=torch.float64)
    scores[40:46] = torch.tensor([3.0, 1.0, 1.0, 1.0, 1.0, 3.0], dtype=torch.float64)
    k = scores.view(1, 1, -1, 1).clone().requires_grad_()
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 96, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
    go = torch.randn(1, 1, 1, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lam = torch.tensor([1.2], dtype=torch.float64, requires_grad=True)
    _, w = attnkern.attention(q, k, v, scale=1.0, normalizer="fusedmax", lam=lam, return_weights=True)
    torch.testing.assert_close(w[0, 0, 0, 40:46], torch.full((6,), 1 / 6, dtype=torch.float64))
    out = attnkern.attention(q, k, v, scale=1.0, normalizer="fusedmax", lam=lam)
    want = _reference(q, k, v, None, False, "fusedmax", lam, scale=1.0)
    tol = tolerance(torch.float64, "attention", "forward")
    for name, got, ref in zip(("dq", "dk", "dv", "dlam"), torch.autograd.grad(out, (q, k, v, lam), go),
                              torch.autograd.grad(want, (q, k, v, lam), go), strict=True):
        assert_close_tol(got, ref, tol, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_half_types(normalizer, dtype):
    """Half-type inputs against the reference on the same (rounded) inputs."""
    (B, H, L, S), q, k, v, go, kw = _case_inputs("causal-gqa", dtype, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnkern.attention(q, k, v, normalizer=normalizer, lam=0.4, **kw)
    assert out.dtype == dtype
    want = _reference(q, k, v, None, True, normalizer, 0.4)
    assert_close_tol(out, want, tolerance(dtype, "attention", "forward"), "out")
    tol = tolerance(dtype, "attention", "gradient")
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), go),
                          torch.autograd.grad(want, (q, k, v), go.double()), strict=True):
        assert g.dtype == dtype
        assert_close_tol(g, w, tol, name)


@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_lam_per_batch_and_head(normalizer):
    """λ broadcast to (B, H, 1, 1) (folded into the heads by attention)."""
    q, k, v = make_qkv(2, 3, 3, 11, 13, 8, 8, dtype=torch.float64, seed=8, spread=2.0)
    lam = torch.tensor([[0.1, 0.5, 2.0], [0.0, 1.0, 0.3]], dtype=torch.float64).view(2, 3, 1, 1)
    out = attnkern.attention(q, k, v, normalizer=normalizer, lam=lam)
    torch.testing.assert_close(out, _reference(q, k, v, None, False, normalizer, lam))


@pytest.mark.parametrize("normalizer", STRUCTURED)
def test_return_weights_and_unfused_agree(normalizer):
    q, k, v = make_qkv(1, 2, 2, 16, 21, 8, 8, dtype=torch.float32, seed=9, spread=2.0)
    lam = torch.tensor([0.2, 0.9])
    out, w = attnkern.attention(q, k, v, normalizer=normalizer, lam=lam, is_causal=True, return_weights=True)
    fused = attnkern.attention(q, k, v, normalizer=normalizer, lam=lam, is_causal=True)
    torch.testing.assert_close(out, fused, rtol=1e-5, atol=1e-5)
    assert torch.all(w.triu(1) == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 16))


def test_arguments_are_checked_and_named():
    q, k, v = make_qkv(1, 2, 2, 5, 7, 4, 4)
    with pytest.raises(ValueError, match="lam is only used"):
        attnkern.attention(q, k, v, normalizer="sparsemax", lam=0.5)
    with pytest.raises(ValueError, match="alpha is only used"):
        attnkern.attention(q, k, v, normalizer="fusedmax", alpha=1.5)
    with pytest.raises(ValueError, match="lam must be finite and >= 0"):
        attnkern.attention(q, k, v, normalizer="fusedmax", lam=-0.1)
    with pytest.raises(ValueError, match="lam must be finite and >= 0"):
        attnkern.attention(q, k, v, normalizer="oscarmax", lam=torch.tensor([0.1, float("nan")]))
    with pytest.raises(ValueError, match="lam of shape"):
        attnkern.attention(q, k, v, normalizer="oscarmax", lam=torch.ones(3))
    # (float32 inputs: the kernels take λ in float32, where 1e308 would be inf.)
    with pytest.raises(ValueError, match="lam must be at most 3.403e[+]38"):
        attnkern.attention(q, k, v, normalizer="fusedmax", lam=1e308)
    with pytest.raises(ValueError, match="lam must be at most"):
        attnkern.attention(q, k, v, normalizer="oscarmax", lam=torch.tensor([1.0, 1e300], dtype=torch.float64))
    with pytest.raises(ValueError, match="normalizer must be one of"):
        attnkern.attention(q, k, v, normalizer="fusemax")
    with pytest.raises(NotImplementedError, match="CPU kernels only"):
        attnkern.attention(q, k, v, normalizer="fusedmax", backend="triton")
    # The op checks what reaches it.
    with pytest.raises(RuntimeError, match="need lam"):
        torch.ops.attnkern.attention_fwd(q, k, v, None, False, 0.5, "fusedmax", None)
    with pytest.raises(ValueError, match="lam must be finite"):
        torch.ops.attnkern.attention_fwd(q, k, v, None, False, 0.5, "oscarmax", torch.tensor([1.0, -1.0]))


def test_default_lam_is_one():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 4, 4, dtype=torch.float64, seed=10, spread=3.0)
    torch.testing.assert_close(attnkern.attention(q, k, v, normalizer="fusedmax"),
                               attnkern.attention(q, k, v, normalizer="fusedmax", lam=1.0), atol=0, rtol=0)


def test_opcheck_and_compile():
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 2, 2, 12, 15, 8, 8))
    lam = torch.tensor([0.3, 0.8])
    args = (q.detach(), k.detach(), v.detach(), None, True, 0.3, "fusedmax", lam)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd.default, args)
    out, shift = torch.ops.attnkern.attention_fwd(*args)
    torch.library.opcheck(torch.ops.attnkern.attention_bwd.default,
                          (torch.ones_like(out),) + args + (out, shift, True))

    def f(q, k, v, lam):
        return attnkern.attention(q, k, v, is_causal=True, normalizer="oscarmax", lam=lam)

    lam_l = lam.clone().requires_grad_()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, lam_l), f(q, k, v, lam_l)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v, lam_l)),
                    torch.autograd.grad(want.sum(), (q, k, v, lam_l)), strict=True):
        torch.testing.assert_close(g, w)


def test_thread_count_does_not_change_results():
    assert_same_with_1_and_2_threads("""
        q, k, v, go = make_qkv(2, 4, 2, 300, 300, 32, 32, seed=1, grad_out=True, spread=2.0)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        lam = torch.tensor([0.05, 0.2, 0.0, 1.0], requires_grad=True)
        for norm in ("fusedmax", "oscarmax"):
            out = attnkern.attention(q, k, v, normalizer=norm, lam=lam, enable_gqa=True, is_causal=True,
                                     dropout_p=0.1)
            row += [out] + list(torch.autograd.grad(out, (q, k, v, lam), go))
    """)


@pytest.mark.parametrize("lam", [0.3, "learnable"])
def test_multihead_attention_with_fusedmax(lam):
    """The module's fused path against its need_weights (row-wise) path, and a
    learnable λ per head that receives a gradient."""
    torch.manual_seed(0)
    m = attnkern.nn.MultiheadAttention(16, 2, batch_first=True, normalizer="fusedmax", lam=lam, lam_init=0.5)
    x = torch.randn(3, 10, 16)
    out, _ = m(x, x, x, need_weights=False, is_causal=True)
    out_w, w = m(x, x, x, need_weights=True, attn_mask=torch.ones(10, 10, dtype=torch.bool).triu(1),
                 average_attn_weights=False)
    torch.testing.assert_close(out, out_w, rtol=1e-5, atol=1e-5)
    assert torch.all(w.triu(1) == 0)
    if lam == "learnable":
        torch.testing.assert_close(m.lam, torch.full((2,), 0.5))
        out.sum().backward()
        assert m.lam_log.grad is not None and m.lam_log.grad.abs().sum() > 0
    else:
        assert m.lam == 0.3 and m.lam_log is None
    with pytest.raises(ValueError, match="lam is only used"):
        attnkern.nn.MultiheadAttention(16, 2, normalizer="softmax", lam=0.5)
    with pytest.raises(ValueError, match="lam must be"):
        attnkern.nn.MultiheadAttention(16, 2, normalizer="oscarmax", lam=-1.0)
