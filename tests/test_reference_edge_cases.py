"""Edge cases of the float64 reference backend against the compiled kernels (0-d
inputs, rows and batches of size 0, attention without keys, α far below 1), and
the factory kwargs (device, dtype) of the modules with a learnable α."""

from __future__ import annotations

import math

import pytest
import torch

import attnkern
from attnkern.backends import reference as ref
from attnkern.nn import AdditiveAttention, EntmaxAlpha, LuongAttention, MultiheadAttention, ScaledDotAttention

# name -> f(x, alpha, dim, backend); alpha is None for the normalizers without one.
FUNCS = {
    "softmax": lambda x, a, d, backend: attnkern.softmax(x, d, backend=backend),
    "sparsemax": lambda x, a, d, backend: attnkern.sparsemax(x, d, backend=backend),
    "entmax15": lambda x, a, d, backend: attnkern.entmax15(x, d, backend=backend),
    "entmax": lambda x, a, d, backend: attnkern.entmax(x, a, d, backend=backend),
    "entmax_bisect": lambda x, a, d, backend: attnkern.entmax_bisect(x, a, d, backend=backend),
    "budget_bisect": lambda x, a, d, backend: attnkern.budget_bisect(x, a, d, backend=backend),
}
# (name, α): α-entmax with a float α, and with a tensor α that requires grad.
CASES = [("softmax", None), ("sparsemax", None), ("entmax15", None), ("entmax", 1.3), ("entmax", 0.5),
         ("entmax", "tensor"), ("entmax_bisect", 1.5), ("entmax_bisect", -3.0), ("budget_bisect", 2.0)]
CASE_IDS = [f"{n}-{a}" for n, a in CASES]


def _run(name, alpha, x, row_shape, backend):
    """(output, grad of x, grad of α or None) of one call, with a fixed output gradient."""
    x = x.detach().clone().requires_grad_(True)
    a = alpha
    if alpha == "tensor":
        a = torch.full(row_shape, 1.3, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                       requires_grad=True)
    p = FUNCS[name](x, a, -1, backend)
    g = torch.linspace(-1, 1, p.numel(), dtype=p.dtype).reshape(p.shape)
    grads = torch.autograd.grad((p * g).sum(), [x] + ([a] if alpha == "tensor" else []), allow_unused=True)
    return p, grads[0], grads[1] if alpha == "tensor" else None


def _same(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=1e-12)  # one entry or none per row: no rounding


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_zero_dim_input_is_one_row_of_one_entry(name, alpha, dtype):
    x = torch.tensor(0.5, dtype=dtype)
    got, want = _run(name, alpha, x, (), "reference"), _run(name, alpha, x, (), "auto")
    assert got[0].shape == () and got[0].item() == 1.0
    for g, w in zip(got, want, strict=True):
        if w is not None:
            _same(g, w)


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", [(3, 0), (0, 4), (2, 0, 5), (0,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_zero_size_input_gives_empty_output_and_gradients(name, alpha, shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    row_shape = shape[:-1] + (1,)
    got, want = _run(name, alpha, x, row_shape, "reference"), _run(name, alpha, x, row_shape, "auto")
    assert got[0].shape == x.shape and got[0].dtype == dtype
    for g, w in zip(got, want, strict=True):
        if w is not None:
            _same(g, w)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_zero_length_rows_with_a_budget_tensor(backend):
    x = torch.randn(3, 0, requires_grad=True)
    budget = torch.full((3, 1), 2.0, requires_grad=True)
    p = attnkern.budget_bisect(x, budget, backend=backend)
    assert p.shape == x.shape and p.dtype == x.dtype
    p.sum().backward()
    assert x.grad.shape == x.shape and budget.grad is not None and not budget.grad.any()


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", "entmax"])
def test_attention_without_keys_through_the_reference(normalizer):
    # A mask that requires grad sends the call to the reference; with S = 0
    # every query has no key, and the output is 0 (as SDPA's and the kernels').
    q = torch.randn(1, 1, 3, 4, requires_grad=True)
    k = torch.randn(1, 1, 0, 4, requires_grad=True)
    v = torch.randn(1, 1, 0, 4, requires_grad=True)
    mask = torch.zeros(3, 0, requires_grad=True)
    alpha = torch.tensor([1.3], requires_grad=True) if normalizer == "entmax" else None
    out = attnkern.attention(q, k, v, attn_mask=mask, normalizer=normalizer, alpha=alpha)
    kernels = attnkern.attention(q.detach(), k.detach(), v.detach(), attn_mask=mask.detach(), normalizer=normalizer,
                                 alpha=None if alpha is None else alpha.detach())
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    _same(out.detach(), kernels)
    _same(out.detach(), sdpa)
    out.sum().backward()
    assert q.grad.shape == q.shape and not q.grad.any()
    assert k.grad.shape == k.shape and v.grad.shape == v.shape and mask.grad.shape == mask.shape
    if alpha is not None:
        assert alpha.grad is not None and not alpha.grad.any()


