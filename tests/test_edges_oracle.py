"""The numerical edges of the α-entmax family against an extended-precision
oracle (tests/mp_oracle.py): large α (the edge of the support below any fixed
precision in the shift form), α next to 1 (no softmax band), and float32
sparsemax on long rows; row-wise and fused, kernels and the float64 reference
(itself the oracle of the other backends). Rows are short and the α grid fixed,
so that the mpmath solves stay quick."""


import mp_oracle as oracle
import pytest
import torch

import attnkern
from attnkern import _extension
from attnkern.backends import reference

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason=f"attnkern._C not built: {_extension.LOAD_ERROR}")

# Targets of the forward (absolute) and of the gradients (relative to the
# largest entry of the exact gradient).
P_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
GRAD_TOL = 1e-3
LARGE_ALPHAS = (2.5, 3.0, 5.0, 10.0, 20.0)


def _on_cuda(fn):
    """fn run on CUDA copies of its tensor arguments (differentiable), the result back on the CPU."""
    def call(*args):
        return fn(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)).cpu()
    return call


# The row-wise backends: the CPU kernels, the float64 reference (the oracle of
# the others) and the CUDA row kernels (on a GPU host with a CUDA build).
_ENTMAX = {"kernel": attnkern.entmax, "reference": reference.entmax, "cuda": _on_cuda(attnkern.entmax)}
_SPARSEMAX = {"kernel": attnkern.sparsemax, "cuda": _on_cuda(attnkern.sparsemax)}
_CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and _extension.has_cuda_kernels()),
                       reason="needs a CUDA device and attnkern._C built with the CUDA sources")])


def _err(actual, exact) -> float:
    return max(abs(float(a) - float(e)) for a, e in zip(actual, exact, strict=False))


def _rel_err(actual, exact) -> float:
    scale = max(max(abs(float(e)) for e in exact), 1e-300)
    return _err(actual, exact) / scale


