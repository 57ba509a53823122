"""Row-wise normalizers: kernels against the float64 reference and the `entmax` package."""

from __future__ import annotations

import math

import entmax as entmax_pkg
import pytest
import torch
from torch.autograd import gradcheck

import attnkern
from attnkern.backends import reference as ref
from attnkern.testing import DTYPES, assert_close, make_scores, mask_some, tolerance, with_ties

ALPHAS = (0.5, 0.9, 1.0, 1.0001, 1.2, 1.3, 1.5, 1.7, 2.0, 2.5, 3.0)


def fixed(name):
    """(attnkern function, reference function) for a fixed normalizer."""
    return {
        "softmax": (attnkern.softmax, ref.softmax),
        "sparsemax": (attnkern.sparsemax, ref.sparsemax),
        "entmax15": (attnkern.entmax15, ref.entmax15),
    }[name]


def alpha_fns(alpha):
    return (lambda x, dim=-1: attnkern.entmax(x, alpha, dim), lambda x, dim=-1: ref.entmax(x, alpha, dim))


NORMALIZERS = [("softmax", *fixed("softmax")), ("sparsemax", *fixed("sparsemax")),
               ("entmax15", *fixed("entmax15"))] + [(f"entmax{a}", *alpha_fns(a)) for a in ALPHAS]
NORM_IDS = [n[0] for n in NORMALIZERS]


def cond(name: str) -> float:
    """Tolerance factor: for α > 2, p = d^(1/(α-1)) has an infinite slope at the
    support's edge, so a rounding-level change of the threshold moves tiny
    probabilities by about sqrt(eps) (in float64, ~1e-8 absolute)."""
    return 1e3 if name.startswith("entmax") and name[6:] and float(name[6:]) > 2 else 1.0


def check_simplex(p: torch.Tensor, dim: int = -1, atol: float = 1e-5) -> None:
    assert (p >= 0).all(), "negative probability"
    sums = p.to(torch.float64).sum(dim)
    assert torch.allclose(sums, torch.ones_like(sums), atol=atol), f"rows do not sum to 1: {sums}"


# --- forward values ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("n", [1, 3, 97, 1025])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 30.0, 1e4])
def test_forward_matches_reference_float64(name, fn, rfn, n, scale):
    x = make_scores((6, n), torch.float64, scale=scale, seed=n)
    p = fn(x)
    assert_close(p, rfn(x), scale=cond(name))
    check_simplex(p, atol=1e-10)


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_forward_dtypes(name, fn, rfn, dtype):
    x = make_scores((16, 97), dtype, scale=3.0, seed=1)
    p = fn(x)
    assert p.dtype == dtype and p.shape == x.shape
    # The reference sees the same rounded input.
    expected = rfn(x.to(torch.float64))
    assert_close(p, expected, dtype=dtype)
    if dtype == torch.float32:
        check_simplex(p)


@pytest.mark.parametrize("alpha", [1.05, 1.2, 1.3, 1.45, 1.7])
@pytest.mark.parametrize("n", [5, 97, 1024])
def test_many_random_rows_float32(alpha, n):
    """Thousands of rows: a start or bracket that is wrong on a fraction of a
    percent of rows (the iterative α solver's) shows here, where a handful of
    rows would miss it."""
    x = torch.randn(3000 if n < 1024 else 600, n, generator=torch.Generator().manual_seed(n))
    assert_close(attnkern.entmax(x, alpha), ref.entmax(x.double(), alpha), dtype=torch.float32)


