"""bfloat16 and float16 attention whose GEMMs run in the half type
(csrc/cpu/half_gemm.h) against the float64 reference by the half-type rule,
against the float32-GEMM path, and at 1 and 2 threads.

Each half type runs three ways: on oneDNN's brgemm (only on CPUs with the
type's dot products: AVX512-BF16 / AMX-BF16, AVX512-FP16 / AMX-FP16), and
with ATTNKERN_HALF_GEMM_EMULATE=1 / =plain (the products summed by a plain
loop, on every CPU, with B operands in the VNNI layout / in plain rows),
which checks the packing, rounding and bookkeeping around oneDNN's kernels
where the CPU cannot run them."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import NORMALIZERS, alpha_for, attention_mask, grads_in_fresh_leaves, make_qkv, ref_attention

import attnkern
from attnkern import _extension, isa
from attnkern.backends import reference
from attnkern.testing import half_rule_bound, tolerance

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

_OFF = {torch.bfloat16: "ATTNKERN_BF16_GEMM", torch.float16: "ATTNKERN_FP16_GEMM"}
_KEY = {torch.bfloat16: "bf16_gemm", torch.float16: "fp16_gemm"}
_EMULATE = "ATTNKERN_HALF_GEMM_EMULATE"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _on_hardware(dtype) -> bool:
    """Whether oneDNN runs dtype's GEMMs here (emulation aside)."""
    saved = os.environ.pop(_EMULATE, None)
    try:
        return bool(isa.dispatch().get(_KEY[dtype]))
    finally:
        if saved is not None:
            os.environ[_EMULATE] = saved


_WAYS = [pytest.param((dt, way), id=f"{str(dt)[6:]}-{way}",
                      marks=pytest.mark.skipif(way == "onednn" and not _on_hardware(dt),
                                               reason=f"no {str(dt)[6:]} dot products on this CPU"))
         for dt in (torch.bfloat16, torch.float16) for way in ("onednn", "emulated", "emulated_plain")]


@pytest.fixture(params=_WAYS)
def half(request, monkeypatch):
    """(dtype, float32_gemms): the half type, its GEMMs running the
    parametrized way; float32_gemms() turns them off for the rest of the test."""
    dtype, way = request.param
    if way.startswith("emulated"):
        monkeypatch.setenv(_EMULATE, "plain" if way == "emulated_plain" else "1")
    else:
        monkeypatch.delenv(_EMULATE, raising=False)
    monkeypatch.delenv(_OFF[dtype], raising=False)
    assert isa.dispatch()[_KEY[dtype]]

    def float32_gemms():
        monkeypatch.setenv(_OFF[dtype], "0")
        assert not isa.dispatch()[_KEY[dtype]]

    return dtype, float32_gemms


def test_dispatch_says_when_half_gemms_run(monkeypatch):
    monkeypatch.delenv(_EMULATE, raising=False)
    d = isa.dispatch()
    assert isinstance(d["bf16_gemm"], bool) and isinstance(d["fp16_gemm"], bool)
    flags = _cpu_flags()
    # bfloat16 on its dot products or AMX tiles; float16 only on AMX-FP16
    # tiles (AVX512-FP16 alone is no faster than float32).
    for key, want in (("bf16_gemm", {"avx512_bf16", "amx_bf16"}), ("fp16_gemm", {"amx_fp16"})):
        capable = bool(flags & want) and d["active"] == "AVX512"
        if capable and torch.backends.mkldnn.enabled:
            assert d[key], f"this CPU has the unit, but {key} is off: {d[key + '_unit']}"
        if not capable:
            assert not d[key]
            assert d[key + "_unit"].startswith("float32: "), d[key + "_unit"]
    if d["bf16_gemm"]:
        assert d["bf16_gemm_unit"] == ("AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16")
    if d["active"] == "AVX512" and "avx512_fp16" in flags and "amx_fp16" not in flags:
        assert d["fp16_gemm_unit"] == "float32: no float16 matrix unit (AMX-FP16)"
    monkeypatch.setenv("ATTNKERN_BF16_GEMM", "0")
    monkeypatch.setenv("ATTNKERN_FP16_GEMM", "0")
    d = isa.dispatch()
    assert not d["bf16_gemm"] and not d["fp16_gemm"]
    assert d["bf16_gemm_unit"] == "float32: turned off (ATTNKERN_BF16_GEMM=0)"
    monkeypatch.setenv(_EMULATE, "1")
    d = isa.dispatch()
    assert not d["bf16_gemm"] and not d["fp16_gemm"], "the off switches win over emulation"
    monkeypatch.delenv("ATTNKERN_BF16_GEMM")
    monkeypatch.delenv("ATTNKERN_FP16_GEMM")
    for mode in ("1", "plain"):
        monkeypatch.setenv(_EMULATE, mode)
        d = isa.dispatch()
        assert d["bf16_gemm"] and d["fp16_gemm"]
        assert d["fp16_gemm_unit"].startswith("emulated"), d["fp16_gemm_unit"]
    monkeypatch.delenv(_EMULATE)
    if "AVX2" in isa.runnable_levels():
        with isa.force_level("AVX2"):
            d = isa.dispatch()
            assert not d["bf16_gemm"] and not d["fp16_gemm"]


