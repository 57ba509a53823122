"""Dropout inside the fused attention kernels (CPU and Triton): the mask they
apply, exactly (against the reference run with that mask) and statistically
(keep rate, scaling, unbiased output), reproducibility with torch.manual_seed,
and torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import alpha_for, make_qkv, require_backend

import attnkern
from attnkern import _extension
from attnkern.attention import draw_dropout_seed
from attnkern.backends import reference
from attnkern.testing import attention_dropout_mask, tolerance

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

BACKENDS = ["cpu", "triton"]
CASES = [("softmax", None), ("sparsemax", None), ("entmax15", None), ("entmax", (1.25, 1.0 + 2.0**-13)),
         ("entmax", 2.5)]
CASE_IDS = ["softmax", "sparsemax", "entmax15", "entmax-per-head", "entmax2.5"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalizer,alpha", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("masking", ["none", "causal", "padding"])
def test_kernel_applies_its_mask_exactly(backend, normalizer, alpha, masking):
    """Output and gradients equal the float64 reference run with the keep mask
    that attnkern.testing.attention_dropout_mask returns for the call's seed."""
    require_backend(backend)
    B, H, L, S, E, p = 2, 2, 37, 45 if masking != "causal" else 37, 16, 0.3
    dtype = torch.float64 if backend == "cpu" else torch.float32
    q, k, v, go = make_qkv(B, H, H, L, S, E, E, dtype, grad_out=True)
    attn_mask = None
    if masking == "padding":
        attn_mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        attn_mask[1, ..., S - 9:] = False
    # α per head from a tuple; a float α (or None) as it is.
    a = alpha_for(normalizer, H, alpha, requires_grad=True, dtype=dtype) if isinstance(alpha, tuple) else alpha
    qk = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out = attnkern.attention(*qk, attn_mask=attn_mask, dropout_p=p, is_causal=masking == "causal",
                             normalizer=normalizer, alpha=a, backend=backend)
    grads = torch.autograd.grad(out, qk + ([a] if isinstance(a, torch.Tensor) else []), go)
    torch.manual_seed(11)
    keep = attention_dropout_mask(B, H, L, S, p, draw_dropout_seed())
    assert 0.6 < keep.float().mean() < 0.8
    qr = [t.double().requires_grad_() for t in (q, k, v)]
    ar = a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) else a
    ref = reference.attention(*qr, attn_mask=attn_mask, is_causal=masking == "causal", normalizer=normalizer,
                              alpha=ar.view(H, 1, 1) if isinstance(ar, torch.Tensor) else ar, dropout_p=p,
                              dropout_mask=keep)
    rgrads = torch.autograd.grad(ref, qr + ([ar] if isinstance(ar, torch.Tensor) else []), go.double())
    # One bound for the output and the gradients: the forward rule in float64 (the CPU
    # kernel), twice the gradient rule in float32 (the Triton kernel).
    tol = (tolerance(dtype, "attention", "forward") if dtype == torch.float64
           else tolerance(dtype, "attention", "gradient", scale=2.0))
    if alpha == 2.5:  # infinite slope at the support's edge (tests/test_attention.py)
        tol = {key: val * 100 for key, val in tol.items()}
    torch.testing.assert_close(out.double(), ref, **tol)
    for name, mine, theirs in zip(["dq", "dk", "dv", "dalpha"][:len(grads)], grads, rgrads, strict=True):
        torch.testing.assert_close(mine.double(), theirs, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_mask_statistics():
    """Keep rate 1 - p over many weights; scaling 1 / (1 - p) keeps the output unbiased."""
    B, H, L, S, p = 1, 4, 256, 300, 0.3
    keep = attention_dropout_mask(B, H, L, S, p, torch.tensor(12345))
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    # No structure along keys or rows: the rate per key column and per row stays near 1 - p.
    assert (keep.float().mean((0, 1, 2)) - (1 - p)).abs().max() < 0.15
    assert (keep.float().mean(-1) - (1 - p)).abs().max() < 0.15
    # Different seeds give different masks; dropout_p = 0 keeps everything.
    assert not torch.equal(keep, attention_dropout_mask(B, H, L, S, p, torch.tensor(12346)))
    assert attention_dropout_mask(1, 1, 3, 5, 0.0, torch.tensor(1)).all()
    # With v = 1 every output entry is Σ_j p_j keep_j / (1 - p): mean 1 over rows.
    q, k, _, _ = make_qkv(1, H, H, L, S, 16, 16, torch.float32, grad_out=True)
    ones = torch.ones(1, H, S, 8)
    for normalizer in ("softmax", "sparsemax"):
        out = attnkern.attention(q, k, ones, dropout_p=p, normalizer=normalizer, backend="cpu")
        assert abs(out[..., 0].mean().item() - 1.0) < 0.02, normalizer


def test_reproducible_with_manual_seed():
    q, k, v, _ = make_qkv(1, 2, 2, 33, 40, 8, 8, torch.float32, grad_out=True)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(attnkern.attention(q, k, v, dropout_p=0.2, backend="cpu"))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_triton_draws_the_cpu_mask(normalizer):
    require_backend("triton")
    q, k, v, _ = make_qkv(1, 2, 2, 20, 70, 8, 8, torch.float32, grad_out=True)
    outs = []
    for backend in BACKENDS:
        torch.manual_seed(9)
        outs.append(attnkern.attention(q, k, v, dropout_p=0.4, normalizer=normalizer, backend=backend))
    torch.testing.assert_close(outs[0], outs[1], **tolerance(torch.float32, "attention", "forward"))


def test_multihead_attention_trains_with_dropout_in_the_kernel(monkeypatch):
    """nn.MultiheadAttention with dropout no longer falls back to the reference."""
    from attnkern.backends import reference as ref_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(ref_mod, "attention", refuse)
    mha = attnkern.nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True, normalizer="sparsemax")
    x = torch.randn(2, 17, 32, requires_grad=True)
    out, _ = mha(x, x, x, need_weights=False)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("normalizer, alpha", [("softmax", None), ("entmax", 1.5)])
