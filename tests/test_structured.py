"""The structured normalizers, fusedmax and oscarmax (attnkern.fusedmax,
attnkern.oscarmax): the CPU kernels and the reference against independent
oracles (fusedmax: the prox of λ·TV as a bounded least-squares problem on its
dual, solved by scipy's BVLS, and the simplex QP itself; oscarmax: the OSCAR
prox as a generic QP), then sparsemax by sorting; gradients by gradcheck and
against the reference's autograd; dtypes, dims, masks, errors, opcheck and
torch.compile, for both."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnkern
from attnkern import _extension
from attnkern.backends import reference

scipy_optimize = pytest.importorskip("scipy.optimize")
pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

NAMES = ["fusedmax", "oscarmax"]


def sparsemax_np(y: np.ndarray) -> np.ndarray:
    s = np.sort(y)[::-1]
    cs = np.cumsum(s)
    k = np.arange(1, y.shape[0] + 1)
    kk = k[1 + k * s > cs][-1]
    return np.maximum(y - (cs[kk - 1] - 1) / kk, 0.0)


def oracle(x: np.ndarray, lam: float) -> np.ndarray:
    """fusedmax of one finite row: y = x - Dᵀz with z = argmin ½||x - Dᵀz||²
    over |z| <= lam (the dual of the TV prox), then sparsemax by sorting."""
    n = x.shape[0]
    if n > 1 and lam > 0:
        dt = np.zeros((n, n - 1))
        dt[np.arange(n - 1), np.arange(n - 1)] = -1.0  # (Dᵀz)_i = z_{i-1} - z_i
        dt[np.arange(1, n), np.arange(n - 1)] = 1.0
        z = scipy_optimize.lsq_linear(dt, x, bounds=(-lam, lam), method="bvls", tol=1e-15).x
        y = x - dt @ z
    else:
        y = x.copy()
    return sparsemax_np(y)


def random_rows(n, rows=4, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return scale * torch.randn(rows, n, generator=g, dtype=torch.float64)


def assert_kernel_matches_reference(op, x, lam, go, tol):
    """op's CPU kernel against its reference on rows x at one λ per row (as
    a tensor, so that it has a gradient): values within tol, gradients in x
    and λ within 100·tol."""
    lam_rows = torch.full((x.shape[0], 1), lam, dtype=torch.float64)
    outs, grads = [], []
    for backend in ("cpu", "reference"):
        xs, ls = x.clone().requires_grad_(), lam_rows.clone().requires_grad_()
        p = op(xs, lam=ls, backend=backend)
        outs.append(p)
        grads.append(torch.autograd.grad(p, (xs, ls), go))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=tol)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tol * 100, atol=tol * 100)


@pytest.mark.parametrize("n", [1, 2, 5, 97])
@pytest.mark.parametrize("lam", [0.0, 0.05, 0.3, 2.0])
def test_kernel_matches_the_dual_oracle(n, lam):
    x = random_rows(n)
    p = attnkern.fusedmax(x, lam=lam)
    want = torch.tensor(np.stack([oracle(r, lam) for r in x.numpy()]))
    torch.testing.assert_close(p, want, rtol=0, atol=1e-9)
    torch.testing.assert_close(p.sum(-1), torch.ones(x.shape[0], dtype=torch.float64))


@pytest.mark.parametrize("lam", [0.05, 0.3, 2.0])
def test_long_rows_match_the_taut_string(lam):
    # (BVLS takes minutes at n = 1025: the reference's taut string, checked
    # against it on the shorter rows, is the oracle here.)
    x = random_rows(1025, rows=2)
    torch.testing.assert_close(attnkern.fusedmax(x, lam=lam), attnkern.fusedmax(x, lam=lam, backend="reference"),
                               rtol=0, atol=1e-9)


@pytest.mark.parametrize("n", [64, 97, 1025])
@pytest.mark.parametrize("lam", [0.002, 0.05, 0.2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fusedmax_solved_around_the_support_matches_the_reference(n, lam, dtype):
    # On long rows at small lam the kernel solves the prox only in windows
    # around the entries that can reach sparsemax's support (bounded by the
    # windows solved with both extreme boundary duals), or without a solve at
    # an isolated peak more than 4·lam above both neighbours; elsewhere, and
    # where the candidates are many (tiny or flat rows), it sweeps the whole
    # row. Unmasked float rows are read and written in place. Values and both
    # gradients against the reference, on plain rows, rows with plateaus and
    # masked runs, near ties at the top, tiny and large magnitudes, and spikes
    # at the ends, side by side, and exactly 4·lam (and a rounding either
    # side of it) above their neighbours.
    x = random_rows(n, rows=10, seed=23)
    x[1] = torch.round(x[1] * 4) / 4  # plateaus
    x[2, 5:9] = -math.inf  # a masked run
    x[2, -3:] = -math.inf
    x[3, :] = x[3].max() - 1e-9 * torch.arange(n, dtype=torch.float64) % 3  # near ties at the top
    x[4] *= 1e-6
    x[5] *= 1e4
    x[6] = x[6].sort().values  # a ramp: one support cluster at the end
    x[8:] *= 0.1
    for row, spikes in ((8, (0, 10, 11, 40, n - 1)), (9, (3, 20, 33, 50))):
        for i in spikes:
            x[row, i] = 3.0
    x[9, 19] = 3.0 - 4 * lam  # exactly 4·lam below a spike
    x[9, 32] = math.nextafter(3.0 - 4 * lam, 4.0)
    x[9, 49] = math.nextafter(3.0 - 4 * lam, 0.0)
    x = x.to(dtype)
    go = random_rows(n, rows=10, seed=24).to(dtype)
    assert_kernel_matches_reference(attnkern.fusedmax, x, lam, go, 1e-9 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("n", [1, 7, 97])
@pytest.mark.parametrize("lam", [0.0, 0.1, 1.5])
def test_reference_matches_the_dual_oracle(n, lam):
    x = random_rows(n, rows=2, seed=1)
    want = torch.tensor(np.stack([oracle(r, lam) for r in x.numpy()]))
    torch.testing.assert_close(attnkern.fusedmax(x, lam=lam, backend="reference"), want, rtol=0, atol=1e-9)


def test_reference_merges_the_taut_strings_collinear_pieces():
    # On a row of quarter values the taut string bends where its slope does
    # not change; the reference used to take those pieces as segments of y,
    # with a jump of sign 0 between them, and its p was off by up to 0.11 here.
    x = random_rows(97, rows=8, seed=23)[1:2]
    x = torch.round(x * 4) / 4
    want = torch.tensor(np.stack([oracle(r, 0.2) for r in x.numpy()]))
    torch.testing.assert_close(attnkern.fusedmax(x, lam=0.2, backend="reference"), want, rtol=0, atol=1e-9)
    torch.testing.assert_close(attnkern.fusedmax(x, lam=0.2), want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("scale", [1e-6, 1e4])
def test_magnitudes(scale):
    x = random_rows(60, scale=scale, seed=2)
    for lam in (0.1 * scale, 3.0 * scale):
        want = torch.tensor(np.stack([oracle(r, lam) for r in x.numpy()]))
        torch.testing.assert_close(attnkern.fusedmax(x, lam=lam), want, rtol=0, atol=1e-9)


def test_is_the_simplex_qp_on_small_rows():
    """The composition sparsemax ∘ prox_TV solves the simplex-constrained problem
    itself (Niculae & Blondel): a generic interior-point solver on the smooth form
    min ½||p - x||² + λ Σ t, t >= ±(p_{i+1} - p_i), p in the simplex, lands within
    its own accuracy of our p, and our p's objective is never above its."""
    n = 6
    x = random_rows(n, rows=3, seed=3).numpy()
    diff = np.diff(np.eye(n), axis=0)  # (n - 1, n): p_{i+1} - p_i
    tube = np.vstack([np.hstack([-diff, np.eye(n - 1)]), np.hstack([diff, np.eye(n - 1)])])
    constraints = [scipy_optimize.LinearConstraint(np.r_[np.ones(n), np.zeros(n - 1)][None], 1, 1),
                   scipy_optimize.LinearConstraint(tube, 0, np.inf)]
    bounds = scipy_optimize.Bounds(np.zeros(2 * n - 1), np.r_[np.ones(n), np.full(n - 1, np.inf)])
    hessian = np.diag(np.r_[np.ones(n), np.zeros(n - 1)])
    for row in x:
        for lam in (0.05, 0.2, 1.0):
            def objective(v, row=row, lam=lam):
                return 0.5 * np.sum((v[:n] - row) ** 2) + lam * np.sum(v[n:])

            def gradient(v, row=row, lam=lam):
                return np.concatenate([v[:n] - row, np.full(n - 1, lam)])

            res = scipy_optimize.minimize(objective, np.r_[np.full(n, 1 / n), np.zeros(n - 1)], jac=gradient,
                                          hess=lambda v: hessian, method="trust-constr", bounds=bounds,
                                          constraints=constraints,
                                          options={"gtol": 1e-12, "xtol": 1e-14, "maxiter": 5000})
            ours = attnkern.fusedmax(torch.tensor(row), lam=lam).numpy()
            assert objective(np.r_[ours, np.abs(np.diff(ours))]) <= res.fun + 1e-12
            np.testing.assert_allclose(ours, res.x[:n], atol=2e-5)