@pytest.mark.skipif(not _on_hardware(torch.bfloat16), reason="no bfloat16 dot products on this CPU")
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_emulated_products_match_onednn(normalizer, monkeypatch):
    """The emulation computes what oneDNN's kernels do, up to the order of
    the float32 sums: outputs and gradients round to the same bfloat16 but
    for a few entries (sums near a rounding boundary, or cancelling)."""
    q, k, v = make_qkv(1, 2, 1, 150, 333, 64, 48, dtype=torch.bfloat16)
    go = torch.randn(1, 2, 150, 48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def run():
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attnkern.attention(*xs, normalizer=normalizer, enable_gqa=True, backend="cpu")
        return (out, *torch.autograd.grad(out, xs, go))

    real = run()
    monkeypatch.setenv(_EMULATE, "1")
    emulated = run()
    for a, b in zip(real, emulated, strict=True):
        diff = (a.float() - b.float()).abs()
        assert diff.max() <= a.float().abs().max() * 2**-8
        assert (diff > 0).float().mean() < 0.01


CASES = {
    # name: (B, H, Hk, L, S, E, Ev), mask kind, input spread
    "97x97_e59": ((1, 2, 2, 97, 97, 59, 59), "none", 1.0),
    "5x1": ((1, 2, 2, 5, 1, 16, 16), "none", 1.0),
    "gqa_33x1025_causal": ((1, 4, 2, 33, 1025, 64, 48), "causal", 1.0),
    "1025x97_float_mask": ((1, 2, 2, 1025, 97, 128, 80), "float", 1.0),
    "fully_masked": ((2, 2, 2, 33, 70, 64, 32), "fully_masked", 1.0),
    "key_padding_e200": ((2, 2, 1, 40, 300, 200, 130), "key_padding", 1.0),
    "large": ((1, 2, 2, 65, 129, 64, 64), "none", 30.0),
    "tiny": ((1, 2, 2, 65, 129, 64, 64), "none", 1e-3),
}


def _plain_error(q, k, v, mask, causal, normalizer, alpha, exact):
    """Plain PyTorch in q's dtype (scores and p·v in dtype, the normalizer
    exact): its largest error against the float64 result."""
    s = reference.attention_scores(q, k, mask, causal, q.shape[-1] ** -0.5)
    if normalizer == "entmax":
        p = reference.entmax(s, alpha.view(-1, 1, 1), -1)
    else:
        p = getattr(reference, normalizer)(s, -1)
    plain = p.nan_to_num(0.0).to(q.dtype) @ v
    return (plain.double() - exact).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_half_gemms_by_the_half_rule(normalizer, case, half):
    dtype, float32_gemms = half
    (B, H, Hk, L, S, E, Ev), mask_kind, spread = CASES[case]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, spread=spread)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)
    kw = dict(is_causal=causal, normalizer=normalizer, alpha=alpha, enable_gqa=True, backend="cpu")
    out = attnkern.attention(q, k, v, mask, **kw)
    float32_gemms()
    out32 = attnkern.attention(q, k, v, mask, **kw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    G = H // Hk
    kx, vx = (t.double().repeat_interleave(G, 1) for t in (k, v))
    exact = ref_attention(q.double(), kx, vx, mask, causal, normalizer, alpha)
    err = (out.double() - exact).abs().max().item()
    err32 = (out32.double() - exact).abs().max().item()
    err_plain = _plain_error(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), mask, causal, normalizer,
                             alpha, exact)
    assert half_rule_bound(err, err_plain, dtype), (err, err_plain)
    # Neither path is worse than the other by more than the rule allows.
    assert half_rule_bound(err, err32, dtype) and half_rule_bound(err32, err, dtype), (err, err32)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15"])