# log(float64 max): beyond this β·ln(n), with β = 1 - α, the shift c of the
# shifted form reaches (n^β - 1)/β (equal scores) and overflows float64.
_LOG_MAX = math.log(torch.finfo(torch.float64).max)


@pytest.mark.parametrize("alpha", [-2000.0, -1000.0, -500.0, -200.0, -100.0, -50.0, -10.0, -1.0, 0.0, 0.5])
def test_alpha_far_below_one_sums_to_one_and_matches_the_kernel(alpha):
    beta = 1.0 - alpha
    for n in (1, 2, 5, 30, 200, 1000):
        g = torch.Generator().manual_seed(n)
        x = 3 * torch.randn(4, n, dtype=torch.float64, generator=g)
        if n > 2:
            x[1, 0] = x[2, 1] = -math.inf  # masked entries, as attention masks give
        p = ref.entmax(x, alpha)
        torch.testing.assert_close(p.sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-14, rtol=0)
        kernel = attnkern.entmax(x, alpha, backend="auto")
        # The reference and the kernel in float64 at these edges: to rounding, far below the rule.
        torch.testing.assert_close(p, kernel, atol=1e-14, rtol=1e-13, msg=lambda m, n=n: f"n={n}: {m}")
        if beta * math.log(n) >= _LOG_MAX - 1:
            # The ratio p_i / p_j differs from 1 by about β |x_i - x_j| / n^β,
            # far below float64's resolution: p is uniform over the finite
            # entries (the kernels write that once n^β overflows; before, their
            # search was off by up to ~1e-3 there).
            finite = torch.isfinite(x).to(torch.float64)
            torch.testing.assert_close(p, finite / finite.sum(-1, keepdim=True), atol=1e-15, rtol=1e-15,
                                       msg=lambda m, n=n: f"n={n}: {m}")
            # A uniform row: float32's rounding of 1/n.
            torch.testing.assert_close(attnkern.entmax(x.float(), alpha), kernel.float(), atol=1e-7, rtol=0)


@pytest.mark.parametrize("alpha", [-100.0, -3.0, 0.25])
def test_alpha_far_below_one_backward_matches_the_kernel(alpha):
    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    a = torch.full((3, 1), alpha, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 40, dtype=torch.float64)
    got = torch.autograd.grad((ref.entmax(x, a) * w).sum(), (x, a))
    want = torch.autograd.grad((attnkern.entmax(x, a, backend="auto") * w).sum(), (x, a))
    for u, v in zip(got, want, strict=True):
        torch.testing.assert_close(u, v, atol=1e-14, rtol=1e-10)  # float64 reference and kernel: to rounding


def test_rows_above_and_below_alpha_one_in_one_call():
    # One call with rows on both sides of α = 1 (each solved in its own form)
    # equals the rows computed alone, values and first and second derivatives.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.tensor([[-1500.0], [-2.0], [0.6], [1.0], [1.7]], dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, dtype=torch.float64, generator=g)

    def derivatives(rows):
        p = ref.entmax(x[rows], a[rows])
        gx, ga = torch.autograd.grad((p * w[rows]).sum(), (x, a), create_graph=True)
        (hx,) = torch.autograd.grad((gx * w).sum() + ga.sum(), (x,))
        return p.detach(), gx.detach()[rows], ga.detach()[rows], hx[rows]

    together = derivatives(slice(None))
    alone = [derivatives(slice(i, i + 1)) for i in range(5)]
    for i, parts in enumerate(zip(*alone, strict=True)):
        torch.testing.assert_close(together[i], torch.cat(parts), atol=1e-15, rtol=1e-12)
    inputs = (x[1:3].detach().requires_grad_(True), a[1:3].detach().requires_grad_(True))
    assert torch.autograd.gradgradcheck(lambda x, a: ref.entmax(x, a), inputs, eps=1e-6, atol=1e-5)


