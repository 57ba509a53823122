"""Triton fused attention (attnkern.backends.triton) against a float64 reference.

With a GPU the kernels are compiled and run on CUDA tensors. Without one they
run on CPU tensors in Triton's interpreter, which triton enables only if
TRITON_INTERPRET=1 is set before triton is first imported: tests/conftest.py
sets it, and `import attnkern` never imports triton. Every tensor of these
tests is made on DEVICE (attnkern.testing.triton_test_device), so the suite is
correct on either kind of host; the module skips with the reason when neither
can run. The interpreter is slow: shapes are small, with odd sizes.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys

import pytest
import torch
from helpers import KERNEL_ALPHAS, NORMALIZERS, alpha_for, kernel_mask, make_qkv, ref_attention

from attnkern.backends import reference
from attnkern.testing import tolerance, triton_test_device

triton = pytest.importorskip("triton", reason="triton is not installed")

from attnkern.backends import triton as tb  # noqa: E402

# Every test here runs the Triton kernels: on a GPU, what benchmarks/gpu_check.py selects (-m gpu).
pytestmark = pytest.mark.gpu

DEVICE, _why = triton_test_device()
if DEVICE is None:
    pytest.skip(f"the Triton kernels cannot run here: {_why}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _on_device():
    """Tensor factories (torch.zeros, torch.tensor, ...) make tensors on DEVICE."""
    with torch.device(DEVICE):
        yield


# The helpers' inputs and masks, made on DEVICE.
make_inputs = functools.partial(make_qkv, grad_out=True, device=DEVICE)
make_mask = functools.partial(kernel_mask, device=DEVICE)


def check_against_reference(q, k, v, do, mask, is_causal, scale, normalizer, alpha, *, backward=True,
                            alpha_grad=False):
    out, shift = tb.attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    assert shift.dtype == torch.float32 and shift.shape == q.shape[:3]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    a64 = alpha.double().requires_grad_() if alpha is not None else None
    ref = ref_attention(q64, k64, v64, mask, is_causal, normalizer, a64, scale)
    # The forward rule, for dq, dk and dv too: the launchers meet it, tighter than the gradient rule.
    tol = tolerance(q.dtype, "attention", "forward")
    torch.testing.assert_close(out.double(), ref, **tol)
    assert not torch.isnan(shift).any()
    if not backward:
        return out, shift
    ref.backward(do.double())
    dq, dk, dv, dalpha = tb.attention_bwd(do, q, k, v, mask, is_causal, scale, normalizer, alpha, out, shift,
                                          alpha_grad)
    for name, got, want, like in (("dq", dq, q64.grad, q), ("dk", dk, k64.grad, k), ("dv", dv, v64.grad, v)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    if alpha_grad:
        assert dalpha.dtype == torch.float32 and dalpha.shape == alpha.shape
        # dα to a tighter rtol than the gradient rule's (1e-3 in float32): the bound it always had.
        torch.testing.assert_close(dalpha.double(), a64.grad, rtol=1e-4 if q.dtype == torch.float32 else 1e-6,
                                   atol=1e-4 if q.dtype == torch.float32 else 1e-6)
    else:
        assert dalpha.numel() == 0
    return out, shift


# --- values -------------------------------------------------------------------

# (B, H, Hk, L, S, E, Ev, mask kind): odd lengths, head dims that are not powers
# of two, Ev != E, GQA, every mask kind.
CASES = [
    (1, 2, 1, 1, 1, 16, 16, "none"),
    (1, 2, 2, 17, 97, 59, 16, "float"),
    (1, 2, 1, 97, 17, 64, 33, "causal"),
    (2, 2, 1, 17, 17, 16, 59, "empty_rows"),
    (1, 2, 1, 33, 21, 59, 24, "none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hk{}-L{}S{}-E{}Ev{}-{}".format(*c))
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_matches_reference(normalizer, case):
    B, H, Hk, L, S, E, Ev, kind = case
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev)
    mask, causal = make_mask(kind, B, H, L, S)
    check_against_reference(q, k, v, do, mask, causal, 0.4, normalizer, alpha_for(normalizer, H, KERNEL_ALPHAS),
                            alpha_grad=normalizer == "entmax" and kind != "empty_rows")


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_float64(normalizer):
    B, H, Hk, L, S, E, Ev = 1, 4, 2, 13, 29, 16, 7
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, dtype=torch.float64)
    mask, _ = make_mask("float", B, H, L, S, dtype=torch.float64)
    # α < 1, α = 1, 1 < α < 2 and α > 2 (Newton safeguarded by bisection).
    alpha = alpha_for(normalizer, H, values=(0.75, 1.0, 1.3, 2.5))
    # shift is float32 by contract, so the backward sees p to float32 resolution.
    out, shift = tb.attention_fwd(q, k, v, mask, True, 0.7, normalizer, alpha)
    q64, k64, v64 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    a64 = alpha.double().requires_grad_() if alpha is not None else None
    ref = ref_attention(q64, k64, v64, mask, True, normalizer, a64, 0.7)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # float64 end to end: far below the rule
    ref.backward(do)
    dq, dk, dv, dalpha = tb.attention_bwd(do, q, k, v, mask, True, 0.7, normalizer, alpha, out, shift,
                                          normalizer == "entmax")
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)  # float32 shift: not the float64 rule
    if normalizer == "entmax":
        torch.testing.assert_close(dalpha.double(), a64.grad, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15"])
def test_long_rows(normalizer):
    # More than two key and query blocks (64 under the interpreter), causal.
    B, H, Hk, L, S, E, Ev = 1, 1, 1, 150, 150, 16, 16
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=3)
    check_against_reference(q, k, v, do, None, True, 0.5, normalizer, None)


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax"])
def test_support_in_few_key_blocks(normalizer):
    # Scores raised on keys 70-89 only: every row's support lies in the second and
    # third of three key blocks, so the threshold search and P·V skip the others.
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 20, 150, 16, 8
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=11)
    mask = torch.zeros(1, 1, 1, S)
    mask[..., 70:90] = 8.0
    mask[..., 140:] = -math.inf
    check_against_reference(q, k, v, do, mask, False, 0.3, normalizer, alpha_for(normalizer, H, (1.5, 2.5)),
                            alpha_grad=normalizer == "entmax")


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_small_probabilities_in_other_key_blocks(normalizer):
    # Scores made exactly: s_j = k_j[0] with q = e_0. The support {5, 100, 140}
    # spans three key blocks and the middle block's only entry has small p
    # (sparsemax 0.22), so a block-skipping test that is off drops it.
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 2, 150, 16, 8
    q = torch.zeros(B, H, L, E)
    q[..., 0] = 1.0
    k = torch.zeros(B, Hk, S, E)
    k[..., 0] = -3.0
    k[..., 5, 0], k[..., 100, 0], k[..., 140, 0] = 1.0, 0.8, 0.95
    q[:, :, 1, 0] = 2.0  # a second row, more peaked
    _, _, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=12)
    check_against_reference(q, k, v, do, None, False, 1.0, normalizer, alpha_for(normalizer, H, (1.25, 3.0)),
                            alpha_grad=normalizer == "entmax")


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", ["softmax", "entmax"])
def test_long_rows_slow(normalizer):
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 131, 200, 59, 16
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=4)
    mask, _ = make_mask("float", B, H, L, S)
    check_against_reference(q, k, v, do, mask, False, 0.5, normalizer, alpha_for(normalizer, H, KERNEL_ALPHAS),
                            alpha_grad=normalizer == "entmax")


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_ties(normalizer):
    # Integer scores with many exact ties (duplicated keys, rows of equal scores).
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 9, 12, 16, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-2, 3, (B, H, L, E), generator=g, device="cpu").float().to(DEVICE)
    k = torch.randint(-2, 3, (B, Hk, S // 3, E), generator=g, device="cpu").float().repeat(1, 1, 3, 1).to(DEVICE)
    q[0, 0, 0] = 0.0  # a row of all-equal scores
    _, _, v, do = make_inputs(B, H, Hk, L, S, E, Ev)
    check_against_reference(q, k, v, do, None, False, 0.25, normalizer, alpha_for(normalizer, H, KERNEL_ALPHAS))


@pytest.mark.parametrize("alpha", [(1.0, 1.0 + 5e-7), (1.7, 0.6), (1.0005, 0.9995)])
def test_entmax_alpha_near_one_and_below(alpha):
    # Every α next to 1 gets its own map (only α = 1 is softmax); α < 1 is dense;
    # for |α - 1| < 1e-3 the float32 α-gradient is checked loosely.
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 7, 19, 16, 5
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=6)
    near = abs(alpha[0] - 1) > 1e-6
    check_against_reference(q, k, v, do, None, False, 0.5, "entmax", torch.tensor(alpha), alpha_grad=not near)
    if near:
        out, shift = tb.attention_fwd(q, k, v, None, False, 0.5, "entmax", torch.tensor(alpha))
        a64 = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
        ref = ref_attention(q.double(), k.double(), v.double(), None, False, "entmax", a64, 0.5)
        ref.backward(do.double())
        dalpha = tb.attention_bwd(do, q, k, v, None, False, 0.5, "entmax", torch.tensor(alpha), out, shift,
                                  True)[3]
        torch.testing.assert_close(dalpha.double(), a64.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("alpha", [3.0, 10.0, 20.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_alpha_against_the_mpmath_oracle(alpha, dtype):
    # Rows whose smaller leaders sit at p = 1e-4-1e-2, where the shift form has
    # no resolution left (issue 27): the targets of tests/test_edges_oracle.py.
    import mp_oracle as oracle

    L, S, Ev, scale = 4, 12, 6, 0.5
    q, k, v, dout = (t.to(dtype).to(DEVICE) for t in oracle.near_tied_attention(
        torch.Generator().manual_seed(4), alpha, L, S, Ev, scale))
    a = torch.full((2,), alpha)
    out, shift = tb.attention_fwd(q, k, v, None, False, scale, "entmax", a)
    dq, dk, dv, dalpha = tb.attention_bwd(dout, q, k, v, None, False, scale, "entmax", a, out, shift, True)
    for h in range(2):
        with torch.device("cpu"):  # the oracle makes its own tensors, beside these CPU copies
            o, eq, ek, ev, da = oracle.attention(*(t[0, h].cpu() for t in (q, k, v, dout)), alpha, scale)
        out_tol = (1e-6 if dtype == torch.float32 else 1e-11) * max(1.0, o.abs().max().item())
        assert (out[0, h].cpu().double() - o).abs().max() <= out_tol, h
        for name, got, exact in (("dq", dq, eq), ("dk", dk, ek), ("dv", dv, ev)):
            err = (got[0, h].cpu().double() - exact).abs().max()
            assert err <= 1e-3 * exact.abs().max().clamp_min(1e-30), (name, h, float(err))
        assert abs(float(dalpha[h]) - da) <= 1e-3 * max(1.0, abs(da)), (h, float(dalpha[h]), da)


def test_float32_sparsemax_long_rows_as_accurate_as_softmax():
    # Near-uniform scores over S = 4096 keys (issue 27): sparsemax's p ~ 1/S must
    # keep its own precision, within 2x the error float32 softmax makes here.
    g = torch.Generator().manual_seed(5)
    L, S, E, Ev = 4, 4096, 16, 8
    q = 1e-3 * torch.randn(1, 1, L, E, generator=g, device=g.device, dtype=torch.float64)
    k, v, do = (torch.randn(1, 1, n, d, generator=g, device=g.device, dtype=torch.float64)
                for n, d in ((S, E), (S, Ev), (L, Ev)))
    q32, k32, v32, do32 = (t.float().to(DEVICE) for t in (q, k, v, do))
    errs = {}
    for normalizer in ("softmax", "sparsemax"):
        q64, k64, v64 = (t.float().double().requires_grad_() for t in (q, k, v))
        ref = ref_attention(q64, k64, v64, None, False, normalizer, None, E**-0.5)
        ref.backward(do.float().double())
        out, shift = tb.attention_fwd(q32, k32, v32, None, False, E**-0.5, normalizer, None)
        grads = tb.attention_bwd(do32, q32, k32, v32, None, False, E**-0.5, normalizer, None, out, shift, False)[:3]
        errs[normalizer] = [((out.cpu().double() - ref.detach()).abs().max() / ref.detach().abs().max()).item()] + [
            ((a.cpu().double() - b.grad).abs().max() / b.grad.abs().max()).item()
            for a, b in zip(grads, (q64, k64, v64), strict=True)]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert errs["sparsemax"][i] <= 2 * errs["softmax"][i] + 1e-7, (what, errs)


# --- invariants and edge cases -------------------------------------------------


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_probabilities_via_identity_values(normalizer):
    # With v = I the output rows are the probabilities themselves.
    B, H, Hk, L, S, E = 1, 2, 1, 11, 23, 16
    q, k, _, _ = make_inputs(B, H, Hk, L, S, E, 1, seed=7)
    q = q * 2
    v = torch.eye(S).expand(B, Hk, S, S)
    alpha = alpha_for(normalizer, H, KERNEL_ALPHAS)
    p, shift = tb.attention_fwd(q, k, v, None, False, 1.0, normalizer, alpha)
    ref = ref_attention(q.double(), k.double(), v.double(), None, False, normalizer,
                        alpha.double() if alpha is not None else None, 1.0)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(B, H, L), rtol=0, atol=2e-5)
    if normalizer in ("sparsemax", "entmax15"):
        # Exact zeros outside the support, and the same support as the reference.
        assert torch.equal(p > 0, ref > 1e-6)
        assert (p == 0).any()
    torch.testing.assert_close(p.double(), ref, **tolerance(torch.float32, "attention", "forward"))
    # The shift reproduces p: softmax c = log-sum-exp.
    if normalizer == "softmax":
        s = reference.attention_scores(q.double(), k.double(), scale=1.0)
        # The float32 shift to about its rounding: tighter than the output rule.
        torch.testing.assert_close(shift.double(), torch.logsumexp(s, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_fully_masked_rows_give_zeros(normalizer):
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 5, 6, 16, 4
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=8)
    mask = torch.zeros(B, H, L, S)
    mask[:, :, 1] = -math.inf
    mask[:, 1, 3] = -math.inf
    alpha = alpha_for(normalizer, H, values=(1.3, 2.5))
    out, shift = tb.attention_fwd(q, k, v, mask, False, 1.0, normalizer, alpha)
    assert torch.equal(out[:, :, 1], torch.zeros(B, H, Ev)) and torch.equal(out[:, 1, 3], torch.zeros(B, Ev))
    assert torch.isinf(shift[:, :, 1]).all() and (shift[:, :, 1] > 0).all()
    assert torch.isfinite(shift[:, 0, 3]).all()
    dq, dk, dv, dalpha = tb.attention_bwd(do, q, k, v, mask, False, 1.0, normalizer, alpha, out, shift,
                                          normalizer == "entmax")
    for t in (dq, dk, dv, dalpha):
        assert torch.isfinite(t).all()
    assert torch.equal(dq[:, :, 1], torch.zeros(B, H, E))
    # Everything masked: no NaN anywhere, all zeros.
    mask = torch.full((1, 1, 1, 1), -math.inf).expand(B, H, L, S)
    out, shift = tb.attention_fwd(q, k, v, mask, False, 1.0, normalizer, alpha)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(shift).all()
    grads = tb.attention_bwd(do, q, k, v, mask, False, 1.0, normalizer, alpha, out, shift, False)
    for t in grads[:3]:
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_nan_stays_in_its_row(normalizer):
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 6, 9, 16, 4
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, seed=13)
    q[0, 0, 2, 3] = math.nan
    alpha = alpha_for(normalizer, H, (1.5, 2.5))
    out, shift = tb.attention_fwd(q, k, v, None, False, 0.5, normalizer, alpha)
    nan_rows = torch.zeros(B, H, L, dtype=torch.bool)
    nan_rows[0, 0, 2] = True
    assert torch.equal(out.isnan().any(-1), nan_rows) and out[nan_rows].isnan().all()
    assert torch.equal(shift.isnan(), nan_rows)
    dq = tb.attention_bwd(do, q, k, v, None, False, 0.5, normalizer, alpha, out, shift, False)[0]
    assert torch.equal(dq.isnan().any(-1), nan_rows)


def test_any_strides_and_broadcast_mask():
    # q, k, v as transposed views of (B, seq, heads, dim) buffers, a mask broadcast
    # from (L, S) (stride 0 over batch and heads), grad_out non-contiguous.
    B, H, Hk, L, S, E, Ev = 2, 2, 1, 10, 13, 16, 12
    q0, k0, v0, do0 = make_inputs(B, H, Hk, L, S, E, Ev, seed=9)
    q = q0.transpose(1, 2).contiguous().transpose(1, 2)
    k = k0.transpose(1, 2).contiguous().transpose(1, 2)
    v = v0[..., :Ev].transpose(-1, -2).contiguous().transpose(-1, -2)
    do = do0.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous() and not v.is_contiguous()
    mask = torch.randn(L, S).masked_fill(torch.eye(L, S, dtype=torch.bool), -math.inf)
    check_against_reference(q, k, v, do, mask, False, 0.3, "entmax15", None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_forward(dtype):
    B, H, Hk, L, S, E, Ev = 1, 2, 1, 9, 21, 16, 8
    q, k, v, do = make_inputs(B, H, Hk, L, S, E, Ev, dtype=dtype, seed=10)
    for normalizer in ("softmax", "sparsemax"):
        out, shift = tb.attention_fwd(q, k, v, None, True, 0.5, normalizer, None)
        assert out.dtype == dtype and shift.dtype == torch.float32
        ref = ref_attention(q.double(), k.double(), v.double(), None, True, normalizer, None, 0.5)
        torch.testing.assert_close(out.double(), ref, **tolerance(dtype, "attention", "forward"))
        grads = tb.attention_bwd(do, q, k, v, None, True, 0.5, normalizer, None, out, shift, False)
        assert all(t.dtype == dtype and torch.isfinite(t).all() for t in grads[:3])


# --- API ------------------------------------------------------------------------


def test_available_and_errors(monkeypatch):
    assert tb.available() == (True, "")
    q, k, v, _ = make_inputs(1, 2, 1, 3, 4, 16, 16)
    with pytest.raises(ValueError, match="multiple"):
        tb.attention_fwd(q, k.expand(1, 3, 4, 16), v.expand(1, 3, 4, 16), None, False, 1.0, "softmax", None)
    with pytest.raises(ValueError, match="normalizer"):
        tb.attention_fwd(q, k, v, None, False, 1.0, "relu", None)
    with pytest.raises(ValueError, match="alpha"):
        tb.attention_fwd(q, k, v, None, False, 1.0, "entmax", None)
    with pytest.raises(TypeError, match="mask"):
        tb.attention_fwd(q, k, v, torch.ones(3, 4, dtype=torch.bool), False, 1.0, "softmax", None)
    if DEVICE == "cpu":  # CPU tensors run only in the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            tb.attention_fwd(q, k, v, None, False, 1.0, "softmax", None)


tl = triton.language


@triton.jit
def _mask_offsets_probe(Out, m0, n0, stride_mm, stride_mn, BM: tl.constexpr, BN: tl.constexpr):
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    o = _K._mask_offsets(offs_m, offs_n, stride_mm, stride_mn)
    tl.store(Out + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], o)


def test_scales_reach_the_kernels_at_full_width():
    # Triton passes a Python float as float32: the launchers split the softmax
    # scale (and dropout's) into a float32 head and rest, which the kernels add
    # in their accumulation dtype, so float64 attention keeps a float64 scale.
    import struct

    from attnkern.backends.triton.attention import _split

    for x in (0.7, 1 / math.sqrt(59), 0.125, 1 / (1 - 0.3), 3e-5):
        head, rest = _split(x)
        for part in (head, rest):
            assert struct.unpack("f", struct.pack("f", part))[0] == part
        assert abs((head + rest) - x) <= 2.0**-46 * x
        assert abs(head - x) > 2.0**-46 * x or rest == 0.0


def test_mask_offsets_are_64_bit():
    # A mask of L·S ≥ 2³¹ entries per head (8 GiB in float32) cannot be allocated
    # here: check the offset arithmetic of the kernels itself, with row offsets
    # and strides whose products pass 2³¹ (and 2³²), against Python's integers.
    global _K
    _K = importlib.import_module("attnkern.backends.triton.attention")._kernels()
    BM, BN = 16, 16
    for m0, n0, smm, smn in ((2**16, 5, 2**16 + 3, 1), (70000, 2**20, 40000, 7), (5, 3, 1, 2**27 + 1)):
        out = torch.empty(BM, BN, dtype=torch.int64)
        _mask_offsets_probe[(1,)](out, m0, n0, smm, smn, BM=BM, BN=BN)
        m = torch.arange(m0, m0 + BM, dtype=torch.int64)[:, None]
        n = torch.arange(n0, n0 + BN, dtype=torch.int64)[None, :]
        assert torch.equal(out, m * smm + n * smn), (m0, n0, smm, smn)
        assert out.max() >= 2**31


def test_imports_without_triton(monkeypatch):
    # The package imports and reports why not when triton is missing.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "attnkern.backends.triton")
    fresh = importlib.import_module("attnkern.backends.triton")
    try:
        ok, why = fresh.available()
        assert not ok and "triton" in why
        assert fresh.register_as_cuda_impl() is False
    finally:
        monkeypatch.undo()
        importlib.import_module("attnkern.backends.triton")


def test_register_as_cuda_impl_on_a_scratch_namespace():
    # The real attnkern ops may not exist in this build: define the same schemas
    # on a scratch namespace, register on DEVICE's key and call through the dispatcher.
    assert tb.register_as_cuda_impl("attnkern_no_such_namespace") is False
    lib = torch.library.Library("attnkern_triton_test", "DEF")
    lib.define("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, "
               "str normalizer, Tensor? alpha) -> (Tensor out, Tensor shift)")
    lib.define("attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, "
               "float scale, str normalizer, Tensor? alpha, Tensor out, Tensor shift, bool alpha_grad) "
               "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dalpha)")
    key = "CPU" if DEVICE == "cpu" else "CUDA"
    assert tb.register_as_cuda_impl("attnkern_triton_test", key) is True
    assert tb.register_as_cuda_impl("attnkern_triton_test", key) is True  # idempotent
    ops = torch.ops.attnkern_triton_test
    q, k, v, do = make_inputs(1, 2, 1, 5, 7, 16, 8)
    alpha = torch.tensor([1.5, 1.2])
    out, shift = ops.attention_fwd(q, k, v, None, True, 0.25, "entmax", alpha)
    want_out, want_shift = tb.attention_fwd(q, k, v, None, True, 0.25, "entmax", alpha)
    assert torch.equal(out, want_out) and torch.equal(shift, want_shift)
    dq, dk, dv, dalpha = ops.attention_bwd(do, q, k, v, None, True, 0.25, "entmax", alpha, out, shift, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dalpha.shape == (2,)


_COMPILE_SCRIPT = r"""
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnkern.backends.triton import kernels as K
from attnkern.backends.triton.attention import _NSETS

