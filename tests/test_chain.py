"""The binary linear-chain ops. attnkern.crf_marginals, the marginals of a
linear-chain CRF: the CPU kernel (forward-backward, the backward by tangents
through a second pass) and the reference (autograd of log Z) against
enumeration of all 2^n labelings; gradients against the covariance of z
computed by enumeration. attnkern.sparsemap_chain: kernel and reference against
the QP over the chain's marginal polytope solved by a generic solver. For both:
gradcheck, gradients against the reference's autograd, masks, dtypes, dims,
errors, opcheck and torch.compile."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import attnkern
from attnkern import _extension

scipy_optimize = pytest.importorskip("scipy.optimize")
pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

NAMES = ["crf_marginals", "sparsemap_chain"]


def labelings(u: np.ndarray, w: np.ndarray):
    """Every labeling of the row's finite entries with its probability: (z
    (count, m) over the finite entries, p (count,), positions of the finite
    entries)."""
    pos = np.flatnonzero(u > -np.inf)
    m = pos.size
    z = np.array(list(itertools.product((0, 1), repeat=m)), dtype=np.int64).reshape(-1, m)
    with np.errstate(invalid="ignore"):
        score = z @ u[pos] + (w[z[:, :-1], z[:, 1:]].sum(1) if m > 1 else 0.0)
    top = score.max()
    weight = np.exp(score - top)
    return z, weight / weight.sum(), pos


def enumerated(u: np.ndarray, w: np.ndarray) -> np.ndarray:
    """P(z_i = 1) by enumeration (n <= 12), 0 at -inf entries."""
    out = np.zeros_like(u)
    if (u > -np.inf).any():
        z, p, pos = labelings(u, w)
        out[pos] = p @ z
    return out


def random_case(n, rows=4, scale=1.0, seed=0, per_row=False):
    g = torch.Generator().manual_seed(seed + 31 * n)
    u = scale * torch.randn(rows, n, generator=g, dtype=torch.float64)
    w = scale * torch.randn(rows, 2, 2, generator=g, dtype=torch.float64) if per_row else \
        scale * torch.randn(2, 2, generator=g, dtype=torch.float64)
    return u, w


def oracle(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ws = w.expand(u.shape[0], 2, 2).numpy()
    return torch.tensor(np.stack([enumerated(r, ws[i]) for i, r in enumerate(u.numpy())]))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("n", [1, 2, 5, 11])
@pytest.mark.parametrize("per_row", [False, True])
def test_matches_enumeration(n, per_row, backend):
    u, w = random_case(n, per_row=per_row)
    mu = attnkern.crf_marginals(u, w, backend=backend)
    torch.testing.assert_close(mu, oracle(u, w), rtol=0, atol=1e-12)


def test_independent_labels_without_pairwise_scores():
    # With W = 0 the labels are independent: μ = sigmoid(u), whatever the chain.
    u, _ = random_case(40, seed=1)
    torch.testing.assert_close(attnkern.crf_marginals(u, torch.zeros(2, 2, dtype=torch.float64)), torch.sigmoid(u),
                               rtol=0, atol=1e-14)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_forbidden_transitions(backend):
    # W[1][1] = -inf: no two neighbouring ones (among the finite entries).
    u, w = random_case(9, rows=3, seed=2)
    w[1, 1] = -math.inf
    u[1, 4] = -math.inf
    mu = attnkern.crf_marginals(u, w, backend=backend)
    torch.testing.assert_close(mu, oracle(u, w), rtol=0, atol=1e-12)
    # Every transition forbidden: only a single entry has a labeling.
    none = torch.full((2, 2), -math.inf, dtype=torch.float64)
    out = attnkern.crf_marginals(torch.tensor([[0.3, 0.1], [0.3, -math.inf]], dtype=torch.float64), none,
                                 backend=backend)
    assert out[0].isnan().all()
    torch.testing.assert_close(out[1], torch.tensor([torch.sigmoid(torch.tensor(0.3)).item(), 0.0],
                                                    dtype=torch.float64))


@pytest.mark.parametrize("scale", [1e-6, 1e4])
def test_magnitudes(scale):
    u, w = random_case(10, scale=scale, seed=3, per_row=True)
    torch.testing.assert_close(attnkern.crf_marginals(u, w), oracle(u, w), rtol=0, atol=1e-12)


@pytest.mark.parametrize("reach", [199.0, 201.0, 2000.0])
def test_either_side_of_the_linear_range(reach):
    # The kernel rescales linear messages when W's spread plus max |u| is at
    # most 200 and works in log space beyond; both must match enumeration.
    u, w = random_case(10, rows=3, seed=18, per_row=True)
    spread = w.amax((-2, -1)) - w.amin((-2, -1))
    u = u / u.abs().amax(-1, keepdim=True) * (reach - spread).unsqueeze(-1)
    u[:, 0] = torch.where(u[:, 0].abs() < 1, u[:, 0], u[:, 0].sign() * 0.5)
    u[:, 1] = reach - spread  # the largest |u|
    torch.testing.assert_close(attnkern.crf_marginals(u, w), oracle(u, w), rtol=0, atol=1e-12)
    us, ws = u.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.randn(3, 10, generator=torch.Generator().manual_seed(19), dtype=torch.float64)
    got = torch.autograd.grad(attnkern.crf_marginals(us, ws), (us, ws), g)
    want = torch.autograd.grad(attnkern.crf_marginals(us, ws, backend="reference"), (us, ws), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("level", [0.0, -150.0, 150.0])
def test_long_rows_keep_their_messages_in_range(level):
    # W = 0 and a constant u: the messages' sums grow or shrink by the same
    # factor at each of 3000 entries, far past double's range unless rescaled.
    u = torch.full((2, 3000), level, dtype=torch.float64)
    u[1, ::7] = level + 3.0
    got = attnkern.crf_marginals(u, torch.zeros(2, 2, dtype=torch.float64))
    torch.testing.assert_close(got, torch.sigmoid(u), rtol=1e-12, atol=0)


def test_independent_labels_stay_exact_along_long_rows():
    # With W = 0 the labels are independent: μ = sigmoid(u) and du = μ(1 - μ)·g at every entry, however
    # far from the row's end. Rows side by side take μ backwards through the chain, a recurrence that keeps
    # the pair's sum and so piles its rounding into a common factor; it must not reach the outputs.
    g = torch.Generator().manual_seed(41)
    u = (torch.randn(9, 4096, generator=g, dtype=torch.float64) * 3).requires_grad_()
    go = torch.randn(9, 4096, generator=g, dtype=torch.float64)
    mu = attnkern.crf_marginals(u, torch.zeros(2, 2, dtype=torch.float64))
    want = torch.sigmoid(u.detach())
    torch.testing.assert_close(mu, want, rtol=2e-15, atol=0)
    mu.backward(go)
    torch.testing.assert_close(u.grad, want * torch.sigmoid(-u.detach()) * go, rtol=1e-14, atol=0)


@pytest.mark.parametrize("coupling", [0.0, 3.0, 4.0, 4.5])
def test_float_rows_in_float_lanes_stay_within_ten_ulps(coupling):
    # float, bfloat16 and float16 rows whose chain is coupled by |log ρ| <= 4 (ρ = e^{W00 + W11 - W01 - W10})
    # and whose scores fit run 16 to a vector in float arithmetic: μ within 10 float ulps of the float64
    # result, du within 1e-6 of max |du|. More strongly coupled rows run in double: within one ulp.
    g = torch.Generator().manual_seed(43)
    w = torch.tensor([[coupling / 4, -coupling / 4], [-coupling / 4, coupling / 4]], dtype=torch.float64)
    w = w + 1e-3 * torch.randn(2, 2, generator=g, dtype=torch.float64)
    allowed = 10.0 if coupling <= 4 else 1.0
    for scale in (0.1, 1.0, 10.0):
        u = (torch.randn(17, 1025, generator=g) * scale).requires_grad_()
        go = torch.randn(17, 1025, generator=g)
        mu = attnkern.crf_marginals(u, w)
        mu.backward(go)
        u64 = u.detach().double().requires_grad_()
        want = attnkern.crf_marginals(u64, w)
        want.backward(go.double())
        ulp = torch.from_numpy(np.spacing(want.detach().float().abs().numpy())).double()
        assert ((mu.double() - want.detach()).abs() / ulp).max() <= allowed
        assert (u.grad.double() - u64.grad).abs().max() <= 1e-6 * u64.grad.abs().max()
        # A row's result does not depend on the rows that share its group.
        one = attnkern.crf_marginals(u.detach()[5:6], w)
        assert torch.equal(one[0], mu.detach()[5])


def test_long_rows_match_the_reference():
    u, w = random_case(1025, rows=2, seed=4, per_row=True)
    u[0, 100:140] = -math.inf
    torch.testing.assert_close(attnkern.crf_marginals(u, w), attnkern.crf_marginals(u, w, backend="reference"),
                               rtol=0, atol=1e-11)


@pytest.mark.parametrize("name", NAMES)
def test_minus_inf_entries_are_removed_and_bad_rows_stay_in_their_row(name):
    op = getattr(attnkern, name)
    u, w = random_case(12, rows=5, seed=5)
    u[0, [2, 3, 7]] = -math.inf
    u[1] = -math.inf
    u[2, 4] = math.nan
    u[3, 0] = math.inf
    mu = op(u, w)
    keep = u[0] > -math.inf
    torch.testing.assert_close(mu[0, keep], op(u[0, keep], w))
    assert (mu[0, ~keep] == 0).all() and (mu[1] == 0).all()
    assert mu[2].isnan().all() and mu[3].isnan().all() and not mu[[0, 1, 4]].isnan().any()
    torch.testing.assert_close(op(u, w, backend="reference"), mu, equal_nan=True)
    ug = u.clone().requires_grad_()
    op(ug, w).sum().backward()
    assert ug.grad[[2, 3]].isnan().all() and not ug.grad[[0, 1, 4]].isnan().any()
    assert (ug.grad[0, ~keep] == 0).all() and (ug.grad[1] == 0).all()


def test_gradient_is_the_covariance_of_the_labels():
    """dμ/du is Cov(z) (the Hessian of log Z), and d(g·μ)/dW[a][b] is
    Cov(g·z, #transitions a→b): both by enumeration, independent of either
    implementation."""
    u, w = random_case(8, rows=3, seed=6, per_row=True)
    u[1, 2] = -math.inf
    g = torch.randn(3, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    us, ws = u.clone().requires_grad_(), w.clone().requires_grad_()
    du, dw = torch.autograd.grad(attnkern.crf_marginals(us, ws), (us, ws), g)
    for r in range(3):
        z, p, pos = labelings(u[r].numpy(), w[r].numpy())
        gz = z @ g[r].numpy()[pos]
        cov = (p[:, None] * z * gz[:, None]).sum(0) - (p @ z) * (p @ gz)
        want = np.zeros(8)
        want[pos] = cov
        np.testing.assert_allclose(du[r].numpy(), want, rtol=0, atol=1e-12)
        for a, b in itertools.product((0, 1), repeat=2):
            count = ((z[:, :-1] == a) & (z[:, 1:] == b)).sum(1)
            np.testing.assert_allclose(dw[r, a, b].item(), p @ (count * gz) - (p @ count) * (p @ gz), atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("per_row", [False, True])
def test_gradcheck(per_row, name):
    op = getattr(attnkern, name)
    g = torch.Generator().manual_seed(8)
    u = torch.randn(3, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w_shape = (3, 7, 2, 2) if per_row else (2, 2)
    w = torch.randn(*w_shape, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, dim=1), (u, w))
    w_last = torch.randn(*((3, 4, 2, 2) if per_row else (2, 2)), generator=g, dtype=torch.float64,
                         requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, dim=-1), (u, w_last))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_the_reference_autograd(masked, name):
    op = getattr(attnkern, name)
    u, w = random_case(40, rows=6, seed=9, per_row=True)
    if masked:
        u[:, [3, 4, 20]] = -math.inf
        u[5] = -math.inf
        w[2, 0, 1] = -math.inf
    go = torch.randn(6, 40, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    grads = []
    for backend in ("cpu", "reference"):
        us, ws = u.clone().requires_grad_(), w.clone().requires_grad_()
        grads.append(torch.autograd.grad(op(us, ws, backend=backend), (us, ws), go))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_dtypes(dtype, tol, name):
    op = getattr(attnkern, name)
    u, w = random_case(97, rows=3, seed=11)
    want = op(u.to(dtype).double(), w)
    us = u.to(dtype).requires_grad_()
    ws = w.to(dtype).requires_grad_()
    mu = op(us, ws)
    assert mu.dtype == dtype
    torch.testing.assert_close(mu.double(), want, rtol=0, atol=tol)
    go = torch.randn(3, 97, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    du, dw = torch.autograd.grad(mu, (us, ws), go.to(dtype))
    u64, w64 = u.to(dtype).double().requires_grad_(), w.to(dtype).double().requires_grad_()
    want_du, want_dw = torch.autograd.grad(op(u64, w64), (u64, w64), go.to(dtype).double())
    assert du.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(du.double(), want_du, rtol=0, atol=tol * max(1.0, float(want_du.abs().max())))
    torch.testing.assert_close(dw.double(), want_dw, rtol=tol, atol=tol * max(1.0, float(want_dw.abs().max())))


@pytest.mark.parametrize("n", [1, 2, 9, 97, 1025])
def test_crf_rows_side_by_side_match_rows_one_at_a_time(n):
    # The kernel runs rows whose entries are all finite and of moderate size side by side, one row per
    # vector lane; a row holding -inf (or entries too large for the linear sweep) goes alone. Appending a
    # -inf entry sends the same finite entries down the per-row path: both must agree, in every group
    # position (19 rows: full groups and a partial one at any vector width), with rows of every kind mixed.
    g = torch.Generator().manual_seed(40 + n)
    u = torch.randn(19, n, generator=g, dtype=torch.float64) * 3
    u[4] *= 100  # beyond the linear sweep's range: per-row path
    u[7, n // 2] = -math.inf  # a masked entry: per-row path
    w = torch.randn(19, 2, 2, generator=g, dtype=torch.float64)
    grad = torch.randn(19, n, generator=g, dtype=torch.float64)
    alone = torch.cat([u, torch.full((19, 1), -math.inf, dtype=torch.float64)], 1)
    a = u.clone().requires_grad_()
    wa = w.clone().requires_grad_()
    mu = attnkern.crf_marginals(a, wa)
    mu.backward(grad)
    b = alone.clone().requires_grad_()
    wb = w.clone().requires_grad_()
    mu_alone = attnkern.crf_marginals(b, wb)
    mu_alone.backward(torch.cat([grad, torch.zeros(19, 1, dtype=torch.float64)], 1))
    torch.testing.assert_close(mu, mu_alone[:, :n], rtol=0, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad[:, :n], rtol=0, atol=1e-11)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-10, atol=1e-10)
    # A row's result does not depend on the rows that share its group.
    for r in (0, 5, 18):
        one = u[r:r + 1].clone().requires_grad_()
        w1 = w[r:r + 1].clone().requires_grad_()
        mu1 = attnkern.crf_marginals(one, w1)
        mu1.backward(grad[r:r + 1])
        assert torch.equal(mu1[0], mu[r]) and torch.equal(one.grad[0], a.grad[r])
        assert torch.equal(w1.grad[0], wa.grad[r])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3, 9, 97, 1025])
def test_crf_lanes_read_rows_in_place_as_staged_rows(dtype, n):
    # Rows at stride 1 go into the side-by-side lanes straight from the tensor (a block of lanes' entries
    # transposed at a time, the entries past the last whole block one by one) and come back the same way;
    # rows along another dim are staged one at a time. Both must give the same bits, in full and partial
    # groups of lanes (11 rows), values and gradients in u and W.
    g = torch.Generator().manual_seed(70 + n)
    u = (torch.randn(11, n, generator=g, dtype=torch.float64) * 2).to(dtype)
    w = torch.randn(11, 2, 2, generator=g, dtype=torch.float64)
    grad = torch.randn(11, n, generator=g, dtype=torch.float64).to(dtype)
    a, wa = u.clone().requires_grad_(), w.clone().requires_grad_()
    mu = attnkern.crf_marginals(a, wa)
    mu.backward(grad)
    b, wb = u.t().contiguous().requires_grad_(), w.clone().requires_grad_()
    mu_staged = attnkern.crf_marginals(b, wb, dim=0)
    mu_staged.backward(grad.t())
    assert mu.dtype == dtype
    assert torch.equal(mu, mu_staged.t())
    assert torch.equal(a.grad, b.grad.t())
    assert torch.equal(wa.grad, wb.grad)
    want = attnkern.crf_marginals(u.double(), w, backend="reference")
    torch.testing.assert_close(mu.double(), want, rtol=0, atol={torch.float64: 1e-12, torch.float32: 1e-6,
                                                                torch.bfloat16: 1e-2}[dtype])


@pytest.mark.parametrize("name", NAMES)
def test_any_dim_strides_empty_and_threads(name):
    op = getattr(attnkern, name)
    u = torch.randn(5 * 7 * 11, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    u = u.view(5, 7, 11).transpose(0, 2)  # (11, 7, 5), not contiguous
    w = torch.tensor([[0.2, -0.5], [0.1, 0.7]], dtype=torch.float64)
    for dim in (0, 1, 2, -1):
        want = op(u.movedim(dim, -1).contiguous(), w).movedim(-1, dim)
        assert torch.equal(op(u, w, dim=dim), want)
    # One 2×2 per row, rows along dim 1: (11, 5) rows.
    per_row = torch.randn(11, 5, 2, 2, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    got = op(u, per_row, dim=1)
    assert torch.equal(got[3, :, 2], op(u[3, :, 2], per_row[3, 2]))
    assert op(torch.zeros(0, 5), w).shape == (0, 5)
    assert op(torch.zeros(3, 0), w).shape == (3, 0)
    torch.testing.assert_close(op(torch.tensor(2.0), w), op(torch.tensor([2.0]), w)[0])
    big, wb = random_case(300, rows=64, seed=15, per_row=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(big, wb)
        torch.set_num_threads(2)
        assert torch.equal(op(big, wb), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NAMES)
def test_errors_name_the_argument(name):
    op = getattr(attnkern, name)
    u = torch.randn(2, 5)
    w = torch.zeros(2, 2)
    for bad in (torch.zeros(2), torch.zeros(3, 2), torch.zeros(3, 2, 2), torch.zeros(5, 2, 2)):
        with pytest.raises(ValueError, match="pairwise of shape"):
            op(u, bad)
    with pytest.raises(ValueError, match="pairwise must not hold NaN"):
        op(u, torch.tensor([[0.0, math.nan], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="pairwise must not hold NaN"):
        op(u, torch.tensor([[0.0, math.inf], [0.0, 0.0]]))
    with pytest.raises(TypeError, match="pairwise"):
        op(u, [[0.0, 0.0], [0.0, 0.0]])
    with pytest.raises(NotImplementedError, match="kernels for CPU tensors"):
        op(u.to("meta"), w.to("meta"))
    with pytest.raises(NotImplementedError, match="kernels for CPU tensors"):
        op(u, w, backend="cuda")
    us = u.double().requires_grad_()
    with pytest.raises(NotImplementedError, match=f"{name}: double backward"):
        torch.autograd.grad(op(us, w).pow(2).sum(), us, create_graph=True)
    with pytest.raises(NotImplementedError, match=f"{name}: forward-mode"):
        with torch.autograd.forward_ad.dual_level():
            op(torch.autograd.forward_ad.make_dual(u, torch.ones_like(u)), w)
    # The op checks too.
    with pytest.raises(ValueError, match="pairwise must not hold NaN"):
        getattr(torch.ops.attnkern, f"{name}_fwd")(u, torch.full((2, 2), math.nan), -1)
    with pytest.raises(ValueError, match="pairwise must have shape"):
        getattr(torch.ops.attnkern, f"{name}_fwd")(u, torch.zeros(3, 2, 2), -1)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck_and_compile(name):
    op = getattr(attnkern, name)
    u, w = random_case(23, rows=3, seed=16, per_row=True)
    u, w = u.float(), w.float()
    torch.library.opcheck(getattr(torch.ops.attnkern, f"{name}_fwd"), (u, w, -1))
    torch.library.opcheck(getattr(torch.ops.attnkern, f"{name}_bwd"), (u, torch.randn_like(u), w, -1, True))
    torch.library.opcheck(getattr(torch.ops.attnkern, f"{name}_bwd"), (u, torch.randn_like(u), w[0], -1, False))

    def f(a, b):
        return op(a, b)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    us, ws = u.clone().requires_grad_(), w.clone().requires_grad_()
    out = compiled(us, ws)
    out.pow(2).sum().backward()
    ue, we = u.clone().requires_grad_(), w.clone().requires_grad_()
    f(ue, we).pow(2).sum().backward()
    assert torch.equal(out, f(u, w)) and torch.equal(us.grad, ue.grad) and torch.equal(ws.grad, we.grad)


@pytest.mark.parametrize("name, module", [("crf_marginals", "CrfMarginals"), ("sparsemap_chain", "SparsemapChain")])
def test_module_learns_its_transition_scores(name, module):
    m = getattr(attnkern.nn, module)(dim=-1)
    assert isinstance(m.pairwise, torch.nn.Parameter) and m.pairwise.shape == (2, 2)
    u, _ = random_case(10, rows=4, seed=17)
    u = u.float()
    m(u).pow(2).sum().backward()
    assert m.pairwise.grad is not None and m.pairwise.grad.abs().sum() > 0
    with torch.no_grad():
        m.pairwise.copy_(torch.tensor([[0.0, -1.0], [0.5, 2.0]]))
    want = getattr(attnkern, name)(u.double(), m.pairwise.detach().double(), backend="reference")
    torch.testing.assert_close(m(u), want.float(), rtol=0, atol=1e-6)


# --- SparseMAP ------------------------------------------------------------------------------------


def sparsemap_qp(u: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """SparseMAP of one row of finite entries by a generic solver: the QP over
    the chain's local polytope (exact for a chain), variables μ_i and the
    pairwise marginals ξ_i(a, b), forbidden transitions bounded to 0. Returns
    μ and its objective (by sparsemap_objective, so that a slightly infeasible
    solver's point is not credited with more than its μ earns)."""
    m = u.size
    size = m + 4 * (m - 1)

    def xi(i, a, b):
        return m + 4 * i + 2 * a + b

    rows, rhs = [], []  # per edge: ξ sums to 1, its margins are μ_i and μ_{i+1}
    for i in range(m - 1):
        r = np.zeros(size)
        r[[xi(i, a, b) for a, b in itertools.product((0, 1), repeat=2)]] = 1.0
        rows.append(r)
        rhs.append(1.0)
        for first in (True, False):
            r = np.zeros(size)
            r[[xi(i, 1, b) if first else xi(i, b, 1) for b in (0, 1)]] = 1.0
            r[i if first else i + 1] = -1.0
            rows.append(r)
            rhs.append(0.0)
    finite_w = np.where(np.isfinite(w), w, 0.0)
    linear = np.concatenate([u] + [finite_w.reshape(-1)] * (m - 1))
    upper = np.ones(size)
    for i in range(m - 1):
        for a, b in itertools.product((0, 1), repeat=2):
            if not np.isfinite(w[a, b]):
                upper[xi(i, a, b)] = 0.0

    def objective(v):
        return -(linear @ v - 0.5 * np.sum(v[:m] ** 2))

    def gradient(v):
        g = -linear.copy()
        g[:m] += v[:m]
        return g

    constraints = [{"type": "eq", "fun": lambda v: np.array(rows) @ v - np.array(rhs),
                    "jac": lambda v: np.array(rows)}] if rows else []
    # A feasible start: the best labeling (by dynamic programming), as a vertex.
    best = best_labeling(u, w)
    start = np.zeros(size)
    start[:m] = best
    for i in range(m - 1):
        start[xi(i, best[i], best[i + 1])] = 1.0
    res = scipy_optimize.minimize(objective, start, jac=gradient, method="SLSQP",
                                  bounds=list(zip(np.zeros(size), upper, strict=True)), constraints=constraints,
                                  options={"ftol": 1e-15, "maxiter": 2000})
    # 8: it cannot improve further in line search; 9: the iteration limit, which the long
    # row hits on some CPUs (a Zen 3, not a Zen 4) while already at the optimum: ftol
    # 1e-15 is finer than its line search resolves there. The callers compare μ and the
    # objectives, which catch a point short of the optimum.
    assert res.status in (0, 8, 9), res.message
    mu = np.clip(res.x[:m], 0.0, 1.0)
    return mu, sparsemap_objective(mu, u, w)


def best_labeling(u: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmax_z Σ u_i z_i + Σ w[z_i, z_{i+1}] by dynamic programming (rows too
    long to enumerate)."""
    value, back = np.array([0.0, u[0]]), []
    for ui in u[1:]:
        options = value[:, None] + w  # [from, to]
        back.append(options.argmax(0))
        value = options.max(0) + np.array([0.0, ui])
    z = [int(value.argmax())]
    for choice in reversed(back):
        z.append(int(choice[z[-1]]))
    return np.array(z[::-1])


def sparsemap_objective(mu: np.ndarray, u: np.ndarray, w: np.ndarray) -> float:
    """The best objective for the given unary marginals: the pairwise part is
    linear, so it is maximised over the pairwise marginals consistent with μ
    (a 2×2 table per edge with margins μ_i, μ_{i+1}: one free parameter)."""
    total = u @ mu - 0.5 * np.sum(mu ** 2)
    for i in range(mu.size - 1):
        lo, hi = max(0.0, mu[i] + mu[i + 1] - 1.0), min(mu[i], mu[i + 1])
        best = -np.inf
        for both in (lo, hi):  # ξ(1, 1); the objective is linear in it
            table = np.array([[1 - mu[i] - mu[i + 1] + both, mu[i + 1] - both], [mu[i] - both, both]])
            with np.errstate(invalid="ignore"):
                best = max(best, np.sum(np.where(table > 1e-15, w * table, 0.0)))
        total += best
    return total


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("n", [1, 2, 5, 9])
@pytest.mark.parametrize("per_row", [False, True])
def test_sparsemap_matches_the_qp(n, per_row, backend):
    u, w = random_case(n, rows=3, seed=20, per_row=per_row)
    mu = attnkern.sparsemap_chain(u, w, backend=backend)
    ws = w.expand(3, 2, 2).numpy()
    for r in range(3):
        want, best = sparsemap_qp(u[r].numpy(), ws[r])
        # (SLSQP lands within about 1e-7 of the optimum; ours is exact, and
        # its objective is never below the solver's.)
        np.testing.assert_allclose(mu[r].numpy(), want, atol=2e-6)
        assert sparsemap_objective(mu[r].numpy(), u[r].numpy(), ws[r]) >= best - 1e-9


def test_sparsemap_without_pairwise_scores_clamps():
    u, _ = random_case(40, seed=21)
    torch.testing.assert_close(attnkern.sparsemap_chain(u, torch.zeros(2, 2, dtype=torch.float64)), u.clamp(0, 1),
                               rtol=0, atol=1e-14)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sparsemap_plateaus_ties_and_forbidden_transitions(backend):
    # Equal scores make many labelings tie and their 0/1 vectors affinely
    # dependent: the active set must still reach the optimum.
    u = torch.tensor([[0.5] * 8, [0.3, 0.3, 0.7, 0.7, 0.3, 0.3, 0.7, 0.7], [1.0, -1.0] * 4,
                      [0.2, 0.9, 0.2, 0.9, 0.2, 0.9, 0.2, 0.9]], dtype=torch.float64)
    for w in (torch.tensor([[0.0, 0.0], [0.0, 0.4]]), torch.tensor([[0.3, -0.3], [-0.3, 0.3]]),
              torch.tensor([[0.0, 0.0], [0.0, -math.inf]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]])):
        w = w.double()
        mu = attnkern.sparsemap_chain(u, w, backend=backend)
        for r in range(u.shape[0]):
            want, best = sparsemap_qp(u[r].numpy(), w.numpy())
            np.testing.assert_allclose(mu[r].numpy(), want, atol=2e-6)
            assert sparsemap_objective(mu[r].numpy(), u[r].numpy(), w.numpy()) >= best - 1e-9


@pytest.mark.parametrize("scale", [1e-6, 1e4])
def test_sparsemap_magnitudes(scale):
    u, w = random_case(8, rows=2, scale=scale, seed=22, per_row=True)
    mu = attnkern.sparsemap_chain(u, w)
    for r in range(2):
        want, best = sparsemap_qp(u[r].numpy(), w[r].numpy())
        np.testing.assert_allclose(mu[r].numpy(), want, atol=2e-6)
        assert sparsemap_objective(mu[r].numpy(), u[r].numpy(), w[r].numpy()) >= best - 1e-9 * max(1.0, abs(best))


def test_sparsemap_long_rows_match_the_reference():
    u, w = random_case(300, rows=2, seed=23, per_row=True)
    u[0, 100:140] = -math.inf
    torch.testing.assert_close(attnkern.sparsemap_chain(u, w), attnkern.sparsemap_chain(u, w, backend="reference"),
                               rtol=0, atol=1e-10)


def test_sparsemap_active_set_gives_the_marginals():
    """return_active: the active labelings are labelings of the finite entries
    (0 at removed ones), their weights a distribution, and Σ_k ξ_k z_k the
    marginals; the support is at most n + 1 labelings (affinely independent)."""
    u, w = random_case(12, rows=30, seed=24, per_row=True)
    u[3, 2:5] = -math.inf
    u[4] = -math.inf  # no finite entry: no support
    u[5, 7] = math.nan  # NaN: no support either
    res = attnkern.sparsemap_chain(u, w, return_active=True)
    assert isinstance(res, attnkern.ops.SparsemapActiveSet)
    torch.testing.assert_close(res.marginals, attnkern.sparsemap_chain(u, w), rtol=0, atol=0, equal_nan=True)
    K = res.weights.shape[-1]
    assert res.structures.shape == (30, K, 12) and res.structures.dtype == torch.bool and 1 <= K <= 13
    support = (res.weights > 0).sum(-1)
    assert support.max() == K
    for r in range(30):
        if r in (4, 5):
            assert support[r] == 0 and res.oracle_calls[r] == 0 and not res.structures[r].any()
            continue
        k = int(support[r])
        assert (res.weights[r, k:] == 0).all() and not res.structures[r, k:].any()
        torch.testing.assert_close(res.weights[r, :k].sum(), torch.tensor(1.0, dtype=torch.float64))
        mixed = (res.weights[r, :k, None] * res.structures[r, :k].double()).sum(0)
        torch.testing.assert_close(mixed, res.marginals[r], rtol=0, atol=1e-12)
        # Every transition allowed: the closed form, certified by one Viterbi call.
        assert res.oracle_calls[r] == 1
    assert not res.structures[3, :, 2:5].any()


def test_sparsemap_active_set_along_another_dim_and_refusals():
    u, w = random_case(6, rows=5, seed=25)
    moved = attnkern.sparsemap_chain(u.T.contiguous(), w, dim=0, return_active=True)
    direct = attnkern.sparsemap_chain(u, w, return_active=True)
    for a, b in zip(moved[1:], direct[1:], strict=True):
        assert torch.equal(a, b)
    # Without pairwise scores each label is on its own: one labeling per distinct threshold of clamp(u, 0, 1).
    zero = attnkern.sparsemap_chain(u, torch.zeros(2, 2, dtype=torch.float64), return_active=True)
    mixed = (zero.weights[..., None] * zero.structures.double()).sum(-2)
    torch.testing.assert_close(mixed, u.clamp(0, 1), rtol=0, atol=1e-12)
    with pytest.raises(NotImplementedError, match="return_active"):
        attnkern.sparsemap_chain(u, w, backend="reference", return_active=True)


def test_sparsemap_active_set_op_passes_opcheck_and_compiles():
    u, w = random_case(7, rows=4, seed=26)
    torch.library.opcheck(torch.ops.attnkern.sparsemap_chain_active.default, (u, w, 1))

    def f(u, w):
        res = attnkern.sparsemap_chain(u, w, return_active=True)
        return res.weights.sum(-1), res.marginals

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(u, w)
    for a, b in zip(got, f(u, w), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# A row of a BiLSTM's attention scores from training (importance --quick, Rotten Tomatoes,
# SparseMAP, seed 3): 46 entries near 0.45 and pairwise scores near ±0.003, so the optimum is
# near u itself, inside the cube, and needs m + 1 = 47 labelings. The active set alone reached
# 47 labelings and then crept between nearly equal supports, gaining about 1e-11 of objective
# per exchange, until its step limit; the closed form solves it at once.
LONG_INTERIOR_ROW = [
    0.4898461103439331, 0.45017102360725403, 0.5038379430770874, 0.4517227113246918, 0.47928494215011597,
    0.43810027837753296, 0.5048350095748901, 0.4020206928253174, 0.4277220368385315, 0.45777732133865356,
    0.4248950779438019, 0.451314777135849, 0.43663594126701355, 0.45996999740600586, 0.4910595118999481,
    0.5405035018920898, 0.3515198230743408, 0.4455012083053589, 0.4914444088935852, 0.4577871859073639,
    0.562337338924408, 0.4574550986289978, 0.4464949369430542, 0.39151376485824585, 0.440684050321579,
    0.3610571026802063, 0.38377314805984497, 0.430389404296875, 0.47514772415161133, 0.3993415832519531,
    0.37083446979522705, 0.42860060930252075, 0.3564677834510803, 0.40248429775238037, 0.4703397750854492,
    0.5949571132659912, 0.48948895931243896, 0.44616374373435974, 0.4278847575187683, 0.46616247296333313,
    0.5374197363853455, 0.44895076751708984, 0.39557749032974243, 0.4294736385345459, 0.47104382514953613,
    0.46341001987457275
]
LONG_INTERIOR_W = [[0.0029999997932463884, 0.0029999969992786646], [-0.002999994670972228, -0.0029999995604157448]]


def sparsemap_gap(mu: np.ndarray, u: np.ndarray, w: np.ndarray) -> float:
    """The Frank-Wolfe gap of μ (with its best pairwise marginals) in the QP
    over the local polytope: how much the best labeling's linearised value
    exceeds μ's. It bounds the objective's distance to the optimum."""
    z = best_labeling(u - mu, w)
    value = (u - mu) @ z + w[z[:-1], z[1:]].sum()
    return value - (sparsemap_objective(mu, u, w) - 0.5 * mu @ mu)


def test_sparsemap_long_row_with_an_interior_optimum():
    u = torch.tensor([LONG_INTERIOR_ROW + [-math.inf] * 2], dtype=torch.float32)
    w = torch.tensor(LONG_INTERIOR_W, dtype=torch.float32)
    got = {b: attnkern.sparsemap_chain(u.double(), w.double(), backend=b)[0] for b in ("cpu", "reference")}
    torch.testing.assert_close(got["cpu"], got["reference"], rtol=0, atol=1e-12)
    assert got["cpu"][46:].eq(0).all() and ((got["cpu"][:46] > 0) & (got["cpu"][:46] < 1)).all()
    assert abs(sparsemap_gap(got["cpu"][:46].numpy(), u[0, :46].double().numpy(), w.double().numpy())) < 1e-12
    mu32 = attnkern.sparsemap_chain(u, w)[0]
    torch.testing.assert_close(mu32, got["cpu"].float(), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sparsemap_long_row_against_the_generic_solver():
    u, w = np.array(LONG_INTERIOR_ROW, dtype=np.float32).astype(np.float64), np.array(LONG_INTERIOR_W)
    w = w.astype(np.float32).astype(np.float64)
    want, best = sparsemap_qp(u, w)
    mu = attnkern.sparsemap_chain(torch.tensor(u), torch.tensor(w)).numpy()
    np.testing.assert_allclose(mu, want, atol=1e-5)
    assert sparsemap_objective(mu, u, w) >= best - 1e-12


@pytest.mark.parametrize("c_sign", [1.0, -1.0])
def test_sparsemap_closed_form_fuses_and_clamps(c_sign):
    """Rows where the closed form has runs fused by the TV prox, runs clamped
    at 0 and 1 and free entries, for both signs of c = W00 − W01 − W10 + W11
    (c < 0 mirrors the odd entries): values against the generic solver,
    gradients by gradcheck and against the reference's autograd through the
    KKT system of its support."""
    g = torch.Generator().manual_seed(27)
    u = torch.cat([torch.full((3,), 1.6), torch.full((3,), -0.7), torch.rand(6, generator=g)]).double()
    u = torch.stack([u, u.flip(0), 0.5 + 0.3 * torch.randn(12, generator=g, dtype=torch.float64)])
    w = torch.tensor([[0.4, -0.1], [0.05, 0.35]], dtype=torch.float64)
    w = w if c_sign > 0 else w[:, [1, 0]]
    mu = attnkern.sparsemap_chain(u, w)
    for r in range(3):
        want, best = sparsemap_qp(u[r].numpy(), w.numpy())
        np.testing.assert_allclose(mu[r].numpy(), want, atol=2e-6)
        assert sparsemap_objective(mu[r].numpy(), u[r].numpy(), w.numpy()) >= best - 1e-9
    assert ((mu > 0) & (mu < 1)).any() and (mu == 0).any() and (mu == 1).any()
    us, ws = u.clone().requires_grad_(), w.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: attnkern.sparsemap_chain(a, b), (us, ws))
    go = torch.randn(3, 12, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad(attnkern.sparsemap_chain(us, ws, backend=b), (us, ws), go)
             for b in ("cpu", "reference")]
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_sparsemap_closed_form_across_magnitudes():
    """The kernel's closed form (Condat's prox) against the reference's (its taut string, then the
    KKT weights of its support) and the Frank-Wolfe gap, for scores and transitions from 1e-8 to
    1e8, integer scores (ties) and c = W00 − W01 − W10 + W11 = 0: equal within rounding of the
    scores' scale, and optimal."""
    g = torch.Generator().manual_seed(5)
    for trial in range(120):
        m = int(torch.randint(1, 60, (1,), generator=g))
        u_scale, w_scale = (10.0 ** float(torch.randint(-8, 9, (1,), generator=g)) for _ in range(2))
        u = u_scale * torch.randn(2, m, generator=g, dtype=torch.float64)
        w = w_scale * torch.randn(2, 2, generator=g, dtype=torch.float64)
        if trial % 7 == 0:
            u = u.round()
        if trial % 11 == 0:
            w = w_scale * torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
        mu = attnkern.sparsemap_chain(u, w)
        scale = max(1.0, u.abs().max().item(), w.abs().max().item())
        torch.testing.assert_close(mu, attnkern.sparsemap_chain(u, w, backend="reference"), rtol=0,
                                   atol=1e-13 * scale * m)
        for r in range(2):
            assert sparsemap_gap(mu[r].numpy(), u[r].numpy(), w.numpy()) <= 1e-12 * scale * m


@pytest.mark.parametrize("forbidden", [(1, 1), (0, 0), (1, 0), (0, 1)])
def test_sparsemap_one_forbidden_transition_in_closed_form(forbidden):
    """One forbidden transition fixes each edge's table and constrains a ≤ b, b ≤ a, a + b ≤ 1 or
    a + b ≥ 1: μ is an ordered projection, clamped (docs/algorithms.md, section 12), certified by
    one Viterbi call. Values against the generic solver, including the long interior row;
    gradients by gradcheck and against the reference (its own projection, then autograd through
    the KKT system of its support), also on rows of two repeated scores whose separate runs tie."""
    g = torch.Generator().manual_seed(28)
    u = torch.cat([0.5 + 0.3 * torch.randn(3, 10, generator=g, dtype=torch.float64),
                   torch.tensor([0.3, 0.6], dtype=torch.float64)[torch.randint(0, 2, (2, 10), generator=g)]])
    w = 0.4 * torch.randn(2, 2, generator=g, dtype=torch.float64)
    w[forbidden] = -math.inf
    res = attnkern.sparsemap_chain(u, w, return_active=True)
    assert (res.oracle_calls == 1).all()
    for r in range(5):
        want, best = sparsemap_qp(u[r].numpy(), w.numpy())
        np.testing.assert_allclose(res.marginals[r].numpy(), want, atol=2e-6)
        assert sparsemap_objective(res.marginals[r].numpy(), u[r].numpy(), w.numpy()) >= best - 1e-9
        k = int((res.weights[r] > 0).sum())
        z = res.structures[r, :k].long()
        assert (w[z[:, :-1], z[:, 1:]] > -math.inf).all()  # no active labeling uses the forbidden transition
    us = u.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: attnkern.sparsemap_chain(a, w), (us[:3],))
    go = torch.randn(5, 10, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad(attnkern.sparsemap_chain(us, w, backend=b), us, go)[0] for b in ("cpu", "reference")]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-10)
    long_u = torch.tensor([LONG_INTERIOR_ROW], dtype=torch.float64)
    long_w = torch.tensor(LONG_INTERIOR_W, dtype=torch.float64)
    long_w[forbidden] = -math.inf
    long = attnkern.sparsemap_chain(long_u, long_w, return_active=True)
    assert long.oracle_calls.item() == 1
    torch.testing.assert_close(long.marginals, attnkern.sparsemap_chain(long_u, long_w, backend="reference"),
                               rtol=0, atol=1e-12)
    assert abs(sparsemap_gap(long.marginals[0].numpy(), long_u[0].numpy(), long_w.numpy())) < 1e-12