# --- factory kwargs of the modules with a learnable α ------------------------------------------------

MODULES = {
    "EntmaxAlpha": lambda **kw: EntmaxAlpha(2, 1.4, **kw),
    "MultiheadAttention": lambda **kw: MultiheadAttention(8, 2, normalizer="entmax", alpha="learnable", **kw),
    "LuongAttention-general": lambda **kw: LuongAttention(4, 6, normalizer="entmax", alpha="learnable", **kw),
    "LuongAttention-dot": lambda **kw: LuongAttention(4, 4, kind="dot", normalizer="entmax", alpha="learnable",
                                                      **kw),
    "AdditiveAttention": lambda **kw: AdditiveAttention(4, 6, 5, normalizer="entmax", alpha="learnable", **kw),
    "ScaledDotAttention": lambda **kw: ScaledDotAttention(4, 4, normalizer="entmax", alpha="learnable", **kw),
}


def _theta(module) -> torch.Tensor:
    return module.theta if isinstance(module, EntmaxAlpha) else (
        module.entmax_alpha.theta if isinstance(module, MultiheadAttention) else module.alpha_theta)


def _forward(module, dtype):
    """A forward (and backward) in `dtype`; returns the gradient of θ."""
    g = torch.Generator().manual_seed(0)
    if isinstance(module, EntmaxAlpha):
        out = module(torch.randn(3, 2, 5, generator=g).to(dtype))
    elif isinstance(module, MultiheadAttention):
        x = torch.randn(3, 2, 8, generator=g).to(dtype)
        out = module(x, x, x)[0]
    else:
        query = torch.randn(2, module.query_dim, generator=g).to(dtype)
        out = module(query, torch.randn(2, 5, module.key_dim, generator=g).to(dtype))[0]
    assert out.dtype == dtype
    (grad,) = torch.autograd.grad(out.float().pow(2).sum(), _theta(module))
    return grad


@pytest.mark.parametrize("name", list(MODULES))
def test_learnable_alpha_follows_device_and_dtype(name):
    module = MODULES[name](device="meta", dtype=torch.float64)
    for pname, param in module.named_parameters():
        assert param.device.type == "meta" and param.dtype == torch.float64, pname
    assert _theta(module).shape == ((2,) if name in ("EntmaxAlpha", "MultiheadAttention") else ())


@pytest.mark.parametrize("name", list(MODULES))
def test_learnable_alpha_keeps_float32_for_half_dtypes(name):
    # θ stays float32 under a half dtype: α is used in float32 by every
    # consumer, and a half-precision θ would round away small updates.
    module = MODULES[name](dtype=torch.bfloat16)
    assert _theta(module).dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for n, p in module.named_parameters() if p is not _theta(module)), name
    assert _forward(module, torch.bfloat16).dtype == torch.float32
    alpha = 1.4 if name == "EntmaxAlpha" else 1.5
    torch.testing.assert_close(1 + torch.sigmoid(_theta(module)), torch.full_like(_theta(module), alpha))


@pytest.mark.parametrize("name", list(MODULES))
def test_learnable_alpha_module_forward_after_to(name):
    module = MODULES[name](dtype=torch.float64)
    assert _forward(module, torch.float64).dtype == torch.float64
    module.to(torch.float32)
    assert _theta(module).dtype == torch.float32
    assert _forward(module, torch.float32).dtype == torch.float32


def test_learnable_alpha_rejects_a_non_float_dtype():
    with pytest.raises(TypeError, match="floating-point"):
        EntmaxAlpha(2, 1.4, dtype=torch.int64)


def test_learnable_alpha_reset_after_to_empty():
    # Built on the meta device, then materialized: _reset_parameters (as
    # torch's module) sets θ back to alpha_init, as every other parameter.
    m = attnkern.nn.MultiheadAttention(8, 2, normalizer="entmax", alpha="learnable", alpha_init=1.25,
                                       device="meta")
    m = m.to_empty(device="cpu")
    m._reset_parameters()
    torch.testing.assert_close(m.entmax_alpha.alpha, torch.full((2,), 1.25))