assert not K.INTERPRETED
dt = sys.argv[1]
acc = tl.float64 if dt == "fp64" else tl.float32
# (family, EDGE): every family, and α-entmax with heads at α > 2.
for family, edge in ((0, False), (1, False), (2, False), (3, False), (3, True)):
    # (Row bounds, a BlockMask's runs, on every other family.)
    base = dict(FAMILY=family, HAS_MASK=True, BAND=True, HAS_KEYLEN=True, HAS_ROWB=family % 2 == 1, HEAD_DIM=64,
                HEAD_DIM_V=32, BLOCK_M=64, BLOCK_N=32, ACC=acc, DROPOUT=True, EDGE=edge,
                DOT="tf32" if dt == "fp32" else "ieee")
    for fn, const in (
        (K._attn_fwd_kernel, dict(base, MAX_ITER=64, N_WORDS=4, NSETS=_NSETS, COUNT=True)),
        (K._attn_bwd_dq_kernel, dict(base, STATS=family != 0, ALPHA_GRAD=family == 3)),
        (K._attn_bwd_dkdv_kernel, base),
    ):
        triton.compile(ASTSource(fn, K.aot_signature(fn, const, dt), constexprs=const),
                       target=GPUTarget("cuda", 80, 32))
# An int argument equal to 1 reaches the compiler as a constant: the key band's.
const = dict(FAMILY=1, HAS_MASK=False, BAND=True, HAS_KEYLEN=False, HAS_ROWB=False, HEAD_DIM=64, HEAD_DIM_V=64,
             BLOCK_M=64, BLOCK_N=32, ACC=acc, DROPOUT=False, EDGE=False, DOT="ieee", causal=1, win_left=1,
             win_right=1, L=1, S=1)
for fn, extra in ((K._attn_fwd_kernel, dict(MAX_ITER=64, N_WORDS=4, NSETS=_NSETS, COUNT=False)),
                  (K._attn_bwd_dq_kernel, dict(STATS=True, ALPHA_GRAD=False)), (K._attn_bwd_dkdv_kernel, {})):
    c = dict(const, **extra)
    triton.compile(ASTSource(fn, K.aot_signature(fn, c, dt), constexprs=c), target=GPUTarget("cuda", 80, 32))
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_kernels_compile_for_a_gpu_target(dtype):
    # The interpreter accepts code that the compiler rejects: compile every kernel
    # ahead of time for sm_80 (no GPU needed), in a process without the interpreter.
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, dtype], env=env, capture_output=True,
                         text=True, timeout=900)
    if res.returncode != 0 and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("no ptxas for the NVIDIA backend")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