def test_dropout_with_returned_weights(normalizer, alpha):
    # return_weights=True runs unfused: the weights are dropped out there too,
    # returned after dropout (as torch's MultiheadAttention), and out = p·v.
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    kw = dict(normalizer=normalizer, alpha=alpha, return_weights=True)
    out, p = attnkern.attention(q, k, v, dropout_p=0.5, **kw)
    _, p_full = attnkern.attention(q, k, v, **kw)
    kept = p != 0
    assert 0.3 < kept[p_full != 0].float().mean() < 0.7
    torch.testing.assert_close(p[kept], 2 * p_full[kept])
    torch.testing.assert_close(out, p @ v)


@pytest.mark.parametrize("return_weights", [False, True])
def test_dropout_one_drops_everything_as_sdpa(return_weights):
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    res = attnkern.attention(q, k, v, dropout_p=1.0, normalizer="entmax15", return_weights=return_weights)
    out = res[0] if return_weights else res
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=1.0))
    if return_weights:
        assert not res[1].any()
    out.sum().backward()
    assert not any(t.grad.any() for t in (q, k, v))


def test_multihead_attention_drops_out_with_weights_in_training():
    torch.manual_seed(0)
    mha = attnkern.nn.MultiheadAttention(8, 2, dropout=0.5)
    x = torch.randn(6, 1, 8)
    assert not torch.equal(mha(x, x, x)[0], mha(x, x, x)[0])  # need_weights=True by default
    mha.eval()
    assert torch.equal(mha(x, x, x)[0], mha(x, x, x)[0])


def test_dropout_under_torch_compile_is_not_dropped():
    q, k, v, _ = make_qkv(1, 2, 2, 16, 16, 8, 8, torch.float32, grad_out=True)
    ones = torch.ones(1, 2, 16, 8)

    def f(q, k, v, p):
        return attnkern.attention(q, k, v, dropout_p=p)

    compiled = torch.compile(f, fullgraph=True)
    torch.manual_seed(0)
    dropped = compiled(q, k, ones, 0.9)
    kept = compiled(q, k, ones, 0.0)
    assert torch.allclose(kept, torch.ones_like(kept))
    assert not torch.allclose(dropped, kept)
    # Some weights dropped, the kept ones scaled by 10.
    assert (dropped[..., 0] < 1).any() and (dropped[..., 0] > 1).any()


def test_bad_dropout_seed_refused():
    q, k, v, _ = make_qkv(1, 1, 1, 4, 4, 8, 8, torch.float32, grad_out=True)
    with pytest.raises(RuntimeError, match="dropout_seed"):
        torch.ops.attnkern.attention_fwd(q, k, v, None, False, 0.3, "softmax", None, 0.5, None)


def test_opcheck_with_dropout():
    q, k, v, go = make_qkv(1, 2, 2, 9, 11, 8, 8, torch.float32, grad_out=True)
    seed = torch.tensor(77)
    args = (q, k, v, None, False, 0.35, "sparsemax", None, 0.25, seed)
    torch.library.opcheck(torch.ops.attnkern.attention_fwd, args)
    out, shift = torch.ops.attnkern.attention_fwd(*args)
    torch.library.opcheck(torch.ops.attnkern.attention_bwd,
                          (go[..., :8], q, k, v, None, False, 0.35, "sparsemax", None, out, shift, False, 0.25, seed))
    torch.library.opcheck(torch.ops.attnkern.attention_dropout_mask, (1, 2, 9, 11, 0.25, seed))


@pytest.mark.parametrize("threads", [1, 2])
def test_decoding_with_gqa_applies_its_mask_exactly(threads):
    """Decoding (3 query rows, softmax) with two query heads per kv-head, a
    mask per head and keys over three chunks: the output equals the reference
    run with the recorded keep mask, at 1 and 2 threads."""
    B, H, Hk, L, S, E, p = 2, 4, 2, 3, 1100, 16, 0.3
    q, k, v, _ = make_qkv(B, H, Hk, L, S, E, E, torch.float64, grad_out=True)
    attn_mask = torch.randn(B, H, L, S, dtype=torch.float64)
    attn_mask[1, 2, :, 600:] = float("-inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(5)
        out = attnkern.attention(q, k, v, attn_mask=attn_mask, dropout_p=p, enable_gqa=True, backend="cpu")
    finally:
        torch.set_num_threads(before)
    torch.manual_seed(5)
    keep = attention_dropout_mask(B, H, L, S, p, draw_dropout_seed())
    ref = reference.attention(q, k, v, attn_mask=attn_mask, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(out, ref, **tolerance(torch.float64, "attention", "forward"))