def _lane_start_rows(n: int, g: torch.Generator, scales, count: int) -> list[torch.Tensor]:
    """float64 rows of length n for the solvers' start from row_max's running
    maxima: `count` random rows at each scale, rows with 90% of their entries
    masked (masked entries among the maxima), and rows with a single allowed
    entry."""
    rows = [scale * torch.randn(count, n, generator=g, dtype=torch.float64) for scale in scales]
    masked = 3.0 * torch.randn(40, n, generator=g, dtype=torch.float64)
    masked[torch.rand(40, n, generator=g) < 0.9] = -math.inf
    masked[:, 0] = 0.5
    rows.append(masked)
    single = torch.full((2, n), -math.inf, dtype=torch.float64)
    single[:, n // 2] = 1.0
    rows.append(single)
    return rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("alpha", [1.1, 1.3, 1.7])
@pytest.mark.parametrize("n", [31, 32, 33, 64, 97, 1025])
def test_alpha_start_from_lane_maxima(dtype, alpha, n):
    """Rows long enough for the α solver's start from row_max's running maxima
    (n >= 32 with AVX2, 64 with AVX-512): scales where the entries that can be
    in the support are a few (the search and write on that list alone) or most
    of the row (the general loop), masked entries among the maxima, a single
    allowed entry, and ties."""
    g = torch.Generator().manual_seed(n)
    rows = _lane_start_rows(n, g, (1e-3, 0.3, 1.0, 4.0, 30.0), 40)
    rows.append(torch.randint(0, 3, (40, n), generator=g).double())
    x = torch.cat(rows).to(dtype)
    assert_close(attnkern.entmax(x, alpha), ref.entmax(x.double(), alpha), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [31, 32, 33, 64, 65, 97, 1024, 1025])
def test_entmax15_from_lane_maxima(dtype, n):
    """entmax15 rows long enough for the start from row_max's running maxima
    (n >= 32 with AVX2, 64 with AVX-512): the shift by ranks where the
    candidates are few (random rows), find_shift on the list where they are
    many (flat rows: more than four vectors), masked entries, a single allowed
    entry, ties at the edge of the support (the ranks' choice is then checked
    and may be refused), and the attention score rows, which share the path."""
    g = torch.Generator().manual_seed(n + 15)
    rows = _lane_start_rows(n, g, (1e-3, 0.3, 0.7, 1.0, 4.0, 30.0), 60)
    ties = torch.randint(0, 5, (60, n), generator=g).double() * 0.5  # steps of 0.5: entries on the edge (y - c = -2)
    rows.append(ties)
    x = torch.cat(rows).to(dtype)
    p = attnkern.entmax15(x)
    assert_close(p, ref.entmax15(x.double()), dtype=dtype)
    for r in range(len(x) - len(ties), len(x), 7):  # tied scores, tied probabilities
        for v in x[r].unique():
            assert p[r][x[r] == v].unique().numel() == 1
    if dtype != torch.bfloat16:
        q = x[:8].reshape(1, 2, 4, n)
        k = torch.eye(n, dtype=dtype)[None, None].expand(1, 2, n, n)
        v = torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64).to(dtype)
        out = attnkern.attention(q, k, v, normalizer="entmax15", scale=1.0)
        assert_close(out, ref.entmax15(q.double()) @ v.double(), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("alpha", [1.1, 1.3, 1.5, 1.7])
def test_start_from_lane_maxima_refused(dtype, alpha):
    """Rows whose support is K tied maxima in distinct lanes of row_max (the
    rest far below): the norm is then linear in the shift, Newton's step from
    the lanes lands on the root itself, and by rounding about half the time
    just right of it. The search notices (the first evaluation finds Σp < 1,
    or entmax15's shift comes out left of the start) and starts over from
    c = 0: these rows take that path (about half of them, counted in a C++
    harness on a Zen 5 at AVX-512), and its results must be right."""
    g = torch.Generator().manual_seed(int(alpha * 10))
    n, rows = 1024, []
    for k in range(1, 65):
        for v in 10 * torch.rand(4, generator=g, dtype=torch.float64) - 5:
            row = torch.full((n,), float(v) - 50, dtype=torch.float64)
            j = torch.arange(k)
            row[(j * 7) % 64 + 64 * (j % 3)] = float(v)
            rows.append(row)
    x = torch.stack(rows).to(dtype)
    p = attnkern.entmax15(x) if alpha == 1.5 else attnkern.entmax(x, alpha)
    assert_close(p, ref.entmax(x.double(), alpha), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 129, 1024, 1025])
@pytest.mark.parametrize("name", ["softmax", "sparsemax", "entmax15", "entmax_bisect"])
def test_half_precision_rows_round_the_float32_result(name, n, dtype):
    """A bfloat16 / float16 row is widened to float32 (for softmax, sparsemax
    and entmax15 in the pass that takes its max and running maxima, whose
    blocks are 32 entries at AVX2 and 64 at AVX-512, hence the lengths),
    computed in float32 and rounded once (to nearest even) as it is stored, by
    vcvtne2ps2bf16 where the CPU has AVX512_BF16 and by integer operations
    elsewhere, including the row's tail: the result is the float32 op's on the
    widened input, rounded, bit for bit (NaN rows: NaN)."""
    fn = {"softmax": lambda t: attnkern.softmax(t, -1), "sparsemax": attnkern.sparsemax,
          "entmax15": attnkern.entmax15, "entmax_bisect": lambda t: attnkern.entmax_bisect(t, 1.3)}[name]
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(64, n, generator=g)).to(dtype)
    x[3, 0] = math.nan
    x[5] = -math.inf
    x[7, -1] = math.nan  # in the tail past the last full block
    got, want = fn(x), fn(x.float()).to(dtype)
    assert got.dtype == dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])


