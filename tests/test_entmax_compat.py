"""`import attnkern as entmax`: every top-level name of the `entmax` package (1.3),
against the installed package, plus the deliberate differences."""

from __future__ import annotations

import inspect
import math

import entmax as pkg
import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import attnkern
from attnkern.testing import assert_close, make_scores, mask_some, with_ties

F64 = torch.float64
DTYPES = [torch.float64, torch.float32]
PKG_NAMES = sorted(n for n in dir(pkg) if not n.startswith("_") and not inspect.ismodule(getattr(pkg, n)))


def _params(obj):
    sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    return [(p.name, p.default) for p in sig.parameters.values() if p.kind != p.KEYWORD_ONLY]


# --- names and signatures ---------------------------------------------------------------------


def test_every_package_name_is_exported():
    assert len(PKG_NAMES) == 22
    assert set(PKG_NAMES) == set(attnkern.ENTMAX_COMPAT)
    for name in PKG_NAMES:
        assert name in attnkern.__all__, name


@pytest.mark.parametrize("name", PKG_NAMES)
def test_same_signature_and_defaults(name):
    ours, theirs = _params(getattr(attnkern, name)), _params(getattr(pkg, name))
    # Our extra positional parameter (return_support_size) comes last, with a default.
    extra = [p for p in ours if p[0] not in dict(theirs)]
    assert extra in ([], [("return_support_size", False)]), extra
    assert [p for p in ours if p[0] in dict(theirs)] == theirs


# --- activations and root finding vs the package --------------------------------------------------


def _inputs(dtype, seed):
    yield "random", make_scores((7, 23), dtype, scale=2.0, seed=seed)
    yield "ties", with_ties((6, 17), dtype, seed=seed)
    yield "odd", make_scores((3, 1), dtype, seed=seed)
    yield "long", make_scores((2, 1031), dtype, scale=3.0, seed=seed)


def _pkg_precise(name):
    """The package's functions with enough bisection steps for float64."""
    return {
        "sparsemax": lambda x, dim: pkg.sparsemax(x, dim),
        "entmax15": lambda x, dim: pkg.entmax15(x, dim),
        "sparsemax_bisect": lambda x, dim: pkg.sparsemax_bisect(x, dim),
        "entmax_bisect(1.25)": lambda x, dim: pkg.entmax_bisect(x, 1.25, dim, n_iter=100),
        "entmax_bisect(0.7)": lambda x, dim: pkg.entmax_bisect(x, 0.7, dim, n_iter=100),
        "normmax_bisect(2)": lambda x, dim: pkg.normmax_bisect(x, 2, dim, n_iter=100),
        "normmax_bisect(1.5)": lambda x, dim: pkg.normmax_bisect(x, 1.5, dim, n_iter=100),
        "normmax_bisect(4)": lambda x, dim: pkg.normmax_bisect(x, 4.0, dim, n_iter=100),
        "budget_bisect(2)": lambda x, dim: pkg.budget_bisect(x, 2, dim, n_iter=100),
        "budget_bisect(3.5)": lambda x, dim: pkg.budget_bisect(x, 3.5, dim, n_iter=100),
    }[name]


def _ours(name):
    fn = {"sparsemax": attnkern.sparsemax, "entmax15": attnkern.entmax15,
          "sparsemax_bisect": attnkern.sparsemax_bisect}.get(name)
    if fn is not None:
        return lambda x, dim: fn(x, dim)
    base, arg = name[:-1].split("(")
    return lambda x, dim: getattr(attnkern, base)(x, float(arg), dim)


def _cond(name: str) -> float:
    """Tolerance factor. α-normmax has p ∝ [x - τ]_+^(1/(α-1)): for α > 2 the
    slope is infinite at the support's edge, so a rounding-level error δ in τ
    moves small probabilities by δ^(1/(α-1)) (float32, α = 4: ~5e-3)."""
    return 300.0 if name == "normmax_bisect(4)" else 5.0


FUNCS = ["sparsemax", "entmax15", "sparsemax_bisect", "entmax_bisect(1.25)", "entmax_bisect(0.7)",
         "normmax_bisect(2)", "normmax_bisect(1.5)", "normmax_bisect(4)", "budget_bisect(2)",
         "budget_bisect(3.5)"]


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_package(name, dtype):
    for kind, x in _inputs(dtype, seed=len(name)):
        if kind == "odd" and name.startswith("budget"):
            continue  # a budget above the row length is infeasible; tested below
        # The package in float64 is the oracle; its float32 bisection is itself
        # only accurate to a few ulps of the threshold.
        expected = _pkg_precise(name)(x.to(F64), -1)
        assert_close(_ours(name)(x, -1), expected, dtype=dtype, scale=_cond(name), msg=f"{name} {kind}")


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dim_and_noncontiguous(name, dim):
    base = make_scores((5, 6, 7), F64, scale=2.0, seed=3)
    for x in (base, base.transpose(0, 2)):
        expected = _pkg_precise(name)(x.movedim(dim, -1).contiguous(), -1).movedim(-1, dim)
        assert_close(_ours(name)(x, dim), expected, msg=f"{name} dim={dim}")


