"""Numerics that training depends on: the gradient in α near α = 1 and the
outputs and gradients for α > 2 in float32, row-wise and in the fused
attention, against the same computation in float64; results that do not
depend on the thread count; half-precision gradients of broadcast inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkern
from attnkern import _extension
from attnkern.backends import reference

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

# α values around the softmax limit and across the family. Each is rounded to
# float32 once, so the float32 and float64 runs see the same α.
ALPHAS_NEAR_ONE = [1 - 1e-6, 1 + 1e-6, 1 - 1e-5, 1 + 1e-5, 1 - 1e-4, 1 + 1e-4, 1 - 1e-3, 1 + 1e-3, 1.01, 1.5, 2.0,
                   3.0]


def _alpha32(a: float) -> float:
    return float(torch.tensor(a, dtype=torch.float32))


def _row_alpha_grad(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    a = a.clone().requires_grad_()
    p = attnkern.entmax_bisect(x, a, dim=-1)
    (p * torch.arange(x.shape[-1], dtype=x.dtype)).sum().backward()
    return a.grad


@pytest.mark.parametrize("alpha", ALPHAS_NEAR_ONE)
def test_row_alpha_grad_float32_matches_float64(alpha):
    """The issue's case: x ~ N(0, 1) of shape (5, 40), one α per row."""
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(5, 40, generator=g, dtype=torch.float64).float().double()
    a = torch.full((5, 1), _alpha32(alpha), dtype=torch.float64)
    d64 = _row_alpha_grad(x64, a)
    d32 = _row_alpha_grad(x64.float(), a.float())
    err = (d32.double() - d64).abs().max().item()
    assert err <= 1e-3 * d64.abs().max().item(), (alpha, d32.flatten().tolist(), d64.flatten().tolist())


@pytest.mark.parametrize("alpha", [0.7, 1 - 1e-3, 1 - 1e-7, 1.0, 1 + 1e-7, 1 + 1e-5, 1.2, 1.3, 1.6])
def test_row_alpha_grad_float64_exact(alpha):
    """float64 dα of the kernels against the reference's ∂p/∂α (each free of the
    closed form's 1/b² cancellation near α = 1): agreement to rounding."""
    from attnkern.autograd import entmax_alpha_derivative

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=g, dtype=torch.float64)
    w = torch.randn(5, 40, generator=g, dtype=torch.float64)
    a = torch.full((5, 1), alpha, dtype=torch.float64, requires_grad=True)
    (attnkern.entmax_bisect(x, a, dim=-1) * w).sum().backward()
    with torch.no_grad():
        p = reference.entmax(x, a.detach(), -1)
        want = (entmax_alpha_derivative(p, a.detach(), -1) * w).sum(-1, keepdim=True)
    torch.testing.assert_close(a.grad, want, rtol=1e-11, atol=1e-11 * want.abs().max().item())