def test_half_gemms_with_ties(normalizer, half):
    """Integer-valued inputs: many equal scores (ties at the support's edge),
    every product exact in the half type."""
    dtype, _ = half
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randint(-2, 3, (1, 2, n, 16), generator=g).to(dtype) for n in (70, 130, 130))
    out = attnkern.attention(q, k, v, normalizer=normalizer, scale=0.25, backend="cpu")
    exact = ref_attention(q.double(), k.double(), v.double(), None, False, normalizer, None, scale=0.25)
    # bfloat16's bound (the looser one) for both half types.
    torch.testing.assert_close(out.double(), exact, **tolerance(torch.bfloat16, "attention", "forward"))


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15", "entmax"])
def test_half_gemms_thread_count_and_dropout(normalizer, half):
    """The same bits at 1 and 2 threads; dropout drops the same weights as the
    float32-GEMM path does."""
    dtype, float32_gemms = half
    q, k, v = make_qkv(1, 2, 2, 200, 333, 64, 64, dtype=dtype)
    alpha = alpha_for(normalizer, 2)
    kw = dict(normalizer=normalizer, alpha=alpha, backend="cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attnkern.attention(q, k, v, **kw)
        torch.set_num_threads(2)
        two = attnkern.attention(q, k, v, **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.manual_seed(11)
    dropped = attnkern.attention(q, k, v, dropout_p=0.3, **kw)
    float32_gemms()
    torch.manual_seed(11)
    dropped32 = attnkern.attention(q, k, v, dropout_p=0.3, **kw)
    # Two kernels, each within bfloat16's bound (the looser one, for both half types): twice it.
    torch.testing.assert_close(dropped.float(), dropped32.float(),
                               **tolerance(torch.bfloat16, "attention", "forward", scale=2.0))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalizer", ["softmax", "entmax_at_one"])
def test_half_gemm_gradients_by_the_half_rule(normalizer, case, half):
    """The softmax backward's GEMMs in the half type (dK and dV accumulated
    transposed): dq, dk, dv against float64 by the half-type rule, and against
    the float32-GEMM path. α-entmax with every α = 1 takes it too."""
    dtype, float32_gemms = half
    (B, H, Hk, L, S, E, Ev), mask_kind, spread = CASES[case]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=dtype, spread=spread)
    go = torch.randn(B, H, L, Ev, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    norm, alpha = ("softmax", None) if normalizer == "softmax" else ("entmax", torch.ones(H))
    G = H // Hk

    def kern(q, k, v):
        return attnkern.attention(q, k, v, mask, is_causal=causal, normalizer=norm, alpha=alpha, enable_gqa=True,
                                  backend="cpu")

    def plain(q, k, v):  # scores, weights and p·v in q's dtype
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        p = torch.softmax(reference.attention_scores(q, k, mask, causal, E**-0.5), -1).nan_to_num(0.0)
        return p.to(q.dtype) @ v

    def exact(q, k, v):
        return ref_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), mask, causal, "softmax", None)

    g16 = grads_in_fresh_leaves(kern, (q, k, v), go.to(dtype))
    gp = grads_in_fresh_leaves(plain, (q, k, v), go.to(dtype))
    gx = grads_in_fresh_leaves(exact, [t.double() for t in (q, k, v)], go)
    float32_gemms()
    g32 = grads_in_fresh_leaves(kern, (q, k, v), go.to(dtype))
    for name, a, p_, x, b in zip(("dq", "dk", "dv"), g16, gp, gx, g32, strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all()
        err = (a.double() - x).abs().max().item()
        err_plain = (p_.double() - x).abs().max().item()
        err32 = (b.double() - x).abs().max().item()
        assert half_rule_bound(err, err_plain, dtype), (name, err, err_plain)
        assert half_rule_bound(err, err32, dtype), (name, err, err32)


def test_half_gemm_gradients_thread_count_and_dropout(half):
    dtype, float32_gemms = half
    q, k, v = make_qkv(1, 2, 1, 200, 333, 64, 48, dtype=dtype)
    go = torch.randn(1, 2, 200, 48, generator=torch.Generator().manual_seed(2)).to(dtype)

    def kern(p):
        def f(q, k, v):
            torch.manual_seed(7)
            return attnkern.attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=True, backend="cpu")
        return f

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads_in_fresh_leaves(kern(0.0), (q, k, v), go)
        torch.set_num_threads(2)
        two = grads_in_fresh_leaves(kern(0.0), (q, k, v), go)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    dropped = grads_in_fresh_leaves(kern(0.25), (q, k, v), go)
    float32_gemms()
    dropped32 = grads_in_fresh_leaves(kern(0.25), (q, k, v), go)
    for a, b in zip(dropped, dropped32, strict=True):
        scale = b.float().abs().max().item()
        # Relative to the largest gradient, kernel against kernel: not the reference rule's form.
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_half_ops_opcheck_and_compile(normalizer, dtype):
    """The ops take bfloat16 and float16 as they are (on every CPU): opcheck,
    and torch.compile against eager."""
    q, k, v = make_qkv(1, 4, 2, 9, 13, 8, 6, dtype=dtype, noncontig=True)
    mask = torch.randn(1, 1, 9, 13).expand(1, 4, 9, 13)
    args = (q, k, v, mask, False, 0.35, normalizer, None)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd, args)
    out, shift = torch.ops.attnkern.attention_fwd(*args)
    assert out.dtype == dtype and shift.dtype == torch.float32
    go = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attnkern.attention_bwd, (go, *args[:-1], None, out, shift, False))

    def f(q, k, v):
        return attnkern.attention(q, k, v, normalizer=normalizer, is_causal=True, enable_gqa=True, backend="cpu")

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_half_gemm_nan_row_stays_in_its_row(normalizer, causal, half):
    """A NaN in one query row makes that row's output NaN (and softmax's dq
    row) and leaves every other row's output and dq bit for bit as without it
    (S and E not multiples of 32: no AMX tile's K tail may carry it
    elsewhere)."""
    dtype, _ = half
    q, k, v, go = make_qkv(1, 2, 2, 70, 97, 59, 40, dtype=dtype, grad_out=True)
    bad = q.clone()
    bad[0, 1, 37, 5] = float("nan")

    def run(q):
        qa = q.clone().requires_grad_()
        out = attnkern.attention(qa, k, v, is_causal=causal, normalizer=normalizer, backend="cpu")
        return out.detach(), torch.autograd.grad(out, qa, go)[0]

    (out, dq), (out_bad, dq_bad) = run(q), run(bad)
    assert out_bad[0, 1, 37].isnan().all()
    assert dq_bad[0, 1, 37].isnan().all() or normalizer != "softmax"
    keep = torch.ones(70, dtype=torch.bool)
    keep[37] = False
    assert torch.equal(out_bad[0, 0], out[0, 0]) and torch.equal(dq_bad[0, 0], dq[0, 0])
    assert torch.equal(out_bad[0, 1, keep], out[0, 1, keep]) and torch.equal(dq_bad[0, 1, keep], dq[0, 1, keep])


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", "entmax_at_one", "entmax"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("way", ["hardware", "emulated", "emulated_plain"])
def test_no_value_columns_backward(way, dtype, normalizer, monkeypatch):
    """Ev = 0 (the edges issue's crash: bfloat16 softmax backward died with
    SIGSEGV): an empty output, and zero gradients for q, k and α, as SDPA."""
    if way != "hardware":
        monkeypatch.setenv(_EMULATE, "1" if way == "emulated" else "plain")
    H = 2
    q = torch.randn(2, H, 3, 4, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(2, H, 5, 4, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(2, H, 5, 0, dtype=torch.float64).to(dtype).requires_grad_()
    kw = {"normalizer": normalizer}
    if normalizer.startswith("entmax_at_one") or normalizer == "entmax":
        kw = {"normalizer": "entmax",
              "alpha": torch.full((H,), 1.0 if normalizer == "entmax_at_one" else 1.3).requires_grad_()}
    out = attnkern.attention(q, k, v, backend="cpu", **kw)
    assert out.shape == (2, H, 3, 0)
    out.sum().backward()
    assert q.grad is not None and not q.grad.any() and not k.grad.any() and v.grad.shape == v.shape
    if "alpha" in kw:
        assert kw["alpha"].grad is not None and not kw["alpha"].grad.any()


def test_onednn_brgemm_two_threads_stress(half):
    """Both threads call oneDNN's brgemm with the same shapes at once, over
    and over (concurrent same-shape calls have crashed on AMX: PyTorch issue
    187912): every call of forward and backward gives the first call's bits."""
    dtype, _ = half
    if os.environ.get(_EMULATE):
        pytest.skip("oneDNN's kernels only")
    q, k, v, go = make_qkv(1, 8, 8, 130, 333, 64, 64, dtype=dtype, grad_out=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = None
        for _ in range(20):
            got = grads_in_fresh_leaves(lambda a, b, c: attnkern.attention(a, b, c, is_causal=True, backend="cpu"),
                                        (q, k, v), go)
            first = first or got
            assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True))
    finally:
        torch.set_num_threads(threads)
