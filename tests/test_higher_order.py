"""Autograd beyond the first derivative: double backward (e.g. a gradient
penalty), forward-mode AD and torch.func.vmap over the row-wise normalizers,
the entmax-compatibility functions and the losses, against the reference
backend (plain differentiable PyTorch) and finite differences. The fused
attention refuses the first two and torch.func transforms with an error naming
it, never a silent wrong answer."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf
from helpers import alpha_per_row
from torch.autograd import gradcheck, gradgradcheck

import attnkern
from attnkern.backends import reference
from attnkern.testing import assert_close, make_scores, mask_some

F64 = torch.float64


# name -> (ours(x, param, dim), reference(x, param, dim), param or None)
OPS = {
    "softmax": (lambda x, a, d: attnkern.softmax(x, d), lambda x, a, d: reference.softmax(x, d), None),
    "sparsemax": (lambda x, a, d: attnkern.sparsemax(x, d), lambda x, a, d: reference.sparsemax(x, d), None),
    "entmax15": (lambda x, a, d: attnkern.entmax15(x, d), lambda x, a, d: reference.entmax15(x, d), None),
    "entmax(alpha)": (lambda x, a, d: attnkern.entmax(x, a, d), lambda x, a, d: reference.entmax(x, a, d),
                      alpha_per_row((1.3, 2.5, 0.7))),
    "entmax(1.7)": (lambda x, a, d: attnkern.entmax(x, 1.7, d), lambda x, a, d: reference.entmax(x, 1.7, d), None),
    "normmax_bisect(2.5)": (lambda x, a, d: attnkern.normmax_bisect(x, 2.5, d),
                            lambda x, a, d: attnkern.normmax_bisect(x, 2.5, d, backend="reference"), None),
    "budget_bisect(budget)": (lambda x, a, d: attnkern.budget_bisect(x, a, d),
                              lambda x, a, d: attnkern.budget_bisect(x, a, d, backend="reference"),
                              torch.tensor([[1.5], [2.0], [0.0]], dtype=F64)),
}


def _x(seed=0, shape=(3, 7)):
    return make_scores(shape, F64, scale=1.5, seed=seed)


# --- double backward ------------------------------------------------------------------------------


def test_issue_example_double_backward_is_not_zero():
    # g1 = ∂/∂x Σ (entmax15(x)·w)², then ∂/∂x Σ g1·w: all zeros before, ±0.0477 in the reference.
    x = _x(1, (2, 6)).requires_grad_()
    w = make_scores((2, 6), F64, seed=2)
    results = []
    for fn in (attnkern.entmax15, lambda t: reference.entmax15(t, -1)):
        (g1,) = torch.autograd.grad(((fn(x) * w) ** 2).sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * w).sum(), x)
        results.append(g2)
    assert results[1].abs().max() > 1e-2
    assert_close(results[0], results[1])


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dim", [-1, 0])
def test_double_backward_matches_reference(name, dim):
    ours, ref, param = OPS[name]
    x = _x(3)
    w = make_scores(x.shape, F64, seed=4)
    if dim == 0:
        x, w = x.t().contiguous(), w.t().contiguous()
        param = None if param is None else param.t().contiguous()
    outs = []
    for fn in (ours, ref):
        xr = x.clone().requires_grad_()
        inputs = [xr]
        pr = None
        if param is not None:
            pr = param.clone().requires_grad_()
            inputs.append(pr)
        g = torch.autograd.grad(((fn(xr, pr, dim) * w) ** 2).sum(), inputs, create_graph=True)
        penalty = sum((gi * gi).sum() for gi in g)  # a gradient penalty
        outs.append(torch.autograd.grad(penalty, inputs))
    for a, b in zip(*outs, strict=True):
        assert_close(a, b, scale=100.0, msg=name)


@pytest.mark.parametrize("name", list(OPS))
def test_gradgradcheck(name):
    ours, _, param = OPS[name]
    x = _x(5).requires_grad_()
    if param is None:
        assert gradgradcheck(lambda t: ours(t, None, -1), (x,))
    elif name == "budget_bisect(budget)":  # budget 0 is one-sided: no finite differences in the budget
        assert gradgradcheck(lambda t: ours(t, param, -1), (x,))
    else:
        assert gradgradcheck(lambda t, a: ours(t, a, -1), (x, param.clone().requires_grad_()))


def test_gradgradcheck_alpha_near_one_and_masks():
    x = mask_some(_x(6, (4, 9)), frac=0.3, full_rows=1).requires_grad_()
    alpha = torch.tensor([[1.5], [1.01], [2.7], [1.2]], dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda t, a: attnkern.entmax(t, a), (x, alpha))
    assert gradgradcheck(lambda t: attnkern.entmax15(t), (x,))


def _alpha_double_backward(fn, alpha: float):
    x = make_scores((3, 9), F64, scale=1.5, seed=25)
    w = make_scores((3, 9), F64, seed=26)
    xr = x.clone().requires_grad_()
    ar = torch.full((3, 1), alpha, dtype=F64, requires_grad=True)
    gx, ga = torch.autograd.grad((fn(xr, ar) * w).sum(), (xr, ar), create_graph=True)
    return torch.autograd.grad((gx * gx).sum() + ga.sum(), (xr, ar))


@pytest.mark.parametrize("alpha", [1 - 1e-3, 1 + 1e-3, 1 - 1e-4, 1 + 1e-4])
def test_double_backward_alpha_near_one_matches_reference(alpha):
    # Closer to α = 1 than finite differences can resolve the second derivative. The closed
    # form of ∂p/∂α cancels as 1/b² (b = α - 1), its α-derivative as 1/b³: ~1e-4 relative at
    # b = 1e-4 in float64, and which ulps the kernel's p has (its instruction set) decided
    # whether it passed. The cancellation-free form near 1 agrees with the reference to ~1e-7.
    ours = _alpha_double_backward(attnkern.entmax, alpha)
    ref = _alpha_double_backward(lambda t, a: reference.entmax(t, a, -1), alpha)
    assert_close(ours[0], ref[0], scale=100.0)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-5, rtol=1e-5)  # dα: the cancellation above, not the rule


def test_double_backward_alpha_smooth_through_one():
    # At α = 1 exactly (the softmax limit) the second derivative in α is the midpoint of its
    # values at 1 ± 1e-4 up to O(b²): the α-curvature is modelled through the limit.
    at_one = _alpha_double_backward(attnkern.entmax, 1.0)
    lo, hi = (_alpha_double_backward(attnkern.entmax, 1 + s * 1e-4) for s in (-1, 1))
    for k in range(2):
        torch.testing.assert_close(at_one[k], (lo[k] + hi[k]) / 2, atol=1e-6, rtol=1e-6)


LOSSES = [("sparsemax_loss", {}), ("entmax15_loss", {}), ("entmax_bisect_loss", dict(alpha=1.3)),
          ("entmax_bisect_loss", dict(alpha=1.0)), ("normmax_bisect_loss", dict(alpha=2.5))]


@pytest.mark.parametrize("name,kwargs", LOSSES, ids=[f"{n}{k.get('alpha', '')}" for n, k in LOSSES])
def test_loss_double_backward(name, kwargs):
    x = _x(7, (4, 6)).requires_grad_()
    t = torch.tensor([0, 5, 2, 2])
    assert gradgradcheck(lambda z: getattr(attnkern, name)(z, t, **kwargs), (x,))
    # The loss Hessian is the normalizer's Jacobian: ∂²L/∂x² v = J v.
    fn = getattr(attnkern, name)
    (g,) = torch.autograd.grad(fn(x, t, **kwargs).sum(), x, create_graph=True)
    v = make_scores((4, 6), F64, seed=8)
    (hv,) = torch.autograd.grad((g * v).sum(), x)
    p_fn = {"sparsemax_loss": lambda z: reference.sparsemax(z, -1),
            "entmax15_loss": lambda z: reference.entmax15(z, -1),
            "entmax_bisect_loss": lambda z: reference.entmax(z, kwargs.get("alpha"), -1),
            "normmax_bisect_loss": lambda z: attnkern.normmax_bisect(z, 2.5, backend="reference")}[name]
    _, jv = tf.jvp(p_fn, (x.detach(),), (v,))
    assert_close(hv, jv, scale=100.0)


@pytest.mark.parametrize("name", ["entmax_bisect_loss", "normmax_bisect_loss"])
def test_loss_double_backward_in_alpha(name):
    x = _x(9, (3, 6)).requires_grad_()
    t = torch.tensor([1, 4, 0])
    alpha = torch.tensor([[1.4], [2.0], [2.7]], dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda z, a: getattr(attnkern, name)(z, t, a), (x, alpha))


# --- forward mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPS))
def test_forward_mode_matches_reference(name):
    ours, ref, param = OPS[name]
    x = _x(10)
    v = make_scores(x.shape, F64, seed=11)
    primals, tangents = (x,), (v,)
    if param is not None and name != "budget_bisect(budget)":
        primals, tangents = (x, param), (v, make_scores(param.shape, F64, seed=12))
    if len(primals) == 1:
        def f_ours(t):
            return ours(t, param, -1)

        def f_ref(t):
            return ref(t, param, -1)
    else:
        def f_ours(t, a):
            return ours(t, a, -1)

        def f_ref(t, a):
            return ref(t, a, -1)
    _, t_ours = tf.jvp(f_ours, primals, tangents)
    _, t_ref = tf.jvp(f_ref, primals, tangents)
    assert_close(t_ours, t_ref, scale=100.0, msg=name)
    # The same through torch.autograd.forward_ad (dual tensors).
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        t_dual = fwAD.unpack_dual(f_ours(*duals)).tangent
    assert_close(t_dual, t_ref, scale=100.0, msg=name)
    # jacfwd and jacrev agree.
    xs = x[0]
    assert_close(tf.jacfwd(lambda t: ours(t, None if param is None else param[0], -1))(xs),
                 tf.jacrev(lambda t: ours(t, None if param is None else param[0], -1))(xs), scale=100.0)


def test_forward_mode_budget_tangent():
    x = _x(13)
    b = torch.tensor([[1.5], [2.0], [0.0]], dtype=F64)
    bt = torch.tensor([[0.3], [-1.0], [2.0]], dtype=F64)
    _, t = tf.jvp(lambda bb: attnkern.budget_bisect(x, bb), (b,), (bt,))
    h = 1e-6
    fd = (attnkern.budget_bisect(x, b + h * bt) - attnkern.budget_bisect(x, b)) / h  # one-sided at budget 0
    assert_close(t, fd, scale=1e4)


@pytest.mark.parametrize("name,kwargs", LOSSES, ids=[f"{n}{k.get('alpha', '')}" for n, k in LOSSES])
def test_loss_forward_mode(name, kwargs):
    x = _x(14, (4, 6))
    t = torch.tensor([0, 5, 2, 2])
    v = make_scores((4, 6), F64, seed=15)
    fn = getattr(attnkern, name)
    _, lt = tf.jvp(lambda z: fn(z, t, **kwargs), (x,), (v,))
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(xr, t, **kwargs).sum(), xr)
    assert_close(lt, (g * v).sum(-1))
    if "alpha" in kwargs:
        a = torch.full((4, 1), kwargs["alpha"], dtype=F64)
        at = make_scores((4, 1), F64, seed=16)
        _, la = tf.jvp(lambda aa: fn(x, t, aa), (a,), (at,))
        ar = a.clone().requires_grad_()
        (ga,) = torch.autograd.grad(fn(x, t, ar).sum(), ar)
        assert_close(la, ga[:, 0] * at[:, 0])


# --- vmap -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_vmap_matches_loop(name, dim):
    ours, _, param = OPS[name]
    xb = make_scores((4, 3, 7), F64, scale=1.5, seed=17)
    p = param if dim != 0 or param is None else param.flatten()[0]  # one value for every column
    expected = torch.stack([ours(xb[i], p, dim) for i in range(4)])
    assert_close(tf.vmap(lambda t: ours(t, p, dim))(xb), expected, msg=name)
    if param is not None and dim == -1:  # a per-sample parameter, vmapped too
        pb = torch.stack([param * (1 + 0.1 * i) for i in range(4)])
        expected = torch.stack([ours(xb[i], pb[i], -1) for i in range(4)])
        assert_close(tf.vmap(lambda t, a: ours(t, a, -1))(xb, pb), expected, msg=name)
        # only the parameter vmapped
        expected = torch.stack([ours(xb[0], pb[i], -1) for i in range(4)])
        assert_close(tf.vmap(lambda a: ours(xb[0], a, -1))(pb), expected, msg=name)


def test_vmap_in_dims_and_per_sample_gradients():
    xb = make_scores((3, 5, 4), F64, seed=18)
    assert_close(tf.vmap(attnkern.entmax15, in_dims=1)(xb), attnkern.entmax15(xb.transpose(0, 1)))
    w = torch.arange(4, dtype=F64)
    grads = tf.vmap(tf.grad(lambda t: (attnkern.sparsemax(t) * w).sum()))(xb)
    for i in range(3):
        xi = xb[i].clone().requires_grad_()
        (gi,) = torch.autograd.grad((attnkern.sparsemax(xi) * w).sum(), xi)
        assert_close(grads[i], gi)
    # jacrev over vmap of a 0-d input per sample (a row of one)
    assert_close(tf.vmap(attnkern.softmax)(torch.randn(5, dtype=F64)), torch.ones(5, dtype=F64))


@pytest.mark.parametrize("name,kwargs", LOSSES, ids=[f"{n}{k.get('alpha', '')}" for n, k in LOSSES])
def test_loss_vmap(name, kwargs):
    xb = make_scores((3, 4, 6), F64, seed=19)
    tb = torch.randint(0, 6, (3, 4), generator=torch.Generator().manual_seed(2))
    fn = getattr(attnkern, name)
    expected = torch.stack([fn(xb[i], tb[i], **kwargs) for i in range(3)])
    assert_close(tf.vmap(lambda z, t: fn(z, t, **kwargs))(xb, tb), expected)
    module = attnkern.SparsemaxLoss(reduction="sum")
    assert_close(tf.vmap(module)(xb, tb), torch.stack([module(xb[i], tb[i]) for i in range(3)]))


def test_torch_compile_fullgraph_with_the_new_rules():
    # Dynamo cannot trace Functions that define jvp: compiled code takes copies without it.
    x = make_scores((6, 10), torch.float32, seed=27).requires_grad_()
    t = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(3))
    a = torch.full((6, 1), 1.3, requires_grad=True)

    def f(x, a):
        return (attnkern.entmax_bisect_loss(x, t, a).sum() + attnkern.sparsemax_loss(x, t).sum()
                + (attnkern.budget_bisect(x, 2.0) * x).sum() + (attnkern.normmax_bisect(x, 2.0) ** 2).sum()
                + (attnkern.entmax(x, a) * x).sum())

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(x, a), (x, a))
    for got, want in zip(grads, torch.autograd.grad(f(x, a), (x, a)), strict=True):
        torch.testing.assert_close(got, want)


# --- the fused attention ------------------------------------------------------------------------------


def _qkv():
    q = make_scores((1, 2, 4, 8), F64, seed=20)
    k = make_scores((1, 2, 5, 8), F64, seed=21)
    v = make_scores((1, 2, 5, 8), F64, seed=22)
    return q, k, v


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_attention_refuses_double_backward_by_name(normalizer):
    q, k, v = _qkv()
    q = q.requires_grad_()
    out = attnkern.attention(q, k, v, normalizer=normalizer)
    with pytest.raises(RuntimeError, match=r"attnkern\.attention: double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    # First order is unchanged, and the reference backend gives the second derivative.
    (g,) = torch.autograd.grad(attnkern.attention(q, k, v, normalizer=normalizer).square().sum(), q)
    qr = q.detach().requires_grad_()
    (g1,) = torch.autograd.grad(attnkern.attention(qr, k, v, normalizer=normalizer, backend="reference")
                                .square().sum(), qr, create_graph=True)
    assert_close(g, g1.detach())
    assert torch.autograd.grad(g1.sum(), qr)[0].abs().max() > 0


def test_attention_refuses_forward_mode_and_transforms_by_name():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"attnkern\.attention: forward-mode AD"):
        with fwAD.dual_level():
            attnkern.attention(fwAD.make_dual(q, torch.ones_like(q)), k, v, normalizer="sparsemax")
    with pytest.raises(RuntimeError, match=r"attnkern\.attention: torch\.func"):
        tf.jvp(lambda t: attnkern.attention(t, k, v, normalizer="sparsemax"), (q,), (torch.ones_like(q),))
    with pytest.raises(RuntimeError, match=r"attnkern\.attention: torch\.func"):
        tf.vmap(lambda t: attnkern.attention(t, k, v))(q.expand(3, -1, -1, -1, -1))
    # The reference backend is plain PyTorch: all of these work there.
    _, t = tf.jvp(lambda t: attnkern.attention(t, k, v, normalizer="sparsemax", backend="reference"), (q,),
                  (torch.ones_like(q),))
    assert torch.isfinite(t).all()


def test_first_order_unchanged():
    # The create_graph path and the kernel path give the same first derivatives.
    x = _x(23, (5, 9)).requires_grad_()
    alpha = torch.tensor([[1.2], [1.5], [2.0], [3.0], [0.8]], dtype=F64, requires_grad=True)
    w = make_scores((5, 9), F64, seed=24)
    plain = torch.autograd.grad((attnkern.entmax(x, alpha) * w).sum(), (x, alpha))
    graph = torch.autograd.grad((attnkern.entmax(x, alpha) * w).sum(), (x, alpha), create_graph=True)
    for a, b in zip(plain, graph, strict=True):
        assert_close(a, b.detach())
    assert gradcheck(lambda t, a: attnkern.entmax(t, a), (x, alpha))
