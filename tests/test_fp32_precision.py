"""float32 attention follows torch.backends.mkldnn.matmul.fp32_precision on
the CPU: exact float32 by default ("ieee", "tf32", "none" inherited as
either); with "bf16" (or set_float32_matmul_precision("medium")) its GEMMs
take bfloat16 operands, with float32 sums, outputs and gradients, where AMX
tiles run bfloat16 (and under the test emulation, which stands in for them
on every CPU). The accuracy is bfloat16 attention's: errors of a few 2^-8
of the largest entry, where float32 makes about 1e-6.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from helpers import make_qkv

import attnkern
from attnkern import _extension, isa

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

_EMULATE = "ATTNKERN_HALF_GEMM_EMULATE"


def _amx_here() -> bool:
    saved = os.environ.pop(_EMULATE, None)
    try:
        return isa.dispatch().get("bf16_gemm_unit") == "AMX-BF16"
    finally:
        if saved is not None:
            os.environ[_EMULATE] = saved


@contextlib.contextmanager
def _precision(matmul: str | None = None, mkldnn: str | None = None, medium: bool = False):
    """Sets the float32 precisions for a block and restores them after."""
    saved = (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.mkldnn.fp32_precision,
             torch.backends.fp32_precision, torch.get_float32_matmul_precision())
    try:
        if medium:
            torch.set_float32_matmul_precision("medium")
        if mkldnn is not None:
            torch.backends.mkldnn.fp32_precision = mkldnn
        if matmul is not None:
            torch.backends.mkldnn.matmul.fp32_precision = matmul
        yield
    finally:
        torch.set_float32_matmul_precision(saved[3])
        torch.backends.fp32_precision = saved[2]
        torch.backends.mkldnn.fp32_precision = saved[1]
        torch.backends.mkldnn.matmul.fp32_precision = saved[0]


def _run(q, k, v, go, **kw):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attnkern.attention(*xs, **kw)
    return [out.detach(), *torch.autograd.grad(out, xs, go)]


def _case(L=130, S=333, E=64, Ev=48):
    q, k, v, go = make_qkv(1, 2, 2, L, S, E, Ev, grad_out=True)
    return q, k, v, go


@pytest.mark.parametrize("setting", [dict(matmul="ieee"), dict(matmul="tf32"), dict(matmul="none"),
                                     dict(mkldnn="ieee", matmul="none")], ids=str)
def test_exact_float32_unless_bf16_is_allowed(setting):
    q, k, v, go = _case()
    default = _run(q, k, v, go, is_causal=True)
    with _precision(**setting):
        got = _run(q, k, v, go, is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip(default, got, strict=True))


@pytest.mark.parametrize("setting", [dict(matmul="bf16"), dict(mkldnn="bf16", matmul="none"), dict(medium=True)],
                         ids=str)
def test_bf16_allowed_runs_on_amx_only(setting):
    """Off AMX, "bf16" changes nothing; on AMX the GEMMs run in bfloat16."""
    q, k, v, go = _case()
    default = _run(q, k, v, go)
    with _precision(**setting):
        got = _run(q, k, v, go)
    assert all(t.dtype == torch.float32 for t in got)
    same = all(torch.equal(a, b) for a, b in zip(default, got, strict=True))
    assert same != _amx_here()


@pytest.fixture(params=["hardware", "emulated"])
def bf16_gemms(request, monkeypatch):
    if request.param == "emulated":
        monkeypatch.setenv(_EMULATE, "1")
    elif not _amx_here():
        pytest.skip("no AMX-BF16 on this CPU")
    else:
        monkeypatch.delenv(_EMULATE, raising=False)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "causal"])
def test_bf16_accuracy(normalizer, bf16_gemms):
    """Outputs and gradients, in float32, within bfloat16 attention's error of
    float64 attention on q and k rounded to bfloat16 (what the scores are
    taken of), and off float32's (the bfloat16 path did run, in the forward
    and in softmax's backward); for softmax, also of float64 on the inputs
    as they are (a sparse normalizer's gradient can jump where the rounding
    moves a score across its threshold, as in bfloat16 attention). The
    output equals bfloat16 attention's up to its final rounding."""
    q, k, v, go = _case()
    kw = {"is_causal": True} if normalizer == "causal" else {"normalizer": normalizer}
    exact = _run(q.double(), k.double(), v.double(), go.double(), **kw)
    exact_rounded = _run(q.bfloat16().double(), k.bfloat16().double(), v.double(), go.double(), **kw)
    f32 = _run(q, k, v, go, **kw)
    with _precision(matmul="bf16"):
        got = _run(q, k, v, go, **kw)
        as_bf16 = attnkern.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw).float()
    for name, g, x, xr, ref32 in zip(("out", "dq", "dk", "dv"), got, exact, exact_rounded, f32, strict=True):
        assert g.dtype == torch.float32, name
        for want in (xr, x) if normalizer != "sparsemax" else (xr,):
            scale = want.abs().max().item()
            err = (g.double() - want).abs().max().item()
            assert err <= 4 * 2**-8 * scale, (name, err, scale)
        if name == "out" or normalizer != "sparsemax":  # (the sparse backward computes in float32)
            assert (g.double() - x).abs().max() > 4 * (ref32.double() - x).abs().max(), name
    torch.testing.assert_close(got[0], as_bf16, atol=2**-8 * got[0].abs().max().item(), rtol=2**-7)