def test_entmax15_many_random_rows_float32():
    """Thousands of random rows of 1024 (the ranks' path on nearly all): a
    choice of support that is wrong on a fraction of a percent would show."""
    x = torch.randn(4000, 1024, generator=torch.Generator().manual_seed(1515))
    assert_close(attnkern.entmax15(x), ref.entmax15(x.double()), dtype=torch.float32)


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
def test_long_rows_float32(name, fn, rfn):
    x = make_scores((3, 32768), torch.float32, scale=2.0, seed=7)
    assert_close(fn(x), rfn(x.double()), dtype=torch.float32)


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("n,offset", [(4096, 0), (4099, 1), (5000, 300), (8192, 777)])
def test_long_rows_at_any_offset_forward_and_backward(name, fn, rfn, n, offset):
    """Rows of 4096 and more move their scratch per row, away from the row
    modulo 4 KiB (RowScratch::place): rows at odd offsets in memory and of odd
    lengths, forward and backward against the reference."""
    store = make_scores((3 * n + offset,), torch.float32, scale=2.0, seed=n)
    x = store[offset:].view(3, n).requires_grad_()
    g = make_scores((3, n), torch.float32, seed=n + 1)
    xd = x.detach().double().requires_grad_()
    p, pd = fn(x), rfn(xd)
    assert_close(p, pd, dtype=torch.float32, scale=cond(name))
    (gx,) = torch.autograd.grad(p, x, g)
    (gd,) = torch.autograd.grad(pd, xd, g.double())
    assert_close(gx, gd, dtype=torch.float32, scale=cond(name))


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_any_dim_and_noncontiguous(name, fn, rfn, dim):
    base = make_scores((7, 5, 11), torch.float64, scale=2.0, seed=3)
    for x in (base, base.transpose(0, 2), base[:, ::2, 1:]):
        d = dim if dim < x.dim() else -1
        assert_close(fn(x, dim=d), rfn(x, dim=d))


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_ties(name, fn, rfn, dtype):
    x = with_ties((32, 33), dtype, seed=4)
    p = fn(x)
    assert_close(p, rfn(x.double()), dtype=dtype)
    # Tied scores get the same probability.
    for r in range(4):
        for v in x[r].unique():
            sel = p[r][x[r] == v]
            assert torch.allclose(sel, sel[0].expand_as(sel))


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_masked_and_fully_masked_rows(name, fn, rfn, dtype):
    x = mask_some(make_scores((9, 40), dtype, scale=2.0, seed=5), frac=0.4, full_rows=2)
    p = fn(x)
    assert not torch.isnan(p).any()
    assert (p[x == -math.inf] == 0).all(), "-inf score got probability"
    assert (p[:2] == 0).all(), "fully masked row is not zero"
    assert_close(p, rfn(x.double()), dtype=dtype)
    xr = x.double().requires_grad_()
    fn(xr).backward(torch.randn(xr.shape, dtype=torch.float64))
    assert not torch.isnan(xr.grad).any()
    assert (xr.grad[:2] == 0).all()


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
def test_nan_stays_in_its_row(name, fn, rfn):
    x = make_scores((4, 9), torch.float32, seed=6)
    x[1, 3] = math.nan
    x.requires_grad_(True)
    p = fn(x)
    assert torch.isnan(p[1]).all()
    assert not torch.isnan(p[[0, 2, 3]]).any()
    assert_close(p[[0, 2, 3]], rfn(x[[0, 2, 3]].detach().double()), dtype=torch.float32)
    # Its gradient is NaN too, for every normalizer (as torch.softmax's), and
    # the other rows' are finite.
    p.backward(torch.randn_like(p))
    assert torch.isnan(x.grad[1]).all()
    assert torch.isfinite(x.grad[[0, 2, 3]]).all()


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
def test_empty_tensors(name, fn, rfn):
    for shape in [(0, 5), (3, 0), (0,)]:
        x = torch.empty(shape)
        assert fn(x).shape == x.shape