@pytest.mark.parametrize("fn", [attnkern.sparsemax, attnkern.entmax15])
def test_return_support_size(fn):
    x = make_scores((4, 9, 30), F64, scale=3.0, seed=1)
    for dim in (0, 1, 2):
        p, s = fn(x, dim, return_support_size=True)
        assert s.dtype == torch.int64
        assert s.shape == tuple(1 if d == dim else n for d, n in enumerate(x.shape))
        assert torch.equal(s, (p > 0).sum(dim, keepdim=True))
        assert torch.equal(p, fn(x, dim))
    module = {attnkern.sparsemax: attnkern.Sparsemax, attnkern.entmax15: attnkern.Entmax15}[fn]
    p, s = module(dim=1, return_support_size=True)(x)
    assert torch.equal(s, (p > 0).sum(1, keepdim=True)) and s.min() >= 1


def test_tensor_alpha_and_budget_per_row():
    x = make_scores((4, 12), F64, scale=2.0, seed=2)
    a = torch.tensor([[1.5], [2.0], [3.0], [1.2]], dtype=F64)
    assert_close(attnkern.normmax_bisect(x, a), pkg.normmax_bisect(x, a, n_iter=100))
    b = torch.tensor([[1.0], [2.0], [2.5], [5.0]], dtype=F64)
    assert_close(attnkern.budget_bisect(x, b), pkg.budget_bisect(x, b, n_iter=100))
    assert_close(attnkern.budget_bisect(x, b).sum(-1, keepdim=True), b)


def test_budget_at_or_above_row_length_gives_ones():
    x = make_scores((3, 4), F64, seed=4)
    assert torch.equal(attnkern.budget_bisect(x, 4.0), torch.ones_like(x))
    assert torch.equal(attnkern.budget_bisect(x, 7.0), torch.ones_like(x))


@pytest.mark.parametrize("name", ["Sparsemax", "Entmax15", "SparsemaxBisect", "EntmaxBisect", "NormmaxBisect",
                                  "BudgetBisect"])
def test_modules_match_package(name):
    x = make_scores((5, 8, 13), F64, scale=2.0, seed=5)
    kwargs = {"EntmaxBisect": dict(alpha=1.3), "NormmaxBisect": dict(alpha=3.0), "BudgetBisect": dict(budget=2.5)}
    kwargs = dict(kwargs.get(name, {}), dim=1)
    ours = getattr(attnkern, name)(**kwargs)
    assert isinstance(ours, torch.nn.Module) and isinstance(ours, getattr(attnkern.nn, name))
    if name in ("EntmaxBisect", "NormmaxBisect", "BudgetBisect"):
        kwargs["n_iter"] = 100
    assert_close(ours(x), getattr(pkg, name)(**kwargs)(x))


# --- gradients ---------------------------------------------------------------------------------------


def _x(shape=(3, 7), seed=0, scale=1.5):
    return make_scores(shape, F64, scale=scale, seed=seed).requires_grad_()


