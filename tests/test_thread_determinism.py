"""Bitwise independence of the thread count for the attention calls whose
GEMMs go to the BLAS (at most 16 query rows: K and V read as they are).

MKL threads a BLAS call by its own thread counts, and its sums' order follows
them: on an Intel Xeon these calls gave other bits at 2 threads than at 1 until
the kernels set MKL's thread-local count to 1 around each call (blas.h). On
CPUs where MKL does not thread these sizes the tests pass either way.
"""

from __future__ import annotations

import pytest
import torch

import attnkern

NORMALIZERS = {"softmax": {}, "sparsemax": {}, "entmax α=1.3": {"normalizer": "entmax", "alpha": 1.3}}


def _at_offset(x: torch.Tensor, offset: int) -> torch.Tensor:
    """x copied into storage that starts `offset` elements into a buffer."""
    buf = torch.empty(x.numel() + offset, dtype=x.dtype)
    out = buf[offset:].view(x.shape)
    out.copy_(x)
    return out


def _run(q, k, v, do, kw):
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out = attnkern.attention(qa, ka, va, **kw)
    return [out, *torch.autograd.grad(out, (qa, ka, va), do)]


def _run_at(threads: int, q, k, v, do, kw):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(q, k, v, do, kw)
    finally:
        torch.set_num_threads(before)


def _inputs(bh: int, E: int, dtype, L: int = 16, S: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H = (1, bh) if bh < 8 else (2, bh // 2)
    q, k, v, do = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64).to(dtype) for n in (L, S, S, L))
    return q, k, v, do


def test_issue_reproduction():
    """The report's case: one head, 16 query rows, E = 33, softmax, float32."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, n, 33, generator=g) for n in (16, 300, 300, 16))
    one = _run_at(1, q, k, v, do, {})
    two = _run_at(2, q, k, v, do, {})
    assert [torch.equal(a, b) for a, b in zip(one, two, strict=True)] == [True] * 4


@pytest.mark.parametrize("normalizer", list(NORMALIZERS))
@pytest.mark.parametrize("bh", [1, 2, 8])
@pytest.mark.parametrize("E", [33, 40, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_few_query_rows_same_bits_at_any_thread_count(dtype, E, bh, normalizer):
    """Output and dq, dk, dv: the same bits at 1 and 2 threads, and at another
    storage offset of the inputs (4 query rows decode, 16 take the BLAS path)."""
    kw = NORMALIZERS[normalizer]
    for L in (4, 16):
        q, k, v, do = _inputs(bh, E, dtype, L=L)
        base = _run_at(1, q, k, v, do, kw)
        for threads, offset in ((2, 0), (2, 3), (1, 5)):
            got = _run_at(threads, *(_at_offset(t, offset) for t in (q, k, v, do)), kw)
            same = [torch.equal(a, b) for a, b in zip(base, got, strict=True)]
            assert all(same), f"L={L} threads={threads} offset={offset}: out, dq, dk, dv equal: {same}"