@pytest.mark.parametrize("name", NAMES)
def test_lam_zero_is_sparsemax_and_large_lam_is_uniform(name):
    op = getattr(attnkern, name)
    x = random_rows(33, seed=4).float()
    torch.testing.assert_close(op(x, lam=0.0), attnkern.sparsemax(x), rtol=0, atol=1e-7)
    torch.testing.assert_close(op(x, lam=1e3), torch.full_like(x, 1 / 33), rtol=0, atol=1e-7)


@pytest.mark.parametrize("lam", [1e28, 1e100, 1e308])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lam_far_beyond_the_scores_gives_the_uniform_weights(lam, dtype):
    # At such lam every running sum of x - mean fits within lam, so the prox
    # is the row's mean: the kernel takes it in closed form, where the sweep's
    # bounds x ± lam would drown x (it returned zeros and NaN). A float lam
    # beyond float32's range reaches the kernel as float64, not inf. Both
    # gradients are 0 (one segment, no jump, weights fixed), as the reference's.
    x = random_rows(7, rows=3, seed=5).to(dtype)
    x[2, 3] = -math.inf
    want = torch.full_like(x, 1 / 7)
    want[2] = torch.tensor([1 / 6] * 3 + [0.0] + [1 / 6] * 3, dtype=dtype)
    for lam_arg in (lam, torch.tensor(lam, dtype=torch.float64)):
        torch.testing.assert_close(attnkern.fusedmax(x, lam=lam_arg), want, rtol=0, atol=1e-7)
    go = random_rows(7, rows=3, seed=6).to(dtype)
    assert_kernel_matches_reference(attnkern.fusedmax, x.double(), lam, go.double(), 1e-12)


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("lam", [0.0, 0.1])
def test_rows_far_from_zero_keep_their_weights_on_the_simplex(offset, lam):
    # A near-flat row of 4097 scores around 1e6 puts every entry in the
    # support. sparsemax's threshold steps now sum y - max y (exact near the
    # top) instead of y, whose rounding of its size left the weights' sum off
    # by 1e-4 here; the result should not depend on the offset.
    g = torch.Generator().manual_seed(0)
    n = 4097
    x = offset + 1e-5 * (torch.arange(n, dtype=torch.float64) % 3) + 1e-6 * torch.randn(n, generator=g,
                                                                                        dtype=torch.float64)
    p = attnkern.fusedmax(x.unsqueeze(0), lam=lam)
    # (Each weight y_i - τ still rounds at the offset's size.)
    assert abs(p.sum().item() - 1.0) <= n * offset * 2**-52
    tol = offset * 1e-14
    torch.testing.assert_close(p, attnkern.fusedmax((x - x.max()).unsqueeze(0), lam=lam), rtol=0, atol=tol)
    torch.testing.assert_close(p, attnkern.fusedmax(x.unsqueeze(0), lam=lam, backend="reference"), rtol=0, atol=tol)