def test_scalar_tensor_input():
    x = torch.tensor(3.0)
    for f in (attnkern.softmax, attnkern.sparsemax, attnkern.entmax15):
        assert f(x).item() == 1.0


# --- against the entmax package ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1, 3, 97, 1025])
def test_matches_entmax_package(dtype, n):
    x = make_scores((8, n), dtype, scale=2.0, seed=n)
    assert_close(attnkern.sparsemax(x), entmax_pkg.sparsemax(x, -1), dtype=dtype)
    assert_close(attnkern.entmax15(x), entmax_pkg.entmax15(x, -1), dtype=dtype)
    for a in (1.25, 1.5, 2.0, 0.7):
        ours = attnkern.entmax_bisect(x, a)
        theirs = entmax_pkg.entmax_bisect(x.double(), a, n_iter=100)
        assert_close(ours, theirs, dtype=dtype)


def test_alpha_below_one_known_values():
    x = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    expected = torch.tensor([0.1591, 0.1763, 0.1963, 0.2200, 0.2483], dtype=torch.float64)
    assert torch.allclose(attnkern.entmax(x, 0.5), expected, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, alpha", [(5, -60.0), (100, -30.0), (1000, -15.0), (1000, -60.0), (10, 0.5)])
def test_very_negative_alpha_as_in_float64(dtype, n, alpha):
    # n^(1 - α) beyond float32's range (the search's bracket overflowed, and
    # float32 rows lost up to 10% in their weights): those rows run in double.
    x = make_scores((8, n), torch.float64, scale=2.0, seed=31)
    expected = attnkern.entmax_bisect(x, alpha)
    ours = attnkern.entmax_bisect(x.to(dtype), alpha)
    rel = ((ours.double() - expected) / expected).abs().max().item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_op_refuses_a_non_finite_alpha(bad):
    # The public function checks α in eager mode; the op itself (which a
    # compiled graph calls) refuses it too rather than returning zeros.
    x = torch.randn(3, 7)
    alpha = torch.tensor([[1.5], [bad], [1.2]])
    with pytest.raises(ValueError, match="alpha must be finite"):
        torch.ops.attnkern.entmax_fwd(x, alpha, -1)


# --- invariants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
def test_shift_invariance(name, fn, rfn):
    x = make_scores((5, 50), torch.float64, seed=8)
    assert_close(fn(x + 123.25), fn(x))


def test_family_members_agree():
    x = make_scores((10, 77), torch.float64, scale=2.0, seed=9)
    assert_close(attnkern.entmax(x, 2.0), attnkern.sparsemax(x))
    assert_close(attnkern.entmax(x, 1.5), attnkern.entmax15(x))
    assert_close(attnkern.entmax(x, 1.0), attnkern.softmax(x))
    # Per-row tensor α takes the same exact paths.
    a = torch.tensor([1.0, 1.5, 2.0] * 3 + [1.5], dtype=torch.float64).unsqueeze(-1)
    expected = torch.stack([{1.0: attnkern.softmax, 1.5: attnkern.entmax15, 2.0: attnkern.sparsemax}[
        float(a[i])](x[i]) for i in range(10)])
    assert_close(attnkern.entmax(x, a), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_continuous_at_alpha_one(dtype):
    x = make_scores((6, 200), dtype, scale=3.0, seed=10)
    soft = attnkern.softmax(x)
    for eps in (1e-3, 1e-4, 1e-6, 1e-8):
        for a in (1 - eps, 1 + eps):
            err = (attnkern.entmax(x, a) - soft).abs().max().item()
            assert err < 50 * eps + 1e-6, (a, err)
    # Unlike the entmax package, α = 1 is softmax, not uniform.
    assert_close(attnkern.entmax_bisect(x, 1.0), soft)


def test_sparsity_grows_with_alpha():
    x = make_scores((20, 300), torch.float64, seed=11)
    nnz = [(attnkern.entmax(x, a) > 0).sum().item() for a in (1.2, 1.5, 2.0, 3.0)]
    assert nnz == sorted(nnz, reverse=True) and nnz[0] > nnz[-1]


# --- gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
def test_gradcheck_x(name, fn, rfn):
    x = make_scores((3, 8), torch.float64, scale=1.5, seed=12).requires_grad_()
    assert gradcheck(fn, (x,), eps=1e-6, atol=1e-6)
    assert gradcheck(rfn, (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.6, 1.1, 1.3, 1.5, 2.0, 2.6])
def test_gradcheck_alpha_scalar_and_per_row(alpha):
    x = make_scores((4, 7), torch.float64, scale=1.5, seed=13).requires_grad_()
    a0 = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x, a: attnkern.entmax(x, a), (x, a0), eps=1e-6, atol=1e-6)
    a_rows = (alpha + 0.05 * torch.arange(4, dtype=torch.float64)).unsqueeze(-1).requires_grad_()
    assert gradcheck(lambda x, a: attnkern.entmax(x, a), (x, a_rows), eps=1e-6, atol=1e-6)
    assert gradcheck(lambda x, a: ref.entmax(x, a), (x, a_rows), eps=1e-6, atol=1e-6)


def test_alpha_gradient_at_and_near_one():
    """The α-derivative at α = 1 (softmax limit) against central differences of the reference."""
    x = make_scores((3, 9), torch.float64, scale=2.0, seed=14)
    w = make_scores((3, 9), torch.float64, seed=15)
    for a in (1.0, 1.0 + 1e-4, 1.0 - 1e-4, 1.0 + 3e-3):
        at = torch.tensor(a, dtype=torch.float64, requires_grad=True)
        (attnkern.entmax(x, at) * w).sum().backward()
        h = 1e-5
        fd = ((ref.entmax(x, a + h) - ref.entmax(x, a - h)) * w).sum() / (2 * h)
        assert abs(at.grad.item() - fd.item()) < 2e-3 * (1 + abs(fd.item())), (a, at.grad.item(), fd.item())


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_matches_reference(name, fn, rfn, dtype):
    x = make_scores((12, 300), dtype, scale=2.0, seed=16)
    g = make_scores((12, 300), dtype, seed=17)
    xk = x.clone().requires_grad_()
    fn(xk).backward(g)
    xr = x.double().requires_grad_()
    rfn(xr).backward(g.double())
    assert xk.grad.dtype == dtype
    assert_close(xk.grad, xr.grad, dtype=dtype, scale=4.0)


@pytest.mark.parametrize("name,fn,rfn", NORMALIZERS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 33, 97, 1025])
def test_half_rows_are_float32_rounded_once(name, fn, rfn, dtype, n):
    # Half-precision rows are widened and rounded a vector at a time: the result must be
    # exactly the float32 computation rounded once, NaN rows included. (The gradient starts
    # from the rounded output, so it is checked against the reference elsewhere.)
    x = make_scores((5, n), torch.float32, scale=3.0, seed=40).to(dtype)
    if n > 1:
        x[0, n // 2] = float("nan")
    with torch.no_grad():
        torch.testing.assert_close(fn(x), fn(x.float()).to(dtype), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [63, 64, 1025])
def test_alpha_rows_in_pairs_equal_rows_alone(dtype, n):
    # α-entmax rows are solved two at a time (their searches in lockstep); each row must
    # come out bit for bit as when solved alone, whatever its neighbour: rows of other
    # families (α = 1.5, 2), α > 2, masked, NaN, all-masked and dense rows, an odd count.
    alphas = [1.3, 1.5, 1.7, 2.0, 1.1, 2.5, 1.3, 1.25, 1.3, 1.6, 1.45]
    x = make_scores((len(alphas), n), torch.float32, scale=3.0, seed=43)
    x[2, : n // 2] = float("-inf")
    x[4, 3] = float("nan")
    x[6] = float("-inf")
    x[7] *= 1e-3
    x = x.to(dtype)
    alpha = torch.tensor(alphas, dtype=torch.float64 if dtype == torch.float64 else torch.float32).unsqueeze(1)
    together = attnkern.entmax_bisect(x, alpha)
    alone = torch.cat([attnkern.entmax_bisect(x[i : i + 1], alpha[i : i + 1]) for i in range(len(alphas))])
    torch.testing.assert_close(together, alone, rtol=0, atol=0, equal_nan=True)


def _row_backward_op(name, p, g):
    ops = torch.ops.attnkern
    if name.startswith("entmax α"):
        alpha = torch.full((*p.shape[:-1], 1), 1.3)
        return ops.entmax_bwd(p, g, alpha, -1, False)[0]
    return getattr(ops, f"{name}_bwd")(p, g, -1)


@pytest.mark.parametrize("name", ["softmax", "sparsemax", "entmax15", "entmax α=1.3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 33, 97, 1025])
def test_half_backward_reads_its_dtype(name, dtype, n):
    # The bfloat16 / half row backward reads p and dp in their dtype (no float copy of the
    # row): from the same rounded p and dp it must give the float32 backward, rounded once
    # (sums in another order: within a rounding step of it), zeros where p is zero.
    fwd = {"softmax": lambda t: attnkern.softmax(t, -1), "sparsemax": attnkern.sparsemax,
           "entmax15": attnkern.entmax15, "entmax α=1.3": lambda t: attnkern.entmax_bisect(t, 1.3)}[name]
    with torch.no_grad():
        x = make_scores((6, n), torch.float32, scale=3.0, seed=41)
        x[1] *= 1e-3  # dense rows: the dense passes
        p = fwd(x.to(dtype))
        g = make_scores((6, n), torch.float32, seed=42).to(dtype)
        dx = _row_backward_op(name, p, g)
        want = _row_backward_op(name, p.float(), g.float())
    assert dx.dtype == dtype
    torch.testing.assert_close(dx.float(), want.to(dtype).float(), rtol=2 ** -7, atol=1e-6)
    if name != "softmax":
        assert bool((dx[p == 0] == 0).all())


def test_alpha_gradient_per_head_float32():
    x = make_scores((2, 4, 6, 50), torch.float32, seed=18)
    g = make_scores((2, 4, 6, 50), torch.float32, seed=19)
    a = torch.tensor([1.2, 1.5, 1.8, 2.3]).view(1, 4, 1, 1).requires_grad_()
    attnkern.entmax(x, a).backward(g)
    ar = a.detach().double().requires_grad_()
    ref.entmax(x.double(), ar).backward(g.double())
    assert a.grad.shape == a.shape
    # dα sums over the 12 rows of its head: five times the row-wise gradient rule.
    torch.testing.assert_close(a.grad.double(), ar.grad, **tolerance(torch.float32, "rowwise", "gradient", scale=5.0))


# --- modules -------------------------------------------------------------------------------------


def test_modules():
    x = make_scores((2, 3, 4, 10), torch.float32, seed=20)
    assert_close(attnkern.nn.Softmax(dim=1)(x), ref.softmax(x.double(), 1), dtype=torch.float32)
    assert_close(attnkern.nn.Sparsemax(dim=-1)(x), ref.sparsemax(x.double()), dtype=torch.float32)
    assert_close(attnkern.nn.Entmax15()(x), ref.entmax15(x.double()), dtype=torch.float32)
    assert_close(attnkern.nn.EntmaxBisect(alpha=1.3)(x), ref.entmax(x.double(), 1.3), dtype=torch.float32)
    m = attnkern.nn.EntmaxAlpha(heads=3, alpha_init=1.4)
    assert torch.allclose(m.alpha, torch.full((3,), 1.4))
    p = m(x)
    check_simplex(p)
    p.sum().backward()
    assert m.theta.grad is not None and m.theta.grad.shape == (3,)
    with pytest.raises(ValueError, match="heads"):
        m(torch.randn(2, 5, 4, 10))
    with pytest.raises(ValueError, match="alpha_init"):
        attnkern.nn.EntmaxAlpha(heads=2, alpha_init=2.5)
    with pytest.raises(ValueError, match="heads"):
        attnkern.nn.EntmaxAlpha(heads=True)
    with pytest.raises(ValueError, match="head_dim=5"):
        attnkern.nn.EntmaxAlpha(heads=3, head_dim=5)(x)
    # The reprs name every setting.
    assert "head_dim=1, alpha_init=1.4" in repr(m)
    assert "k=3, return_support_size=True" in repr(attnkern.nn.Sparsemax(k=3, return_support_size=True))
    assert "n_iter=50" in repr(attnkern.nn.EntmaxBisect(alpha=1.3))
    assert repr(attnkern.EntmaxBisectLoss(alpha=1.2)).startswith("EntmaxBisectLoss(alpha=1.2, n_iter=50, ")


# --- errors --------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="X"):
        attnkern.sparsemax(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="X"):
        attnkern.entmax15(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="X"):
        attnkern.softmax([1.0, 2.0])
    with pytest.raises(IndexError, match="dim"):
        attnkern.sparsemax(x, dim=2)
    with pytest.raises(ValueError, match="dim"):
        attnkern.entmax(x, 1.3, dim=-3)
    for bad in (math.inf, -math.inf, math.nan):  # α ≤ 0 is accepted, as in the entmax package
        with pytest.raises(ValueError, match="alpha"):
            attnkern.entmax_bisect(x, bad)
    with pytest.raises(ValueError, match="alpha"):
        attnkern.entmax(x, torch.tensor([[1.5], [math.nan], [1.2]]))
    with pytest.raises(ValueError, match="alpha"):
        attnkern.entmax(x, torch.full((4, 1), 1.5))  # not broadcastable to (3, 1)
    with pytest.raises(ValueError, match="alpha"):
        attnkern.entmax(x, torch.full((3, 4), 1.5))  # varies along dim
    with pytest.raises(TypeError, match="alpha"):
        attnkern.entmax(x, "1.5")
    with pytest.raises(ValueError, match="n_iter"):
        attnkern.entmax_bisect(x, 1.5, n_iter=0)
    with pytest.raises(ValueError, match="backend"):
        attnkern.sparsemax(x, backend="gpu")
    with pytest.raises(RuntimeError, match="triton"):
        attnkern.sparsemax(x, backend="triton")


def test_reference_backend_is_selectable():
    x = make_scores((4, 20), torch.float32, seed=21)
    assert_close(attnkern.entmax15(x, backend="reference"), attnkern.entmax15(x, backend="cpu"),
                 dtype=torch.float32)


# --- torch.library integration -------------------------------------------------------------------


def _opcheck_cases():
    x = make_scores((4, 13), torch.float32, seed=22)
    xt = make_scores((13, 4), torch.float32, seed=23).t()  # non-contiguous
    p = attnkern.entmax15(x)
    g = make_scores((4, 13), torch.float32, seed=24)
    a = torch.full((4, 1), 1.3)
    ops = torch.ops.attnkern
    cases = []
    for name in ("softmax", "sparsemax", "entmax15"):
        cases.append((getattr(ops, f"{name}_fwd"), (x, -1)))
        cases.append((getattr(ops, f"{name}_fwd"), (xt, 0)))
        cases.append((getattr(ops, f"{name}_bwd"), (p, g, 1)))
    cases.append((ops.entmax_fwd, (x, a, 1)))
    cases.append((ops.entmax_fwd, (xt, torch.tensor(1.7), 0)))
    cases.append((ops.entmax_bwd, (p, g, a, 1, True)))
    cases.append((ops.entmax_bwd, (p, g, a, 1, False)))
    return cases


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    def f(x, a):
        return (attnkern.sparsemax(x) + attnkern.entmax15(x, dim=0) + attnkern.entmax(x, a)).sum()

    x = make_scores((6, 10), torch.float32, seed=25).requires_grad_()
    a = torch.full((6, 1), 1.3, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, a)
    out.backward()
    gx, ga = x.grad.clone(), a.grad.clone()
    x.grad = a.grad = None
    f(x, a).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(ga, a.grad)


@pytest.mark.parametrize("name", ["softmax", "sparsemax", "entmax15", "entmax_bisect", "entmax"])
def test_calls_without_a_graph_skip_the_autograd_node(name):
    """With nothing to differentiate (no_grad, inference_mode, or no input that
    needs a gradient) a normalizer runs its forward without Function.apply: the
    same values, no grad_fn; with an input that needs one, the node is there."""
    alpha = torch.full((5, 1), 1.4, requires_grad=True)
    fn = {"softmax": lambda t: attnkern.softmax(t, -1), "sparsemax": attnkern.sparsemax,
          "entmax15": attnkern.entmax15, "entmax_bisect": lambda t: attnkern.entmax_bisect(t, 1.3),
          "entmax": lambda t: attnkern.entmax(t, alpha.detach())}[name]
    x = torch.randn(5, 33)
    want = fn(x.clone().requires_grad_(True))
    assert want.grad_fn is not None
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            got = fn(x.clone().requires_grad_(True))
        assert got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, want.detach())
    got = fn(x)
    assert got.grad_fn is None and torch.equal(got, want.detach())
    if name == "entmax":  # α alone needs the gradient: the node is kept
        p = attnkern.entmax(x, alpha)
        assert p.grad_fn is not None
        p.sum().backward()
        assert alpha.grad is not None