def test_row_alpha_grad_is_continuous_through_one():
    """dα on either side of α = 1 in float32 agrees with the softmax-limit derivative."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 40, generator=g)
    at_one = _row_alpha_grad(x.double(), torch.ones(5, 1, dtype=torch.float64))
    for a in (1 - 1e-5, 1 + 1e-5, 1 + 1e-4):
        d = _row_alpha_grad(x, torch.full((5, 1), a))
        assert (d.double() - at_one).abs().max() <= 2e-3 * at_one.abs().max(), (a, d, at_one)


def _fused_alpha_grad(alpha: torch.Tensor, dtype, backend, seed=2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    a = alpha.to(dtype).clone().requires_grad_()
    out = attnkern.attention(q, k, v, normalizer="entmax", alpha=a, backend=backend)
    out.square().sum().backward()
    return a.grad


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("alpha", ALPHAS_NEAR_ONE)
def test_fused_alpha_grad_float32_matches_float64(alpha, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    a = torch.tensor([_alpha32(alpha), _alpha32(2 - alpha if alpha < 2 else alpha + 0.5)], dtype=torch.float64)
    d64 = _fused_alpha_grad(a, torch.float64, backend)
    d32 = _fused_alpha_grad(a, torch.float32, backend)
    err = (d32.double() - d64).abs().max().item()
    assert err <= 1e-3 * d64.abs().max().item(), (alpha, d32.tolist(), d64.tolist())


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("alphas", [(1.0001, 1.3), (1 - 1e-7, 1 + 1e-5), (1.0, 0.8)])
def test_fused_alpha_grad_matches_reference_float64(backend, alphas):
    """The float64 kernels that the float32 tests compare with are themselves right,
    to rounding, near α = 1 too (no 1/(α - 1)² cancellation on either side)."""
    if backend == "triton":
        pytest.importorskip("triton")
    a = torch.tensor(alphas, dtype=torch.float64)
    d = _fused_alpha_grad(a, torch.float64, backend)
    dr = _fused_alpha_grad(a, torch.float64, "reference")
    # (The reference's fused path agrees to ~1e-7 relative at any α; the closed form
    # would be off by ~eps/b² ~ 1e-2 at b = 1e-7.)
    torch.testing.assert_close(d, dr, atol=1e-6 * dr.abs().max().item(), rtol=1e-6)


# --- α > 2 in float32 ----------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [2.5, 5.0, 10.0, 20.0])
def test_row_alpha_above_two_float32_matches_float64(alpha):
    """The issue's case: x ~ N(0, 1) of shape (6, 30); p has an infinite slope at
    the edge of its support, so the float32 path must not form that edge in float32."""
    g = torch.Generator().manual_seed(3)
    # Scaled by 1 / (α - 1) so that the supports keep several entries: with
    # N(0, 1) scores and α = 20 almost every row is one-hot (zero gradient).
    x = torch.randn(6, 30, generator=g) * (2.0 / (alpha - 1))
    w = torch.randn(6, 30, generator=g)
    outs = {}
    for dtype in (torch.float32, torch.float64):
        xi = x.to(dtype).detach().clone().requires_grad_()
        p = attnkern.entmax_bisect(xi, alpha, dim=-1)
        (p * w.to(dtype)).sum().backward()
        outs[dtype] = (p.detach().double(), xi.grad.double())
    (p32, g32), (p64, g64) = outs[torch.float32], outs[torch.float64]
    assert (p32 - p64).abs().max() <= 1e-5, (p32 - p64).abs().max()
    assert (g32 - g64).abs().max() <= 1e-3 * g64.abs().max(), ((g32 - g64).abs().max(), g64.abs().max())


@pytest.mark.parametrize("alpha", [2.5, 5.0, 10.0, 20.0])
def test_fused_alpha_above_two_float32_matches_float64(alpha):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(3))
    q = q * (2.0 / (alpha - 1))  # several keys in each support (see above)
    w = torch.randn(2, 2, 24, 8, generator=g)
    res = {}
    for dtype in (torch.float32, torch.float64):
        qi, ki, vi = (t.to(dtype).detach().clone().requires_grad_() for t in (q, k, v))
        out = attnkern.attention(qi, ki, vi, normalizer="entmax", alpha=alpha, backend="cpu")
        (out * w.to(dtype)).sum().backward()
        res[dtype] = [t.detach().double() for t in (out, qi.grad, ki.grad, vi.grad)]
    o32, *g32 = res[torch.float32]
    o64, *g64 = res[torch.float64]
    assert (o32 - o64).abs().max() <= 1e-5
    for a, b in zip(g32, g64, strict=True):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max(), ((a - b).abs().max(), b.abs().max())


# --- results independent of the thread count ----------------------------------------------


def _at_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _fused_step(normalizer, alpha, B, H, Hk, L, S, E, causal=False):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, E, generator=g).requires_grad_()
    k = torch.randn(B, Hk, S, E, generator=g).requires_grad_()
    v = torch.randn(B, Hk, S, E, generator=g).requires_grad_()
    w = torch.randn(B, H, L, E, generator=g)
    a = None if alpha is None else torch.full((H,), alpha).requires_grad_()
    out = attnkern.attention(q, k, v, is_causal=causal, normalizer=normalizer, alpha=a, backend="cpu",
                             enable_gqa=Hk != H)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad] + ([a.grad] if a is not None else [])


@pytest.mark.parametrize("normalizer,alpha", [("softmax", None), ("sparsemax", None), ("entmax15", None),
                                              ("entmax", 1.3), ("entmax", 1.0)])
@pytest.mark.parametrize("shape", [(1, 1, 1, 300, 300, 16), (1, 2, 1, 200, 257, 8), (2, 4, 4, 65, 97, 8)],
                         ids=["one-head", "gqa", "batch"])
def test_fused_bitwise_identical_at_one_and_two_threads(normalizer, alpha, shape):
    B, H, Hk, L, S, E = shape
    one = _at_threads(1, lambda: _fused_step(normalizer, alpha, B, H, Hk, L, S, E, causal=L == S))
    two = _at_threads(2, lambda: _fused_step(normalizer, alpha, B, H, Hk, L, S, E, causal=L == S))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dalpha"][:len(one)], one, two, strict=True):
        assert torch.equal(a, b), f"{name} differs between 1 and 2 threads: {(a - b).abs().max()}"


@pytest.mark.parametrize("alpha_shape", [(), (1, 1), (64, 1)], ids=["scalar", "one", "per-row"])
def test_row_alpha_grad_bitwise_identical_at_one_and_two_threads(alpha_shape):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64 * 1024, 40, generator=g).view(64, 1024, 40)
    w = torch.randn(64, 1024, 40, generator=g)

    def run():
        a = torch.full(alpha_shape, 1.3).requires_grad_()
        xi = x.clone().requires_grad_()
        (attnkern.entmax(xi, a.unsqueeze(-1) if a.dim() else a, dim=-1) * w).sum().backward()
        return xi.grad, a.grad

    one, two = _at_threads(1, run), _at_threads(2, run)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]), (one[1], two[1])


# --- half-precision gradients of broadcast inputs ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15"])
def test_half_gradients_of_broadcast_query(dtype, normalizer):
    """A 3-d query (H, L, E) against 4-d keys and values (B, H, S, E): dq sums
    over B. Errors against float64 within FlashAttention's rule of SDPA's own."""
    from attnkern.testing import half_rule_bound

    g = torch.Generator().manual_seed(7)
    B, H, L, S, E = 4, 4, 3, 6, 8
    q = torch.randn(H, L, E, generator=g, dtype=torch.float64) * 3
    k = torch.randn(B, H, S, E, generator=g, dtype=torch.float64) * 3
    v = torch.randn(B, H, S, E, generator=g, dtype=torch.float64) * 3
    go = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)

    def grads(fn, dt):
        ts = [t.to(dt).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*ts), ts, go.to(dt))

    exact = grads(lambda *t: reference.attention(*t, normalizer=normalizer), torch.float64)
    ours = grads(lambda *t: attnkern.attention(*t, normalizer=normalizer, backend="cpu"), dtype)
    if normalizer == "softmax":
        theirs = grads(lambda *t: F.scaled_dot_product_attention(*t), dtype)
    else:  # plain PyTorch in the same precision: the reference's formula evaluated in `dtype`
        theirs = grads(lambda *t: _plain_attention(*t, normalizer), dtype)
    for name, a, b, x in zip(["dq", "dk", "dv"], ours, theirs, exact, strict=True):
        # Errors relative to the gradient's magnitude (entries reach ~30 here,
        # where one float16 ulp is 0.016), so the rule's rounding band applies.
        mag = x.abs().max().item()
        err_ours = (a.double() - x).abs().max().item() / mag
        err_theirs = (b.double() - x).abs().max().item() / mag
        assert half_rule_bound(err_ours, err_theirs, dtype), (name, err_ours, err_theirs)


def _plain_attention(q, k, v, normalizer):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    p = {"sparsemax": reference.sparsemax, "entmax15": reference.entmax15}[normalizer](s.float(), -1).to(q.dtype)
    return p @ v
