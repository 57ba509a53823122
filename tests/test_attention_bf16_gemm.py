"""bfloat16 attention whose forward GEMMs run in bfloat16 (oneDNN brgemm, on
CPUs with AVX512-BF16 or AMX-BF16; csrc/cpu/half_gemm.h) against the float64
reference by the half-type rule, against the float32-GEMM path, and at 1 and
2 threads."""

from __future__ import annotations

import pytest
import torch
from helpers import NORMALIZERS, alpha_for, attention_mask, make_qkv, ref_attention

import attnkern
from attnkern import _extension, isa
from attnkern.backends import reference
from attnkern.testing import half_rule_bound

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _bf16_gemm_on() -> bool:
    return bool(isa.dispatch().get("bf16_gemm"))


def test_dispatch_says_when_bf16_gemms_run(monkeypatch):
    d = isa.dispatch()
    assert isinstance(d["bf16_gemm"], bool)
    flags = _cpu_flags()
    capable = bool(flags & {"avx512_bf16", "amx_bf16"}) and d["active"] == "AVX512"
    if capable and torch.backends.mkldnn.enabled:
        assert d["bf16_gemm"], "this CPU has bfloat16 dot products, but the bfloat16 GEMMs are off"
    if not capable:
        assert not d["bf16_gemm"]
    monkeypatch.setenv("ATTNKERN_BF16_GEMM", "0")
    assert not isa.dispatch()["bf16_gemm"]
    if "AVX2" in isa.runnable_levels():
        monkeypatch.delenv("ATTNKERN_BF16_GEMM")
        with isa.force_level("AVX2"):
            assert not isa.dispatch()["bf16_gemm"]


needs_bf16_gemm = pytest.mark.skipif(not _bf16_gemm_on(), reason="no bfloat16 GEMMs on this CPU")

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


@needs_bf16_gemm
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_bf16_gemms_by_the_half_rule(normalizer, case, monkeypatch):
    (B, H, Hk, L, S, E, Ev), mask_kind, spread = CASES[case]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=torch.bfloat16, spread=spread)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)
    kw = dict(is_causal=causal, normalizer=normalizer, alpha=alpha, enable_gqa=True, backend="cpu")
    out = attnkern.attention(q, k, v, mask, **kw)
    monkeypatch.setenv("ATTNKERN_BF16_GEMM", "0")
    out32 = attnkern.attention(q, k, v, mask, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    G = H // Hk
    kx, vx = (t.double().repeat_interleave(G, 1) for t in (k, v))
    exact = ref_attention(q.double(), kx, vx, mask, causal, normalizer, alpha)
    err = (out.double() - exact).abs().max().item()
    err32 = (out32.double() - exact).abs().max().item()
    err_plain = _plain_error(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), mask, causal, normalizer,
                             alpha, exact)
    assert half_rule_bound(err, err_plain, torch.bfloat16), (err, err_plain)
    # Neither path is worse than the other by more than the rule allows.
    assert half_rule_bound(err, err32, torch.bfloat16) and half_rule_bound(err32, err, torch.bfloat16), (err, err32)


@needs_bf16_gemm
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15"])
def test_bf16_gemms_with_ties(normalizer):
    """Integer-valued inputs: many equal scores (ties at the support's edge),
    every product exact in bfloat16."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randint(-2, 3, (1, 2, n, 16), generator=g).to(torch.bfloat16) for n in (70, 130, 130))
    out = attnkern.attention(q, k, v, normalizer=normalizer, scale=0.25, backend="cpu")
    exact = ref_attention(q.double(), k.double(), v.double(), None, False, normalizer, None, scale=0.25)
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1e-2)


@needs_bf16_gemm
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15", "entmax"])
def test_bf16_gemms_thread_count_and_dropout(normalizer, monkeypatch):
    """The same bits at 1 and 2 threads; dropout drops the same weights as the
    float32-GEMM path does."""
    q, k, v = make_qkv(1, 2, 2, 200, 333, 64, 64, dtype=torch.bfloat16)
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
    monkeypatch.setenv("ATTNKERN_BF16_GEMM", "0")
    torch.manual_seed(11)
    dropped32 = attnkern.attention(q, k, v, dropout_p=0.3, **kw)
    torch.testing.assert_close(dropped.float(), dropped32.float(), atol=3e-2, rtol=2e-2)


def _grads(fn, inputs, go):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*xs), xs, go)


@needs_bf16_gemm
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalizer", ["softmax", "entmax_at_one"])
def test_bf16_gemm_gradients_by_the_half_rule(normalizer, case, monkeypatch):
    """The softmax backward's GEMMs in bfloat16 (dK and dV accumulated
    transposed): dq, dk, dv against float64 by the half-type rule, and against
    the float32-GEMM path. α-entmax with every α = 1 takes it too."""
    (B, H, Hk, L, S, E, Ev), mask_kind, spread = CASES[case]
    q, k, v = make_qkv(B, H, Hk, L, S, E, Ev, dtype=torch.bfloat16, spread=spread)
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

    g16 = _grads(kern, (q, k, v), go.to(torch.bfloat16))
    gp = _grads(plain, (q, k, v), go.to(torch.bfloat16))
    gx = _grads(exact, [t.double() for t in (q, k, v)], go)
    monkeypatch.setenv("ATTNKERN_BF16_GEMM", "0")
    g32 = _grads(kern, (q, k, v), go.to(torch.bfloat16))
    for name, a, p_, x, b in zip(("dq", "dk", "dv"), g16, gp, gx, g32, strict=True):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        err = (a.double() - x).abs().max().item()
        err_plain = (p_.double() - x).abs().max().item()
        err32 = (b.double() - x).abs().max().item()
        assert half_rule_bound(err, err_plain, torch.bfloat16), (name, err, err_plain)
        assert half_rule_bound(err, err32, torch.bfloat16), (name, err, err32)


@needs_bf16_gemm
def test_bf16_gemm_gradients_thread_count_and_dropout(monkeypatch):
    q, k, v = make_qkv(1, 2, 1, 200, 333, 64, 48, dtype=torch.bfloat16)
    go = torch.randn(1, 2, 200, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def kern(p):
        def f(q, k, v):
            torch.manual_seed(7)
            return attnkern.attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=True, backend="cpu")
        return f

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(kern(0.0), (q, k, v), go)
        torch.set_num_threads(2)
        two = _grads(kern(0.0), (q, k, v), go)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    dropped = _grads(kern(0.25), (q, k, v), go)
    monkeypatch.setenv("ATTNKERN_BF16_GEMM", "0")
    dropped32 = _grads(kern(0.25), (q, k, v), go)
    for a, b in zip(dropped, dropped32, strict=True):
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_bf16_ops_opcheck_and_compile(normalizer):
    """The ops take bfloat16 as it is (on every CPU): opcheck, and
    torch.compile against eager."""
    q, k, v = make_qkv(1, 4, 2, 9, 13, 8, 6, dtype=torch.bfloat16, noncontig=True)
    mask = torch.randn(1, 1, 9, 13).expand(1, 4, 9, 13)
    args = (q, k, v, mask, False, 0.35, normalizer, None)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd, args)
    out, shift = torch.ops.attnkern.attention_fwd(*args)
    assert out.dtype == torch.bfloat16 and shift.dtype == torch.float32
    go = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attnkern.attention_bwd, (go, *args[:-1], None, out, shift, False))

    def f(q, k, v):
        return attnkern.attention(q, k, v, normalizer=normalizer, is_causal=True, enable_gqa=True, backend="cpu")

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), atol=0, rtol=0)