@pytest.mark.parametrize("forbidden", [None, (1, 1), (0, 0)])
def test_sparsemap_gradient_where_separate_runs_tie(forbidden):
    """A repeated pattern gives separate runs of μ the same value; each run still moves on its own,
    so the gradient must not tie them: kernel, reference and central differences agree."""
    w = torch.tensor([[0.02, -0.01], [0.015, 0.03]], dtype=torch.float64)
    if forbidden:
        w[forbidden] = -math.inf
    u = torch.tensor([[0.3, 0.6, 0.25, 0.3, 0.6, 0.25, 0.3, 0.6]], dtype=torch.float64)
    inner = [v for v in attnkern.sparsemap_chain(u, w)[0].tolist() if 0 < v < 1]
    assert len(set(inner)) < len(inner)
    go = torch.tensor([[0.3, -1.0, 0.5, 2.0, 0.1, -0.7, 1.3, 0.4]], dtype=torch.float64)
    grads = [torch.autograd.grad(attnkern.sparsemap_chain(x, w, backend=b), x, go)[0]
             for b in ("cpu", "reference") for x in [u.clone().requires_grad_()]]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    eps, central = 1e-6, torch.zeros_like(u)
    for i in range(u.shape[1]):
        e = torch.zeros_like(u)
        e[0, i] = eps
        diff = attnkern.sparsemap_chain(u + e, w) - attnkern.sparsemap_chain(u - e, w)
        central[0, i] = (diff * go).sum() / (2 * eps)
    torch.testing.assert_close(grads[0], central, rtol=0, atol=1e-7)