def _rows(alpha, dtype, seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    tied = oracle.near_tied_rows(g, n, alpha, 4)
    random = 0.5 * torch.randn(2, n, generator=g, dtype=torch.float64)
    return torch.cat([tied, random]).to(dtype)


# --- the reproductions of the issue --------------------------------------------------------------


@pytest.mark.parametrize("backend", ["kernel", "reference", _CUDA])
def test_large_alpha_reproductions(backend):
    entmax = _ENTMAX[backend]
    cases = [([0.0, -0.105], 10.0, torch.float64, [0.993734, 0.006266]),
             ([0.0, -0.1], 10.0, torch.float64, [0.988362, 0.011638]),
             ([0.0, -0.2499], 5.0, torch.float32, [0.9999, 1e-4])]
    for row, alpha, dtype, rounded in cases:
        p = entmax(torch.tensor(row, dtype=dtype), alpha)
        exact = oracle.entmax(torch.tensor(row, dtype=dtype).tolist(), alpha)
        assert _err(p.tolist(), exact) <= P_TOL[dtype], (row, alpha, p)
        assert _err(p.tolist(), rounded) <= 1e-6
    # The first row's vector-Jacobian product is ±1.05, not [0, 0].
    x = torch.tensor([0.0, -0.105], dtype=torch.float64, requires_grad=True)
    entmax(x, 10.0).backward(torch.tensor([1.0, 0.0], dtype=torch.float64))
    exact = oracle.vjp(oracle.entmax([0.0, -0.105], 10.0), [1.0, 0.0], 10.0)
    assert abs(float(exact[0]) - 1.05) < 0.01
    assert _rel_err(x.grad.tolist(), exact) <= 1e-9


# --- large α, row-wise ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", LARGE_ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["kernel", "reference", _CUDA])
def test_large_alpha_rows(alpha, dtype, backend):
    if backend == "reference" and dtype == torch.float32:
        pytest.skip("the reference computes in float64 whatever the input")
    entmax = _ENTMAX[backend]
    xs = _rows(alpha, dtype)
    dps = torch.randn(xs.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    x = xs.clone().requires_grad_()
    a = torch.full((xs.shape[0], 1), alpha, dtype=dtype, requires_grad=True)
    p = entmax(x, a)
    p.backward(dps)
    for r in range(xs.shape[0]):
        z, d = xs[r].double().tolist(), dps[r].double().tolist()
        exact = oracle.entmax(z, alpha)
        assert _err(p[r].tolist(), exact) <= P_TOL[dtype], (r, p[r], [float(v) for v in exact])
        assert _rel_err(x.grad[r].tolist(), oracle.vjp(exact, d, alpha)) <= GRAD_TOL, r
        da = oracle.alpha_vjp(z, d, alpha)
        scale = max(abs(float(da)), max(abs(v) for v in d))
        assert abs(float(a.grad[r, 0]) - float(da)) <= GRAD_TOL * scale, (r, a.grad[r, 0], float(da))


# --- α next to 1 -----------------------------------------------------------------------------------


def _near_one(dtype):
    """α within a few ulps of 1 on both sides, as the dtype holds them."""
    if dtype == torch.float64:
        return [1 + d for d in (1e-7, 1e-6, 1e-5)] + [1 - d for d in (1e-7, 1e-6, 1e-5)]
    return [1 + k * 2.0**-23 for k in (1, 3, 40)] + [1 - k * 2.0**-24 for k in (1, 3, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_alpha_next_to_one_is_not_softmax(dtype):
    g = torch.Generator().manual_seed(2)
    xs = (3 * torch.randn(3, 40, generator=g, dtype=torch.float64)).to(dtype)
    for alpha in _near_one(dtype):
        a = torch.tensor(alpha, dtype=dtype)
        p = attnkern.entmax(xs, a)
        for r in range(xs.shape[0]):
            exact = oracle.entmax(xs[r].double().tolist(), float(a))
            assert _err(p[r].tolist(), exact) <= P_TOL[dtype], (alpha, r)
    if dtype == torch.float64:
        # The true map differs from softmax at 1 + 1e-6 by far more than the tolerance.
        p = attnkern.entmax(xs, 1 + 1e-6)
        assert (p - torch.softmax(xs, -1)).abs().max() > 1e-7


def test_alpha_gradient_continuous_across_one():
    g = torch.Generator().manual_seed(3)
    x = 2 * torch.randn(2, 12, generator=g, dtype=torch.float64)
    dp = torch.randn(2, 12, generator=g, dtype=torch.float64)
    grads = []
    for alpha in (1 - 1e-5, 1 - 1e-7, 1.0, 1 + 1e-7, 1 + 1e-5):
        a = torch.tensor([[alpha], [alpha]], dtype=torch.float64, requires_grad=True)
        attnkern.entmax(x, a).backward(dp)
        grads.append(a.grad.squeeze(1))
        exact = [oracle.alpha_vjp(x[r].tolist(), dp[r].tolist(), alpha) for r in range(2)]
        assert _err(a.grad.squeeze(1).tolist(), exact) <= 1e-8 * max(1.0, max(abs(float(e)) for e in exact))
    for lo, hi in zip(grads, grads[1:], strict=False):
        assert (lo - hi).abs().max() < 1e-3


# --- fused attention at the edges ------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [3.0, 10.0, 20.0, 1 + 2.0**-23, 1 - 2.0**-24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_attention_at_the_edges(alpha, dtype):
    g = torch.Generator().manual_seed(4)
    L, S, Ev, scale = 4, 12, 6, 0.5
    if alpha > 2:
        q, k, v, dout = oracle.near_tied_attention(g, alpha, L, S, Ev, scale)
    else:
        E = 8
        q, k = (torch.randn(1, 2, n, E, generator=g, dtype=torch.float64) for n in (L, S))
        v, dout = (torch.randn(1, 2, n, Ev, generator=g, dtype=torch.float64) for n in (S, L))
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    a = torch.full((2,), alpha, dtype=dtype, requires_grad=True)
    out = attnkern.attention(qq, kk, vv, scale=scale, normalizer="entmax", alpha=a)
    out.backward(dout)
    for h in range(2):
        o, dq, dk, dv, da = oracle.attention(q[0, h], k[0, h], v[0, h], dout[0, h], float(alpha), scale)
        out_tol = (1e-6 if dtype == torch.float32 else 1e-11) * max(1.0, o.abs().max().item())
        assert (out[0, h].double() - o).abs().max() <= out_tol
        for name, got, exact in (("dq", qq.grad[0, h], dq), ("dk", kk.grad[0, h], dk), ("dv", vv.grad[0, h], dv)):
            assert (got.double() - exact).abs().max() <= GRAD_TOL * exact.abs().max().clamp_min(1e-30), name
        assert abs(float(a.grad[h]) - da) <= GRAD_TOL * max(1.0, abs(da)), (float(a.grad[h]), da)


# --- float32 sparsemax on long rows ---------------------------------------------------------------


def _ulp32(t: torch.Tensor) -> torch.Tensor:
    """One float32 ulp at the magnitude of each entry (float64)."""
    m = t.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(m)) - 23)


@pytest.mark.parametrize("backend", ["kernel", _CUDA])
@pytest.mark.parametrize("n", [1000, 32768, 2**20])
def test_float32_sparsemax_long_rows(n, backend):
    torch.manual_seed(0)
    for spread in (1e-6, 1e-3):
        x = (torch.randn(1, n, dtype=torch.float64) * spread).float()
        p = _SPARSEMAX[backend](x).double()
        exact = reference.sparsemax(x.double())  # the sort-based rule in float64 on the same float32 inputs
        assert abs(p.sum().item() - 1) <= 1e-6, (n, spread, p.sum().item() - 1)
        assert ((p - exact).abs() <= 4 * _ulp32(exact) + 1e-9).all(), (n, spread, (p - exact).abs().max())
        # The support is exact wherever no entry sits within 2 ulp of max|x| of the threshold.
        tau = (x.double() - exact)[exact > 0].mean()
        clear = (x.double() - tau).abs() > 2 * float(_ulp32(x.double().abs().max()))
        assert torch.equal((p > 0)[clear], (exact > 0)[clear])


def test_float32_sparsemax_attention_long_rows_as_accurate_as_softmax():
    """Fused float32 sparsemax attention over near-uniform scores at S = 32768:
    within 2x the error float32 softmax attention makes on the same inputs."""
    g = torch.Generator().manual_seed(5)
    L, S, E, Ev = 4, 32768, 16, 8
    q = 1e-3 * torch.randn(1, 1, L, E, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, 1, S, E, generator=g, dtype=torch.float64), torch.randn(1, 1, S, Ev, generator=g,
                                                                                 dtype=torch.float64)
    dout = torch.randn(1, 1, L, Ev, generator=g, dtype=torch.float64)
    errs = {}
    for normalizer in ("softmax", "sparsemax"):
        exact = reference.attention(q, k, v, normalizer=normalizer)
        qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
        out = attnkern.attention(qq, kk, vv, normalizer=normalizer)
        out.backward(dout.float())
        q64, k64, v64 = (t.clone().requires_grad_() for t in (q.float().double(), k.float().double(),
                                                             v.float().double()))
        reference.attention(q64, k64, v64, normalizer=normalizer).backward(dout.float().double())
        errs[normalizer] = [(out.double() - exact).abs().max().item()] + [
            ((a.grad.double() - b.grad).abs().max() / b.grad.abs().max()).item()
            for a, b in ((qq, q64), (kk, k64), (vv, v64))]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert errs["sparsemax"][i] <= 2 * errs["softmax"][i] + 1e-7, (what, errs)