def test_gradcheck_normmax_x_and_alpha():
    for a in (2.0, 1.5, 3.0):
        assert gradcheck(lambda x, a=a: attnkern.normmax_bisect(x, a), (_x(),))
    alpha = torch.tensor([[1.5], [2.0], [3.0]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, al: attnkern.normmax_bisect(x, al), (_x(seed=1), alpha))
    # dim 0, one α per column
    alpha0 = torch.tensor([[1.7, 2.5, 2.0, 1.3, 4.0, 2.0, 1.5]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, al: attnkern.normmax_bisect(x, al, dim=0), (_x((5, 7), seed=2), alpha0))


def test_gradcheck_budget_x_and_budget():
    for b in (1.0, 2.5):
        assert gradcheck(lambda x, b=b: attnkern.budget_bisect(x, b), (_x((3, 9), scale=0.5),))
    budget = torch.tensor([[1.5], [2.0], [3.3]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, b: attnkern.budget_bisect(x, b), (_x((3, 9), seed=1, scale=0.5), budget))


def test_gradcheck_sparsemax_bisect():
    assert gradcheck(lambda x: attnkern.sparsemax_bisect(x, 0), (_x((6, 4)),))
    # The package's SparsemaxBisect passes n_iter=None through.
    x = make_scores((3, 5), F64, seed=28)
    assert_close(attnkern.sparsemax_bisect(x, n_iter=None), pkg.sparsemax_bisect(x, n_iter=None))


@pytest.mark.parametrize("name,arg", [("normmax_bisect", 2.0), ("normmax_bisect", 1.5), ("budget_bisect", 2.0)])
def test_x_gradient_matches_package(name, arg):
    x = _x((4, 11), seed=3)
    g = make_scores((4, 11), F64, seed=9)
    (dx,) = torch.autograd.grad(getattr(attnkern, name)(x, arg), x, g)
    (dx_pkg,) = torch.autograd.grad(getattr(pkg, name)(x, arg, n_iter=100), x, g)
    assert_close(dx, dx_pkg, scale=10.0)


# --- losses ---------------------------------------------------------------------------------------

LOSSES = [("sparsemax_loss", {}), ("entmax15_loss", {}), ("sparsemax_bisect_loss", {}),
          ("entmax_bisect_loss", dict(alpha=1.3)), ("entmax_bisect_loss", dict(alpha=2.5)),
          ("normmax_bisect_loss", dict(alpha=2.0)), ("normmax_bisect_loss", dict(alpha=3.0))]
LOSS_IDS = [f"{n}{v.get('alpha', '')}" for n, v in LOSSES]


def _pkg_loss_kwargs(name, kwargs):
    return dict(kwargs, n_iter=100) if "bisect" in name and "sparsemax" not in name else kwargs


@pytest.mark.parametrize("name,kwargs", LOSSES, ids=LOSS_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_values_and_gradient_match_package(name, kwargs, dtype):
    x = make_scores((12, 17), dtype, scale=2.0, seed=7).requires_grad_()
    t = torch.randint(0, 17, (12,), generator=torch.Generator().manual_seed(0))
    ours = getattr(attnkern, name)(x, t, **kwargs)
    x64 = x.detach().to(F64).requires_grad_()
    theirs = getattr(pkg, name)(x64, t, **_pkg_loss_kwargs(name, kwargs))
    assert ours.shape == (12,) and ours.dtype == dtype
    assert_close(ours, theirs, dtype=dtype, scale=5.0)
    assert (ours >= -1e-6).all()
    g = make_scores((12,), F64, seed=1)
    (dx,) = torch.autograd.grad(ours, x, g.to(dtype))
    (dx_pkg,) = torch.autograd.grad(theirs, x64, g)
    assert_close(dx, dx_pkg, dtype=dtype, scale=5.0)


@pytest.mark.parametrize("name,kwargs", LOSSES, ids=LOSS_IDS)
def test_loss_gradcheck(name, kwargs):
    x = _x((4, 6), seed=11)
    t = torch.tensor([0, 5, 2, 2])
    assert gradcheck(lambda x: getattr(attnkern, name)(x, t, **kwargs), (x,))


@pytest.mark.parametrize("name", ["entmax_bisect_loss", "normmax_bisect_loss"])
def test_loss_gradcheck_alpha(name):
    x = _x((3, 6), seed=12)
    t = torch.tensor([1, 4, 0])
    alpha = torch.tensor([[1.4], [2.0], [2.7]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, a: getattr(attnkern, name)(x, t, a), (x, alpha))


MODULES = ["SparsemaxLoss", "SparsemaxBisectLoss", "Entmax15Loss", "EntmaxBisectLoss", "NormmaxBisectLoss"]


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("reduction", ["none", "sum", "elementwise_mean"])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_loss_modules_match_package(name, reduction, ignore_index):
    x = make_scores((10, 8), F64, scale=2.0, seed=13).requires_grad_()
    t = torch.tensor([3, 1, 0, 3, 7, 2, 3, 5, 6, 4])
    ours = getattr(attnkern, name)(ignore_index=ignore_index, reduction=reduction)
    theirs = getattr(pkg, name)(ignore_index=ignore_index, reduction=reduction)
    if hasattr(theirs, "n_iter"):
        theirs.n_iter = 100
    lo, lt = ours(x, t), theirs(x, t)
    assert_close(lo, lt)
    g = torch.ones_like(lo)
    (dx,) = torch.autograd.grad(lo, x, g)
    (dx_pkg,) = torch.autograd.grad(lt, x, g)
    assert_close(dx, dx_pkg)
    if ignore_index == 3:
        assert (dx[t == 3] == 0).all()


def test_loss_module_ignores_negative_ignore_index_targets():
    # The package indexes with the ignored target (an error for -100); we skip it.
    x = make_scores((4, 5), F64, seed=14)
    t = torch.tensor([1, -100, 4, -100])
    loss = attnkern.SparsemaxLoss(reduction="none")(x, t)
    assert loss[1] == 0 and loss[3] == 0
    assert_close(attnkern.SparsemaxLoss()(x, t), loss.sum() / 2)


@pytest.mark.parametrize("loss", [attnkern.sparsemax_loss, attnkern.entmax15_loss,
                                  lambda x, t: attnkern.entmax_bisect_loss(x, t, 1.3),
                                  lambda x, t: attnkern.normmax_bisect_loss(x, t, 2.0)])
@pytest.mark.parametrize("target", [[0, 2, 5, 1], [0, -1, 2, 1]])
def test_loss_target_out_of_range(loss, target):
    # Every loss names the problem (normmax's raised torch's indexing error).
    with pytest.raises(ValueError, match=r"target must hold class indices in \[0, 5\)"):
        loss(torch.randn(4, 5), torch.tensor(target))


@pytest.mark.parametrize("fn", [lambda x: attnkern.normmax_bisect(x, 2.0), lambda x: attnkern.budget_bisect(x, 2.0)],
                         ids=["normmax", "budget"])
def test_nan_row_gradient_is_nan(fn):
    x = torch.randn(3, 6, dtype=torch.float64)
    x[1, 2] = math.nan
    x.requires_grad_(True)
    fn(x).backward(torch.ones(3, 6, dtype=torch.float64))
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[[0, 2]]).all()


def test_loss_bad_reduction():
    with pytest.raises(ValueError):
        attnkern.SparsemaxLoss(reduction="avg")


# --- deliberate differences ----------------------------------------------------------------------------


def test_losses_accept_masked_logits():
    x = mask_some(make_scores((8, 10), F64, scale=2.0, seed=15), frac=0.3, full_rows=0)
    t = torch.tensor([int(torch.nonzero(r > -math.inf)[0]) for r in x])
    xr = x.clone().requires_grad_()
    for name, kwargs in LOSSES:
        loss = getattr(attnkern, name)(xr, t, **kwargs)
        assert torch.isfinite(loss).all(), name
        (dx,) = torch.autograd.grad(loss.sum(), xr)
        assert not torch.isnan(dx).any() and (dx[x == -math.inf] == 0).all(), name
        # Same as the loss on each row's finite entries alone.
        for i in range(2):
            keep = x[i] > -math.inf
            # t[i] is the row's first finite entry, index 0 once the -inf are dropped.
            ref = getattr(attnkern, name)(x[i, keep][None], torch.tensor([0]), **kwargs)
            assert_close(loss[i], ref[0])


def test_entmax_bisect_loss_at_alpha_one_is_cross_entropy():
    x = make_scores((6, 9), F64, scale=2.0, seed=16)
    t = torch.tensor([0, 8, 3, 3, 1, 2])
    ce = torch.nn.functional.cross_entropy(x, t, reduction="none")
    assert_close(attnkern.entmax_bisect_loss(x, t, 1.0), ce)


@pytest.mark.parametrize("name", ["normmax_bisect", "budget_bisect"])
def test_fully_masked_rows_and_nan_rows(name):
    x = mask_some(make_scores((5, 12), F64, scale=2.0, seed=17), frac=0.3, full_rows=1)
    x[3, 2] = math.nan
    xr = x.clone().requires_grad_()
    p = getattr(attnkern, name)(xr, 2.0)
    assert (p[0] == 0).all()
    assert torch.isnan(p[3]).all()
    ok = [1, 2, 4]
    assert not torch.isnan(p[ok]).any()
    assert (p[ok][x[ok] == -math.inf] == 0).all()
    p[ok].sum().backward()
    assert not torch.isnan(xr.grad[ok]).any() and (xr.grad[0] == 0).all()


@pytest.mark.parametrize("fn,bad", [(attnkern.normmax_bisect, 1.0), (attnkern.budget_bisect, -1.0)])
def test_invalid_parameters_raise(fn, bad):
    # Documented refusals: normmax needs α > 1; a negative budget is infeasible
    # (the package returns zeros that do not sum to it). n_iter = 0 fails in the
    # package too (it has no bisection step to return).
    x = make_scores((2, 5), F64, seed=18)
    with pytest.raises(ValueError, match="alpha|budget"):
        fn(x, bad)
    with pytest.raises(ValueError, match="n_iter"):
        fn(x, 2.0, n_iter=0)
    with pytest.raises(TypeError, match="n_iter"):
        fn(x, 2.0, n_iter=50.0)


# --- everything the package accepts --------------------------------------------------------------

AUDIT_X = make_scores((4, 7), F64, scale=2.0, seed=40)
AUDIT_T = torch.tensor([1, 3, 0, 6])


def _int_likes(v):
    """The ways users pass an int: Python, numpy, 0-d tensors (e.g. y[0])."""
    return {"int": v, "np.int64": np.int64(v), "tensor": torch.tensor(v),
            "int32 tensor": torch.tensor(v, dtype=torch.int32)}


def _real_likes(v):
    out = {"int": int(v), "float": float(v), "np.float64": np.float64(v), "np.float32": np.float32(v),
           "np.int64": np.int64(v), "0-d float64": torch.tensor(float(v), dtype=F64),
           "0-d float32": torch.tensor(float(v)), "0-d int": torch.tensor(int(v)),
           "0-d requires grad": torch.tensor(float(v), dtype=F64, requires_grad=True),
           "(1,) tensor": torch.full((1,), float(v), dtype=F64),
           "numpy array": np.full((4, 1), float(v))}
    if not float(v).is_integer():
        out = {k: a for k, a in out.items() if k not in ("int", "np.int64", "0-d int")}
    return out


def _audit_cases():
    """(id, package call, our call): every argument of every name in the ways the
    package accepts it. Bisection-based package calls get enough steps for float64."""
    x, t = AUDIT_X, AUDIT_T
    cases = []
    for name, v in [("entmax_bisect", 2), ("normmax_bisect", 3), ("budget_bisect", 2)]:
        for kind, val in _real_likes(v).items():
            cases.append((f"{name} param={kind}", lambda n=name, a=val: getattr(pkg, n)(x, a, n_iter=100),
                          lambda n=name, a=val: getattr(attnkern, n)(x, a)))
        for kind, val in _int_likes(1).items():
            cases.append((f"{name} dim={kind}", lambda n=name, d=val, a=v: getattr(pkg, n)(x, a, d, n_iter=100),
                          lambda n=name, d=val, a=v: getattr(attnkern, n)(x, a, d)))
        for kind, val in _int_likes(100).items():
            cases.append((f"{name} n_iter={kind}", lambda n=name, k=val, a=v: getattr(pkg, n)(x, a, n_iter=k),
                          lambda n=name, k=val, a=v: getattr(attnkern, n)(x, a, n_iter=k)))
    for a in (0, -1, -2.5, 0.5):  # α ≤ 0: dense members of the family (α = 0: p_i = 1/(c - x_i))
        cases.append((f"entmax_bisect alpha={a}", lambda a=a: pkg.entmax_bisect(x, a, n_iter=200),
                      lambda a=a: attnkern.entmax_bisect(x, a)))
    for flag in (True, False, 1, 0, np.bool_(True), None, torch.tensor(True)):
        cases.append((f"entmax_bisect ensure_sum_one={flag!r}",
                      lambda f=flag: pkg.entmax_bisect(x, 1.3, -1, 100, f),
                      lambda f=flag: attnkern.entmax_bisect(x, 1.3, -1, 100, f)))
        cases.append((f"sparsemax_bisect ensure_sum_one={flag!r}",
                      lambda f=flag: pkg.sparsemax_bisect(x, -1, 50, f),
                      lambda f=flag: attnkern.sparsemax_bisect(x, -1, 50, f)))
    for kind, val in list(_int_likes(3).items()) + [("0", 0), ("-1", -1), ("None", None), ("50.0", 50.0)]:
        # The package's sparsemax_bisect ignores n_iter.
        cases.append((f"sparsemax_bisect n_iter={kind}", lambda k=val: pkg.sparsemax_bisect(x, -1, k),
                      lambda k=val: attnkern.sparsemax_bisect(x, -1, k)))
    for name in ("sparsemax", "entmax15", "sparsemax_bisect"):
        for kind, val in _int_likes(0).items():
            cases.append((f"{name} dim={kind}", lambda n=name, d=val: getattr(pkg, n)(x, d),
                          lambda n=name, d=val: getattr(attnkern, n)(x, d)))
    for name in ("sparsemax", "entmax15", "sparsemax_loss", "entmax15_loss"):
        for kind, val in list(_int_likes(3).items()) + [("None", None), ("above n", 100)]:
            args = (x, t) if "loss" in name else (x, -1)
            cases.append((f"{name} k={kind}", lambda n=name, k=val, a=args: getattr(pkg, n)(*a, k),
                          lambda n=name, k=val, a=args: getattr(attnkern, n)(*a, k)))
    modules = {"Sparsemax": {}, "Entmax15": {}, "SparsemaxBisect": {}, "EntmaxBisect": {"alpha": 1.3},
               "NormmaxBisect": {"alpha": 3}, "BudgetBisect": {"budget": 3}}
    for name, kw in modules.items():
        for kind, val in _int_likes(0).items():
            cases.append((f"{name}(dim={kind})", lambda n=name, d=val, kw=kw: getattr(pkg, n)(dim=d, **kw)(x),
                          lambda n=name, d=val, kw=kw: getattr(attnkern, n)(dim=d, **kw)(x)))
        for key, v in kw.items():
            for kind, val in _real_likes(v).items():
                cases.append((f"{name}({key}={kind})",
                              lambda n=name, k=key, a=val: getattr(pkg, n)(**{k: a}, n_iter=100)(x),
                              lambda n=name, k=key, a=val: getattr(attnkern, n)(**{k: a})(x)))
        if "Bisect" in name:
            for kind, val in _int_likes(100).items():
                cases.append((f"{name}(n_iter={kind})",
                              lambda n=name, k=val, kw=kw: getattr(pkg, n)(n_iter=k, **kw)(x),
                              lambda n=name, k=val, kw=kw: getattr(attnkern, n)(n_iter=k, **kw)(x)))
    for name, v in [("entmax_bisect_loss", 1.3), ("normmax_bisect_loss", 3)]:
        for kind, val in _real_likes(v).items():
            if kind == "numpy array":
                continue  # the package's loss broadcasts a per-row α to (n, n) (tested below)
            cases.append((f"{name} alpha={kind}", lambda n=name, a=val: getattr(pkg, n)(x, t, a, n_iter=100),
                          lambda n=name, a=val: getattr(attnkern, n)(x, t, a)))
    for a in (-1, -2.5, 0.5):
        cases.append((f"entmax_bisect_loss alpha={a}", lambda a=a: pkg.entmax_bisect_loss(x, t, a, n_iter=200),
                      lambda a=a: attnkern.entmax_bisect_loss(x, t, a)))
    for name in ("sparsemax_bisect_loss", "entmax_bisect_loss", "normmax_bisect_loss"):
        for kind, val in _int_likes(100).items():
            cases.append((f"{name} n_iter={kind}", lambda n=name, k=val: getattr(pkg, n)(x, t, n_iter=k),
                          lambda n=name, k=val: getattr(attnkern, n)(x, t, n_iter=k)))
    loss_modules = {"SparsemaxLoss": {}, "SparsemaxBisectLoss": {}, "Entmax15Loss": {},
                    "EntmaxBisectLoss": {"alpha": 1.3}, "NormmaxBisectLoss": {"alpha": 3}}
    for name, kw in loss_modules.items():
        for red in ("none", "sum", "elementwise_mean"):
            for kind, val in _int_likes(3).items():
                cases.append((f"{name}(ignore_index={kind}, {red})",
                              lambda n=name, i=val, r=red, kw=kw: getattr(pkg, n)(
                                  ignore_index=i, reduction=r, **kw)(x, t),
                              lambda n=name, i=val, r=red, kw=kw: getattr(attnkern, n)(
                                  ignore_index=i, reduction=r, **kw)(x, t)))
        for key, v in kw.items():
            for kind, val in _real_likes(v).items():
                if kind == "numpy array":
                    continue
                cases.append((f"{name}({key}={kind})",
                              lambda n=name, k=key, a=val: getattr(pkg, n)(**{k: a}, n_iter=100)(x, t),
                              lambda n=name, k=key, a=val: getattr(attnkern, n)(**{k: a})(x, t)))
    return cases


AUDIT = _audit_cases()


@pytest.mark.parametrize("case", AUDIT, ids=[c[0] for c in AUDIT])
def test_accepts_what_the_package_accepts(case):
    _, theirs, ours = case
    expected = theirs()
    got = ours()
    assert_close(got, expected.detach(), scale=10.0)


def test_ignore_index_as_a_tensor_element():
    # As users write it: the ignored class taken from the targets themselves.
    x = make_scores((6, 5), F64, seed=41).requires_grad_()
    y = torch.tensor([2, 0, 2, 4, 1, 2])
    for name in MODULES:
        ours = getattr(attnkern, name)(ignore_index=y[0])
        assert ours.ignore_index == 2 and isinstance(ours.ignore_index, int)
        lo = ours(x, y)
        lt = getattr(pkg, name)(ignore_index=y[0])(x, y)
        assert_close(lo, lt, scale=10.0)
        (dx,) = torch.autograd.grad(lo, x)
        assert (dx[y == 2] == 0).all()
    for bad in (2.0, torch.tensor([1, 2]), torch.tensor(2.0), True):
        with pytest.raises(TypeError, match="ignore_index"):
            attnkern.SparsemaxLoss(ignore_index=bad)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_budget_zero_gives_zeros_and_a_gradient(backend, dim):
    x = make_scores((3, 6), F64, seed=42)
    x[1, 4] = x[1].max()  # a tie at the max: the budget's slope splits over it
    g = make_scores((3, 6), F64, seed=43)
    if dim == 0:
        x, g = x.t().contiguous(), g.t().contiguous()
    assert_close(pkg.budget_bisect(x, 0, dim, n_iter=100), torch.zeros_like(x))
    xr = x.clone().requires_grad_()
    row = (3, 1) if dim == -1 else (1, 3)
    b = torch.zeros(row, dtype=F64, requires_grad=True)
    p = attnkern.budget_bisect(xr, b, dim, backend=backend)
    assert torch.equal(p, torch.zeros_like(x))
    dx, db = torch.autograd.grad(p, (xr, b), g)
    assert torch.equal(dx, torch.zeros_like(x))
    # The one-sided slope: finite differences from above.
    h = 1e-7
    fd = (attnkern.budget_bisect(x, torch.full(row, h, dtype=F64), dim) * g).sum(dim, keepdim=True) / h
    assert_close(db, fd, scale=1e3)
    assert gradcheck(lambda xx: attnkern.budget_bisect(xx, 0.0, dim, backend=backend), (xr,))
    # A float 0 and the module.
    assert torch.equal(attnkern.BudgetBisect(budget=0, dim=dim)(x), torch.zeros_like(x))


def test_alpha_nonpositive_gradients():
    # α ≤ 0 (accepted by the package): exact gradients in x and α, as for other α.
    x = _x((3, 6), seed=44)
    alpha = torch.tensor([[0.0], [-1.0], [-3.0]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda xx, a: attnkern.entmax_bisect(xx, a), (x, alpha))
    assert gradcheck(lambda xx, a: attnkern.entmax_bisect(xx, a, backend="reference"), (x, alpha))


def test_loss_with_per_row_alpha_is_per_row():
    # The package broadcasts a (n, 1) α in its loss to (n, n); we give one loss per row.
    x = make_scores((4, 7), F64, seed=45)
    t = torch.tensor([1, 3, 0, 6])
    a = torch.tensor([[1.3], [1.5], [2.0], [2.5]], dtype=F64)
    ours = attnkern.entmax_bisect_loss(x, t, a)
    assert ours.shape == (4,)
    assert pkg.entmax_bisect_loss(x, t, a, n_iter=100).shape == (4, 4)
    for i in range(4):
        assert_close(ours[i], pkg.entmax_bisect_loss(x[i:i + 1], t[i:i + 1], float(a[i]), n_iter=100)[0])


# --- kernels against the pure-torch paths, opcheck ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("budget", [1.0, 2.0, 3.7, 9.5])
def test_budget_kernel_matches_torch_path(dtype, budget):
    x = mask_some(make_scores((9, 13), dtype, scale=1.5, seed=19), frac=0.2, full_rows=1)
    ours = attnkern.budget_bisect(x, budget)
    ref = attnkern.budget_bisect(x, budget, backend="reference")
    assert ours.dtype == dtype
    assert_close(ours, ref, dtype=dtype)
    finite = (x > -math.inf).sum(-1, keepdim=True).to(F64)
    assert_close(ours[1:].to(F64).sum(-1, keepdim=True), torch.minimum(finite[1:], torch.tensor(budget, dtype=F64)),
                 dtype=dtype, scale=10.0)
    base = make_scores((4, 6, 9), F64, seed=20)
    for x3 in (base, base.transpose(0, 2)):
        for dim in range(3):
            assert_close(attnkern.budget_bisect(x3, budget, dim), attnkern.budget_bisect(x3, budget, dim,
                                                                                          backend="reference"))


def test_budget_kernel_ties_and_large_rows():
    x = with_ties((20, 50), F64, seed=21)
    for b in (1.0, 2.0, 4.5):
        p = attnkern.budget_bisect(x, b)
        assert_close(p.sum(-1), torch.full((20,), b, dtype=F64))
        assert_close(p, pkg.budget_bisect(x, b, n_iter=200))
    x = make_scores((3, 5000), torch.float32, scale=3.0, seed=22)
    assert_close(attnkern.budget_bisect(x, 10.0), pkg.budget_bisect(x.double(), 10.0, n_iter=100),
                 dtype=torch.float32, scale=5.0)


def test_normmax_reference_backend():
    x = mask_some(make_scores((6, 11), F64, scale=2.0, seed=23), frac=0.2, full_rows=1)
    for a in (1.5, 2.0, 3.0):
        assert_close(attnkern.normmax_bisect(x, a), attnkern.normmax_bisect(x, a, backend="reference"))


def _loss_by_definition(x, t, alpha):
    """<p, x> - x_t + H_α(p) in float64, with p from attnkern.entmax and 0·(-inf) = 0."""
    x = x.to(F64)
    p = attnkern.entmax(x, alpha)
    xs = torch.where(p > 0, x, torch.zeros_like(x))
    pos = p > 0
    if alpha == 1.0:
        h = -(torch.where(pos, p * torch.log(torch.where(pos, p, torch.ones_like(p))), 0 * p)).sum(-1)
    else:
        h = (1 - torch.where(pos, p, 0 * p).pow(alpha).sum(-1)) / (alpha * (alpha - 1))
    return (p * xs).sum(-1) - x.gather(-1, t[:, None])[:, 0] + h


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0, 3.0, 0.8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_fused_loss_kernel_by_definition(alpha, dtype):
    x = mask_some(make_scores((10, 21), dtype, scale=2.0, seed=24), frac=0.2, full_rows=0)
    t = torch.tensor([int(torch.nonzero(r > -math.inf)[-1]) for r in x])
    xr = x.clone().requires_grad_()
    loss = attnkern.entmax_bisect_loss(xr, t, alpha)
    assert loss.dtype == dtype and torch.isfinite(loss).all()
    assert_close(loss, _loss_by_definition(x, t, alpha), dtype=dtype, scale=4.0)
    (dx,) = torch.autograd.grad(loss.sum(), xr)
    expected = attnkern.entmax(x.to(F64), alpha) - torch.nn.functional.one_hot(t, 21).to(F64)
    assert_close(dx, expected, dtype=dtype)


def test_losses_leading_dims_and_special_rows():
    x = make_scores((2, 3, 7), F64, scale=2.0, seed=25)
    t = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(1))
    flat = attnkern.sparsemax_loss(x.reshape(6, 7), t.reshape(6))
    assert_close(attnkern.sparsemax_loss(x, t), flat.reshape(2, 3))
    x = make_scores((3, 5), F64, seed=26)
    x[0] = -math.inf
    x[1, 2] = math.nan
    loss = attnkern.entmax15_loss(x, torch.tensor([1, 1, 1]))
    assert loss[0] == math.inf and math.isnan(loss[1]) and torch.isfinite(loss[2])


def test_opcheck_new_ops():
    x = make_scores((5, 9), torch.float32, seed=27)
    torch.library.opcheck(torch.ops.attnkern.budget_fwd, (x, torch.tensor(2.0, dtype=F64), -1))
    torch.library.opcheck(torch.ops.attnkern.budget_fwd, (x.t(), torch.tensor(2.0, dtype=F64), 0))
    t = torch.tensor([0, 3, 8, 1, 2])
    torch.library.opcheck(torch.ops.attnkern.entmax_loss_fwd, (x, t, torch.full((5,), 1.5)))
    torch.library.opcheck(torch.ops.attnkern.entmax_loss_fwd, (x.double()[:, ::2], t.clamp_max(4),
                                                               torch.tensor(2.0, dtype=F64)))
    p = attnkern.budget_bisect(x, 2.5)
    g = make_scores((5, 9), torch.float32, seed=32)
    for want in (False, True):
        torch.library.opcheck(torch.ops.attnkern.budget_bwd, (p, g, -1, want))
        torch.library.opcheck(torch.ops.attnkern.budget_bwd, (p.t(), g.t(), 0, want))
    p = attnkern.normmax_bisect(x, 2.0)
    torch.library.opcheck(torch.ops.attnkern.normmax_bwd, (p, g, torch.tensor(2.0, dtype=F64), -1))
    torch.library.opcheck(torch.ops.attnkern.normmax_bwd, (p.t(), g.t(), torch.full((1, 5), 3.0), 0))


def test_entmax_loss_alpha_gradient_at_one():
    x = make_scores((4, 9), F64, scale=2.0, seed=29)
    t = torch.tensor([0, 3, 8, 2])
    alpha = torch.ones(4, 1, dtype=F64, requires_grad=True)
    (da,) = torch.autograd.grad(attnkern.entmax_bisect_loss(x, t, alpha).sum(), alpha)
    h = 1e-4
    fd = (attnkern.entmax_bisect_loss(x, t, 1 + h) - attnkern.entmax_bisect_loss(x, t, 1 - h)) / (2 * h)
    torch.testing.assert_close(da[:, 0], fd, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_normmax_kernel_backward_matches_autograd_path(dtype):
    # A fixed α takes normmax_bwd; an α that requires grad takes autograd
    # through the entmax kernels. Their x-gradients must agree.
    x = mask_some(make_scores((6, 40), dtype, scale=2.0, seed=30), frac=0.2, full_rows=1)
    g = make_scores((6, 40), dtype, seed=31)
    for a in (1.3, 2.0, 3.0):
        x1 = x.clone().requires_grad_()
        (d1,) = torch.autograd.grad(attnkern.normmax_bisect(x1, a), x1, g)
        x2 = x.clone().requires_grad_()
        alpha = torch.tensor(a, dtype=dtype, requires_grad=True)
        (d2, _) = torch.autograd.grad(attnkern.normmax_bisect(x2, alpha), (x2, alpha), g)
        assert not torch.isnan(d1).any() and (d1[0] == 0).all()
        assert_close(d1, d2, dtype=dtype, scale=10.0 if a > 2 else 1.0)