@pytest.mark.parametrize("w0", [[[0.0, 0.0], [0.0, 0.0]], [[0.1, 0.2], [0.3, 0.4]]])
def test_sparsemap_pairwise_gradient_at_c_zero(w0):
    """c = W00 − W01 − W10 + W11 = 0 (the modules' zero start among them) is a kink of μ in c; the
    gradient is the unmirrored branch's, the one the forward takes there: it matches the reference
    and the one-sided difference towards c > 0, so training from zeros can learn c."""
    g = torch.Generator().manual_seed(29)
    u = 0.5 + 0.4 * torch.randn(3, 8, generator=g, dtype=torch.float64)
    go = torch.randn(3, 8, generator=g, dtype=torch.float64)
    w0 = torch.tensor(w0, dtype=torch.float64)
    grads = []
    for backend in ("cpu", "reference"):
        w = w0.clone().requires_grad_()
        grads.append(torch.autograd.grad((attnkern.sparsemap_chain(u, w, backend=backend) * go).sum(), w)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-10)
    along_c, eps = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64), 1e-7

    def loss(w):
        return (attnkern.sparsemap_chain(u, w) * go).sum().item()

    right = (loss(w0 + eps * along_c) - loss(w0)) / eps
    assert abs((grads[0] * along_c).sum().item() - right) < 1e-4 * max(1.0, abs(right))
    assert abs(right) > 1e-3