def test_plateaus_ties_and_fused_segments():
    x = torch.tensor([[0.5, 0.5, 0.5, 0.1, 0.9, 0.9, 0.2, 0.2],
                      [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                      [0.3, 0.8, 0.31, 0.79, 0.3, 0.8, 0.3, 0.8]], dtype=torch.float64)
    for lam in (0.0, 0.02, 0.1, 0.5):
        want = torch.tensor(np.stack([oracle(r, lam) for r in x.numpy()]))
        torch.testing.assert_close(attnkern.fusedmax(x, lam=lam), want, rtol=0, atol=1e-12)
    # At λ = 0.2 the alternating row's neighbours fuse into equal weights.
    p = attnkern.fusedmax(x[2], lam=0.2)
    assert torch.unique(p[p > 0]).numel() < (p > 0).sum()


def oscar_oracle(x: np.ndarray, lam: float) -> np.ndarray:
    """oscarmax of one finite row: the prox of lam Σ_{i<j} max(|y_i|, |y_j|) as a
    smooth QP (t_ij >= ±y_i, ±y_j) solved by a generic interior-point method,
    then sparsemax by sorting."""
    n = x.shape[0]
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    rows = []
    for c, (i, j) in enumerate(pairs):
        for k, sign in ((i, 1.0), (i, -1.0), (j, 1.0), (j, -1.0)):
            r = np.zeros(n + len(pairs))
            r[n + c], r[k] = 1.0, -sign  # t_ij - sign·y_k >= 0
            rows.append(r)
    hessian = np.diag(np.r_[np.ones(n), np.zeros(len(pairs))])

    def objective(v):
        return 0.5 * np.sum((v[:n] - x) ** 2) + lam * np.sum(v[n:])

    def gradient(v):
        return np.concatenate([v[:n] - x, np.full(len(pairs), lam)])

    start = np.r_[x, np.abs(x).max() * np.ones(len(pairs))]
    res = scipy_optimize.minimize(objective, start, jac=gradient, hess=lambda v: hessian, method="trust-constr",
                                  constraints=[scipy_optimize.LinearConstraint(np.array(rows), 0, np.inf)],
                                  options={"gtol": 1e-12, "xtol": 1e-14, "maxiter": 5000})
    return sparsemax_np(res.x[:n])


@pytest.mark.parametrize("lam", [0.0, 0.03, 0.2, 1.0])
def test_oscarmax_matches_the_qp_oracle(lam):
    x = random_rows(5, rows=3, seed=14)
    x[0, 3] = -x[0, 1]  # equal magnitudes of opposite signs
    want = torch.tensor(np.stack([oscar_oracle(r, lam) for r in x.numpy()]))
    # (The interior-point solver lands within about 2e-5 of the prox; ours is
    # exact: kernel and reference agree to 1e-12 below.)
    torch.testing.assert_close(attnkern.oscarmax(x, lam=lam), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(attnkern.oscarmax(x, lam=lam, backend="reference"), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 97, 1025])
@pytest.mark.parametrize("lam", [0.001, 0.02, 0.5])
def test_oscarmax_kernel_matches_the_reference(n, lam):
    x = random_rows(n, rows=2, seed=15)
    torch.testing.assert_close(attnkern.oscarmax(x, lam=lam), attnkern.oscarmax(x, lam=lam, backend="reference"),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [64, 97, 1025])
@pytest.mark.parametrize("lam", [0.0, 0.001, 0.004])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_oscarmax_solved_at_the_top_matches_the_reference(n, lam, dtype):
    # On rows of 64 entries or more the kernel sorts and pools only the
    # entries of largest |x| whose leading blocks, and the threshold over
    # them, provably hold the support (lowering its cut until they do), and
    # sorts the whole row where that would take more than a quarter of it.
    # Values and both gradients against the reference: plain rows, the
    # largest magnitude negative, tied magnitudes of either sign at the top,
    # a crowded top (the whole sort), masked runs, tiny and large magnitudes.
    x = random_rows(n, rows=8, seed=41)
    top = x[1].abs().argmax()
    x[1, top] = -x[1].abs().max() - 0.5  # the largest magnitude, negative
    x[2, :6] = torch.tensor([2.5, -2.5, 2.5, 2.4, -2.4, 2.4], dtype=torch.float64)  # ties at the top
    x[3] = 3.0 + 0.01 * x[3]  # a crowded top
    x[4, 5:9] = -math.inf
    x[4, -3:] = -math.inf
    x[5] *= 1e-3
    x[6] *= 1e3
    x[7] = -x[7].abs()
    x[7, 10] = 0.1  # one small positive entry among negative ones
    x = x.to(dtype)
    go = random_rows(n, rows=8, seed=42).to(dtype)
    assert_kernel_matches_reference(attnkern.oscarmax, x, lam, go, 1e-12 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("lam", [0.0005, 0.001])
def test_oscarmax_head_pools_across_its_cut(lam):
    # Rows whose magnitudes sit closer than lam to each other near the top
    # (a bunch just above 2, or magnitudes on a grid of 0.7·lam): the fit pools
    # entries on both sides of the head's cut, so a leading block is settled
    # only where the bound on every later target says so. Against the
    # reference, values and gradients.
    g = torch.Generator().manual_seed(43)
    n = 257
    bunch = torch.randn(12, n, generator=g, dtype=torch.float64)
    bunch[:, :40] = 2.0 + torch.rand(12, 40, generator=g, dtype=torch.float64) * lam * 20
    grid = torch.randn(12, n, generator=g, dtype=torch.float64)
    grid[:, : n // 3] = torch.round(grid[:, : n // 3] / (0.7 * lam)) * (0.7 * lam)
    x = torch.cat([bunch, grid])
    go = torch.randn(x.shape, generator=g, dtype=torch.float64)
    outs, grads = [], []
    for backend in ("cpu", "reference"):
        xs = x.clone().requires_grad_()
        p = attnkern.oscarmax(xs, lam=lam, backend=backend)
        outs.append(p)
        grads.append(torch.autograd.grad(p, xs, go)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_oscarmax_rows_read_in_place_equal_the_general_path(dtype):
    # Unmasked float and double rows at stride 1 are read and written in
    # place (only the head's entries copied to double, float rows compared
    # against the double cuts rounded down); strided rows take the general
    # path. The two agree bit for bit in p, the flags and the ranks: rows
    # solved at the top, with entries at the first cut and a float either
    # side of it, ties and a negative largest magnitude at the top, a crowded
    # top (the head fails and the general path sorts the whole row), rows
    # whose prox is 0, masked rows, and a head whose magnitudes crowd one
    # end of its band (its sort's buckets: one holds most keys).
    ops = torch.ops.attnkern
    n, lam = 1025, 0.001
    x = random_rows(n, rows=9, seed=51)
    x[0, 7] = 3.0
    cut = float(np.float32(3.0 - lam * (n - 1) - 0.25))  # the first cut, rounded to float
    x[0, 100:103] = torch.tensor([cut, math.nextafter(cut, 0.0), math.nextafter(cut, 4.0)])
    x[0, 103:106] = -x[0, 100:103]
    x[1, 9] = -x[1].abs().max() - 0.5
    x[2, :6] = torch.tensor([2.5, -2.5, 2.5, 2.4, -2.4, 2.4], dtype=torch.float64)
    x[3] = 3.0 + 0.01 * x[3]  # crowded
    x[4] *= 1e-3  # y = 0 without a sort
    x[5] *= 1e3
    x[6, 5:9] = -math.inf
    x[7] = x[7].float().double() * 0.5
    x[8] *= 0.1
    x[8, 0] = -3.5
    crowd = 3.0 + 1e-6 * torch.randperm(100, generator=torch.Generator().manual_seed(52)).double()
    x[8, 10:110] = torch.where(torch.arange(100) % 3 == 0, -crowd, crowd)
    x[8] = x[8].float().double()
    x = x.to(dtype)
    lam_rows = torch.full((9, 1), lam, dtype=torch.float64)
    lam_rows[7] = 0.0005
    p, flags, ranks = ops.oscarmax_fwd_clusters(x, lam_rows, -1)
    strided = ops.oscarmax_fwd_clusters(x.t().contiguous(), lam_rows.t(), 0)
    assert torch.equal(p, strided[0].t())
    assert torch.equal(flags, strided[1].t())
    assert torch.equal(ranks, strided[2].t())
    assert torch.equal(p, ops.oscarmax_fwd(x, lam_rows, -1))
    assert (p[:3] > 0).sum(dim=1).min() >= 1
    assert (p[8] > 0).sum() > 50 and ranks[8].max() >= 100  # (the crowd: one pooled block in the head)
    # The ranks of the unclipped blocks' entries sort them by decreasing |x|,
    # ties by index (checked here against no other sort).
    for row in range(x.shape[0]):
        at = torch.nonzero(flags[row] & 32).flatten()  # kClusterNonzero
        by_rank = at[torch.argsort(ranks[row, at])]
        assert torch.equal(ranks[row, by_rank], torch.arange(len(at), dtype=torch.int32))
        mag = x[row, by_rank].abs()
        assert bool((mag[1:] < mag[:-1]).logical_or((mag[1:] == mag[:-1]) & (by_rank[1:] > by_rank[:-1])).all())
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(p, attnkern.oscarmax(x, lam=lam_rows, backend="reference"), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype, float_valued", [(torch.float32, True), (torch.float64, False),
                                                 (torch.float64, True)])
def test_oscarmax_long_rows_with_tied_magnitudes(dtype, float_valued):
    # Rows of more than 64 entries are sorted by a radix sort on the bits of
    # |x| that skips the bytes all keys share, on 64-bit keys of |x| and index
    # when every |x| is a float (float32 rows, or float64 rows of float values),
    # else on |x|'s 64 bits; ties of either sign must pool exactly as the
    # reference's.
    x = random_rows(1025, rows=3, seed=17)
    x[:, ::5] = 0.25
    x[:, 2::5] = -0.25
    x[1] = x[1].round()  # a handful of distinct magnitudes
    if float_valued:
        x = x.float().double()
    x = x.to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    g = random_rows(1025, rows=3, seed=18).to(dtype)
    p = attnkern.oscarmax(x, lam=0.002)
    want = attnkern.oscarmax(xr, lam=0.002, backend="reference")
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(p, want, rtol=0, atol=tol)
    (p * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=tol)
    assert (p[1] > 0).sum() > 1  # (the tied rows keep a support of several entries)


@pytest.mark.parametrize("n", [2, 97, 1025])
def test_oscarmax_zero_prox_without_sorting_matches_the_reference(n):
    # When max|x| is below lam·(n-1)/2 the prox is 0 and the kernel skips the
    # sort (uniform output, zero gradients); above, it must sort (the bound is
    # loose: rows up to twice above it can still have y = 0). Rows
    # scaled to either side of the bound, in value and in both gradients.
    lam = 0.01
    bound = lam * (n - 1) / 2
    x = random_rows(n, rows=6, seed=19)
    x = x / x.abs().amax(-1, keepdim=True) * bound
    x = x * torch.tensor([0.5, 1 - 1e-5, 1 - 1e-7, 1.0, 1 + 1e-3, 4.0], dtype=torch.float64).view(6, 1)
    go = random_rows(n, rows=6, seed=20)
    grads, outs = [], []
    for backend in ("cpu", "reference"):
        xs = x.clone().requires_grad_()
        ls = torch.full((6, 1), lam, dtype=torch.float64, requires_grad=True)
        p = attnkern.oscarmax(xs, lam=ls, backend=backend)
        outs.append(p)
        # (The reference's output carries no graph when every cluster is clipped.)
        grads.append(torch.autograd.grad(p, (xs, ls), go) if p.requires_grad else
                     (torch.zeros_like(xs), torch.zeros_like(ls)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    torch.testing.assert_close(outs[0][:2], torch.full((2, n), 1.0 / n, dtype=torch.float64), rtol=0, atol=0)
    assert (grads[0][0][:2] == 0).all() and (grads[0][1][:2] == 0).all()
    assert not torch.allclose(outs[0][5], torch.full((n,), 1.0 / n, dtype=torch.float64))


def test_only_fusedmax_is_shift_invariant():
    x = random_rows(20, rows=3, seed=16)
    torch.testing.assert_close(attnkern.fusedmax(x + 3.0, lam=0.2), attnkern.fusedmax(x, lam=0.2))
    assert not torch.allclose(attnkern.oscarmax(x + 3.0, lam=0.05), attnkern.oscarmax(x, lam=0.05))


@pytest.mark.parametrize("name", NAMES)
def test_minus_inf_entries_are_removed_and_bad_rows_stay_in_their_row(name):
    op = getattr(attnkern, name)
    x = random_rows(12, rows=5, seed=5)
    x[0, [2, 3, 7]] = -math.inf
    x[1] = -math.inf
    x[2, 4] = math.nan
    x[3, 0] = math.inf
    p = op(x, lam=0.2)
    keep = x[0] > -math.inf
    torch.testing.assert_close(p[0, keep], op(x[0, keep], lam=0.2))
    assert (p[0, ~keep] == 0).all() and (p[1] == 0).all()
    assert p[2].isnan().all() and p[3].isnan().all() and not p[[0, 1, 4]].isnan().any()
    torch.testing.assert_close(op(x, lam=0.2, backend="reference"), p, equal_nan=True)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_in_x_and_lam(name):
    op = getattr(attnkern, name)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    lam = torch.tensor([[[0.05]], [[0.2]], [[0.6]]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: op(a, dim=-1, lam=b), (x, lam), eps=1e-7)
    assert torch.autograd.gradcheck(lambda a, b: op(a, dim=1, lam=b.view(3, 1, 1)), (x, lam),
                                    eps=1e-7)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_the_reference_autograd(masked, name):
    op = getattr(attnkern, name)
    x = random_rows(40, rows=6, seed=7)
    if masked:
        x[:, [3, 4, 20]] = -math.inf
        x[5] = -math.inf
    lam = torch.tensor([0.0, 0.05, 0.1, 0.3, 1.0, 0.2], dtype=torch.float64).view(6, 1)
    go = random_rows(40, rows=6, seed=8)
    grads = []
    for backend in ("cpu", "reference"):
        xs, ls = x.clone().requires_grad_(), lam.clone().requires_grad_()
        p = op(xs, lam=ls, backend=backend)
        grads.append(torch.autograd.grad(p, (xs, ls), go))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_dtypes(dtype, tol, name):
    op = getattr(attnkern, name)
    x = random_rows(97, rows=3, seed=9)
    want = op(x.to(dtype).double(), lam=0.15)
    xs = x.to(dtype).requires_grad_()
    p = op(xs, lam=0.15)
    assert p.dtype == dtype
    torch.testing.assert_close(p.double(), want, rtol=0, atol=tol)
    go = random_rows(97, rows=3, seed=10)
    (dx,) = torch.autograd.grad(p, xs, go.to(dtype))
    x64 = x.to(dtype).double().requires_grad_()
    (want_dx,) = torch.autograd.grad(op(x64, lam=0.15), x64, go.to(dtype).double())
    assert dx.dtype == dtype
    torch.testing.assert_close(dx.double(), want_dx, rtol=0, atol=tol * max(1.0, float(want_dx.abs().max())))


@pytest.mark.parametrize("name", NAMES)
def test_any_dim_strides_empty_and_threads(name):
    op = getattr(attnkern, name)
    x = random_rows(5 * 7 * 11, rows=1, seed=11).view(5, 7, 11).transpose(0, 2)  # (11, 7, 5), not contiguous
    for dim in (0, 1, 2, -1):
        want = op(x.movedim(dim, -1).contiguous(), lam=0.1).movedim(-1, dim)
        assert torch.equal(op(x, dim=dim, lam=0.1), want)
    assert op(torch.zeros(0, 5), lam=0.1).shape == (0, 5)
    assert op(torch.zeros(3, 0), lam=0.1).shape == (3, 0)
    assert op(torch.tensor(2.0), lam=0.1) == 1.0
    big = random_rows(300, rows=64, seed=12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(big, lam=0.1)
        torch.set_num_threads(2)
        assert torch.equal(op(big, lam=0.1), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NAMES)
def test_errors_name_the_argument(name):
    op = getattr(attnkern, name)
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="lam"):
        op(x, lam=-0.1)
    with pytest.raises(ValueError, match="lam"):
        op(x, lam=torch.tensor([[0.1], [math.nan]]))
    with pytest.raises(ValueError, match="lam"):
        op(x, lam=torch.ones(3, 1))
    with pytest.raises(NotImplementedError, match="kernels for CPU tensors"):
        op(x.to("meta"), lam=0.1)
    with pytest.raises(NotImplementedError, match="kernels for CPU tensors"):
        op(x, lam=0.1, backend="cuda")
    xs = x.double().requires_grad_()
    with pytest.raises(NotImplementedError, match=f"{name}: double backward"):  # asked for at create_graph
        torch.autograd.grad(op(xs, lam=0.1).pow(2).sum(), xs, create_graph=True)
    with pytest.raises(NotImplementedError, match=f"{name}: forward-mode"):
        with torch.autograd.forward_ad.dual_level():
            op(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)), lam=0.1)
    with pytest.raises(ValueError, match="lam must be finite"):  # the op checks it too
        getattr(torch.ops.attnkern, f"{name}_fwd")(x, torch.tensor(-1.0), -1)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck_and_compile(name):
    op = getattr(attnkern, name)
    x = random_rows(23, rows=3, seed=13).float()
    lam = torch.tensor([[0.1], [0.0], [0.4]])
    torch.library.opcheck(getattr(torch.ops.attnkern, f"{name}_fwd"), (x, lam, -1))
    torch.library.opcheck(getattr(torch.ops.attnkern, f"{name}_bwd"), (x, torch.randn_like(x), lam, -1, True))

    def f(a, b):
        return op(a, lam=b)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xs, ls = x.clone().requires_grad_(), lam.clone().requires_grad_()
    out = compiled(xs, ls)
    out.pow(2).sum().backward()
    xe, le = x.clone().requires_grad_(), lam.clone().requires_grad_()
    f(xe, le).pow(2).sum().backward()
    assert torch.equal(out, f(x, lam)) and torch.equal(xs.grad, xe.grad) and torch.equal(ls.grad, le.grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fusedmax_backward_from_saved_segments_equals_solving_again(dtype):
    """attnkern.fusedmax's autograd on CPU keeps the prox's segments
    (fusedmax_fwd_segments) instead of solving the prox again in the backward
    (fusedmax_bwd): the two backwards agree bit for bit, on masks, ties,
    plateaus, NaN and fully masked rows, along any dim."""
    ops = torch.ops.attnkern
    g = torch.Generator().manual_seed(5)
    for shape, dim in (((7, 33), -1), ((5, 97, 3), 1), ((4, 1), -1), ((2, 1025), -1), ((6, 2), 0), ((0, 4), -1)):
        for lam in (0.0, 0.1, 1.0, 30.0):
            x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            if x.numel() > 8:
                x.view(-1)[::5] = -math.inf
                x.view(-1)[3] = x.view(-1)[4]
            if shape == (7, 33):
                x[2] = -math.inf
                x[3, 4] = math.nan
                x[4] = torch.round(x[4] * 2) / 2  # plateaus
            rows = list(shape)
            rows[dim] = 1
            lam_rows = torch.rand(rows, generator=g, dtype=torch.float64) * lam
            grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            p, segments = ops.fusedmax_fwd_segments(x, lam_rows, dim)
            assert segments.dtype == torch.uint8 and segments.shape == x.shape
            assert torch.equal(p.nan_to_num(7.0), ops.fusedmax_fwd(x, lam_rows, dim).nan_to_num(7.0))
            dx, dlam = ops.fusedmax_bwd_segments(segments, grad, lam_rows, dim, True)
            want_dx, want_dlam = ops.fusedmax_bwd(x, grad, lam_rows, dim, True)
            assert torch.equal(dx.nan_to_num(7.0), want_dx.nan_to_num(7.0)), (shape, lam)
            assert torch.equal(dlam.nan_to_num(7.0), want_dlam.nan_to_num(7.0)), (shape, lam)
    # Unmasked rows at small lam: the forward's prox solved in place around
    # the support (fusedmax_fwd_segments) against the backward's solve.
    for lam in (0.02, 0.1):
        x = random_rows(1025, rows=3, seed=31).to(dtype)
        x[1] = torch.round(x[1] * 4) / 4
        lam_rows = torch.full((3, 1), lam, dtype=torch.float64)
        grad = random_rows(1025, rows=3, seed=32).to(dtype)
        _, segments = ops.fusedmax_fwd_segments(x, lam_rows, -1)
        dx, dlam = ops.fusedmax_bwd_segments(segments, grad, lam_rows, -1, True)
        want_dx, want_dlam = ops.fusedmax_bwd(x, grad, lam_rows, -1, True)
        assert torch.equal(dx, want_dx) and torch.equal(dlam, want_dlam), lam
    x = random_rows(23, rows=3, seed=13).float()
    lam = torch.tensor([[0.1], [0.0], [0.4]])
    _, segments = ops.fusedmax_fwd_segments(x, lam, -1)
    torch.library.opcheck(ops.fusedmax_fwd_segments, (x, lam, -1))
    torch.library.opcheck(ops.fusedmax_bwd_segments, (segments, torch.randn_like(x), lam, -1, True))
    torch.library.opcheck(ops.fusedmax_bwd_segments, (segments, torch.randn_like(x), lam, -1, False))
    with pytest.raises(RuntimeError, match="segments must be the uint8"):
        ops.fusedmax_bwd_segments(x, x, lam, -1, True)
    with pytest.raises(ValueError, match="does not match segments"):
        ops.fusedmax_bwd_segments(segments, x[:, :5], lam, -1, True)
    with pytest.raises(RuntimeError, match="lam must be a floating-point"):
        ops.fusedmax_bwd_segments(segments, x, torch.ones(3, 1, dtype=torch.int64), -1, True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_oscarmax_backward_from_saved_clusters_equals_solving_again(dtype):
    """attnkern.oscarmax's autograd on CPU keeps the prox's clusters
    (oscarmax_fwd_clusters: flags and ranks) instead of sorting and pooling
    again in the backward (oscarmax_bwd): the two backwards agree bit for bit,
    on masks, tied magnitudes of either sign, zeros, NaN and fully masked rows,
    rows whose prox is 0 without a sort and rows that sort, along any dim."""
    ops = torch.ops.attnkern
    g = torch.Generator().manual_seed(21)
    for shape, dim in (((7, 33), -1), ((5, 97, 3), 1), ((4, 1), -1), ((2, 1025), -1), ((6, 2), 0), ((0, 4), -1)):
        for lam in (0.0, 0.003, 0.03, 1.0):
            x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            if x.numel() > 8:
                x.view(-1)[::5] = -math.inf
                x.view(-1)[3] = -x.view(-1)[4]
                x.view(-1)[6] = 0.0
            if shape == (7, 33):
                x[2] = -math.inf
                x[3, 4] = math.nan
                x[4] = torch.round(x[4] * 2) / 2  # a few distinct magnitudes
            rows = list(shape)
            rows[dim] = 1
            lam_rows = torch.rand(rows, generator=g, dtype=torch.float64) * lam
            grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            p, flags, ranks = ops.oscarmax_fwd_clusters(x, lam_rows, dim)
            assert flags.dtype == torch.uint8 and ranks.dtype == torch.int32 and flags.shape == ranks.shape == x.shape
            assert torch.equal(p.nan_to_num(7.0), ops.oscarmax_fwd(x, lam_rows, dim).nan_to_num(7.0))
            dx, dlam = ops.oscarmax_bwd_clusters(flags, ranks, grad, lam_rows, dim, True)
            want_dx, want_dlam = ops.oscarmax_bwd(x, grad, lam_rows, dim, True)
            assert torch.equal(dx.nan_to_num(7.0), want_dx.nan_to_num(7.0)), (shape, lam)
            assert torch.equal(dlam.nan_to_num(7.0), want_dlam.nan_to_num(7.0)), (shape, lam)
    x = random_rows(23, rows=3, seed=13).float()
    lam = torch.tensor([[0.01], [0.0], [0.4]])
    _, flags, ranks = ops.oscarmax_fwd_clusters(x, lam, -1)
    torch.library.opcheck(ops.oscarmax_fwd_clusters, (x, lam, -1))
    torch.library.opcheck(ops.oscarmax_bwd_clusters, (flags, ranks, torch.randn_like(x), lam, -1, True))
    torch.library.opcheck(ops.oscarmax_bwd_clusters, (flags, ranks, torch.randn_like(x), lam, -1, False))
    with pytest.raises(RuntimeError, match="flags must be the uint8"):
        ops.oscarmax_bwd_clusters(x, ranks, x, lam, -1, True)
    with pytest.raises(RuntimeError, match="ranks must be the int32"):
        ops.oscarmax_bwd_clusters(flags, flags, x, lam, -1, True)
    with pytest.raises(ValueError, match="must match"):
        ops.oscarmax_bwd_clusters(flags, ranks, x[:, :5], lam, -1, True)
    # Ranks index the sort order: out of range or repeated, they are refused,
    # not followed (row 0 sorts at lam = 0.01, so its ranks are read).
    for bad in (23, -1):
        wrong = ranks.clone()
        wrong[0, 3] = bad
        with pytest.raises(ValueError, match="ranks must be those of oscarmax_fwd_clusters"):
            ops.oscarmax_bwd_clusters(flags, wrong, x, lam, -1, True)
    wrong = ranks.clone()
    wrong[0, 3] = wrong[0, 4]
    with pytest.raises(ValueError, match="ranks must be those of oscarmax_fwd_clusters"):
        ops.oscarmax_bwd_clusters(flags, wrong, x, lam, -1, True)
    with pytest.raises(RuntimeError, match="lam must be a floating-point"):
        ops.oscarmax_bwd_clusters(flags, ranks, x, torch.ones(3, 1, dtype=torch.int64), -1, True)


@pytest.mark.parametrize("name", NAMES)
def test_module(name):
    lam = torch.nn.Parameter(torch.tensor(0.2))
    m = getattr(attnkern.nn, name.capitalize())(dim=-1, lam=lam)
    x = torch.randn(4, 10)
    m(x).pow(2).sum().backward()
    assert lam.grad is not None and "lam=tensor" in repr(m)
    torch.testing.assert_close(m(x), getattr(reference, name)(x.double(), 0.2).float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_rnn_attention_modules_take_them(name):
    # attention = the normalizer over the scores, masked positions removed (so the
    # real positions on either side of a masked run are neighbours for fusedmax).
    g = torch.Generator().manual_seed(17)
    att = attnkern.nn.LuongAttention(6, 6, normalizer=name, lam=0.2)
    query, keys = torch.randn(3, 6, generator=g), torch.randn(3, 9, 6, generator=g, requires_grad=True)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 3:5] = False
    context, weights = att(query, keys, mask=mask)
    scores = att.scores(query, keys).masked_fill(~mask, -math.inf)
    torch.testing.assert_close(weights, getattr(attnkern, name)(scores, lam=0.2))
    assert (weights[1, 3:5] == 0).all() and att.alpha is None and "lam=0.2" in repr(att)
    context.sum().backward()
    assert keys.grad is not None and torch.isfinite(keys.grad).all()
    with pytest.raises(ValueError, match="lam must be"):
        attnkern.nn.LuongAttention(6, 6, normalizer=name, lam=-1.0)
    with pytest.raises(ValueError, match="takes lam"):
        attnkern.nn.LuongAttention(6, 6, normalizer=name, alpha=1.5)
    with pytest.raises(ValueError, match="lam is only used"):
        attnkern.nn.LuongAttention(6, 6, normalizer="softmax", lam=0.2)
