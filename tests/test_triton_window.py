"""The Triton kernels with a key band: windows, cache lengths and packed
documents (attnkern.attention(..., backend="triton")), against the float64
reference given the band as a dense mask, against the CPU kernel's dropout
mask, and the key blocks a query block reads. Under the interpreter on a CPU
host (as tests/test_triton.py): small shapes, odd sizes, more than one query
and key block of 64."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import KERNEL_ALPHAS, NORMALIZERS, alpha_for, make_qkv, require_backend

import attnkern
from attnkern.testing import tolerance, triton_test_device

pytest.importorskip("triton", reason="triton is not installed")
pytestmark = pytest.mark.gpu

DEVICE, _why = triton_test_device()
if DEVICE is None:
    pytest.skip(f"the Triton kernels cannot run here: {_why}", allow_module_level=True)

make_inputs = functools.partial(make_qkv, grad_out=True, device=DEVICE)


def run(backend, q, k, v, do, alpha, **kw):
    """Output and the gradients in q, k, v (and α when it is a tensor) of one call."""
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    a = alpha.detach().to(q.device).clone().requires_grad_() if isinstance(alpha, torch.Tensor) else alpha
    if backend == "reference":
        xs = [t.detach().double().requires_grad_() for t in xs]
        a = a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) else a
    out = attnkern.attention(*xs, alpha=a, backend=backend, **kw)
    wrt = xs + ([a] if isinstance(a, torch.Tensor) else [])
    return (out, *torch.autograd.grad(out, wrt, do.to(out.dtype)))


# (B, H, Hk, L, S, window, is_causal, cache lengths): a window of width 0
# (the diagonal) and 1, one wider than S, left- and right-only, L != S in
# both directions, the intersection with a causal mask, a batch element with
# no valid key and one whose window starts past its cache; 97 and 150 cross
# blocks of 64.
CASES = [
    (1, 2, 1, 97, 97, (5, 0), False, None),
    (1, 1, 1, 97, 97, (0, 0), False, None),
    (1, 1, 1, 70, 70, (1, 1), False, None),
    (1, 1, 1, 33, 40, (100, 100), False, None),
    (1, 1, 1, 150, 150, (-1, 4), False, None),
    (1, 2, 2, 29, 97, (7, -1), True, None),
    (1, 1, 1, 97, 29, (3, 2), False, None),
    (2, 2, 1, 5, 97, None, False, (17, 97)),
    (3, 2, 2, 9, 70, (6, -1), False, (0, 40, 3)),
]
CASE_IDS = ["B{}H{}Hk{}-L{}S{}-w{}-causal{}-lens{}".format(*c) for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_band_matches_reference(normalizer, case):
    B, H, Hk, L, S, window, is_causal, lengths = case
    q, k, v, do = make_inputs(B, H, Hk, L, S, 16, 16)
    alpha = alpha_for(normalizer, H, KERNEL_ALPHAS)
    kw = dict(window=window, is_causal=is_causal, scale=0.5, normalizer=normalizer, enable_gqa=True)
    if lengths is not None:
        kw["cache_seqlens"] = torch.tensor(lengths, device=DEVICE)
    got = run("triton", q, k, v, do, alpha, **kw)
    want = run("reference", q, k, v, do, alpha, **kw)
    tol = tolerance(q.dtype, "attention", "forward")
    for name, g, w in zip(["out", "dq", "dk", "dv", "dalpha"][:len(got)], got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("normalizer", ["softmax", "entmax"])
def test_band_with_alpha_above_two(normalizer):
    # α > 2 heads solve their rows in p-space over the band's key blocks only.
    q, k, v, do = make_inputs(1, 2, 2, 97, 97, 16, 16, seed=4)
    alpha = alpha_for(normalizer, 2, (2.5, 1.5))
    kw = dict(window=(9, 3), scale=0.5, normalizer=normalizer)
    for g, w in zip(run("triton", q, k, v, do, alpha, **kw), run("reference", q, k, v, do, alpha, **kw),
                    strict=True):
        torch.testing.assert_close(g.double(), w, **tolerance(q.dtype, "attention", "forward"))


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_band_draws_the_cpu_dropout_mask(normalizer):
    require_backend("cpu")
    q, k, v, do = make_qkv(2, 2, 2, 20, 70, 8, 8, torch.float32, grad_out=True)
    kw = dict(window=(11, 2), cache_seqlens=torch.tensor([70, 33]), dropout_p=0.4, normalizer=normalizer)
    results = []
    for backend, dev in (("cpu", "cpu"), ("triton", DEVICE)):
        torch.manual_seed(9)
        results.append(run(backend, *(t.to(dev) for t in (q, k, v, do)), None,
                           **dict(kw, cache_seqlens=kw["cache_seqlens"].to(dev))))
    for g, w in zip(*results, strict=True):
        torch.testing.assert_close(g.cpu(), w.cpu(), **tolerance(torch.float32, "attention", "forward"))


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_packed_documents(normalizer):
    # attention_varlen runs one call per document: with the Triton backend too.
    lengths = [1, 40, 0, 23]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    total = sum(lengths)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(total, 2, 16, generator=g).to(DEVICE) for _ in range(4))
    outs = []
    for backend in ("triton", "reference"):
        xs = [t.clone().double().requires_grad_() if backend == "reference" else t.clone().requires_grad_()
              for t in (q, k, v)]
        out = attnkern.attention_varlen(*xs, cu, cu, max(lengths), max(lengths), is_causal=True, window=(5, 0),
                                        normalizer=normalizer, backend=backend)
        outs.append((out, *torch.autograd.grad(out, xs, do.to(out.dtype))))
    for g_, w in zip(*outs, strict=True):
        torch.testing.assert_close(g_.double(), w, **tolerance(torch.float32, "attention", "forward"))


def test_key_blocks_read_follow_the_band():
    # Softmax reads each key block once: a query block reads the blocks its rows'
    # bands touch, no more (work in proportion to the band).
    from attnkern.backends.triton.attention import _kernels, forward_pass_counts

    L = S = 150
    q, k, v = (t.float() for t in make_inputs(1, 1, 1, L, S, 16, 16)[:3])
    _, _, passes, blocks = forward_pass_counts(q, k, v, None, False, 0.5, "softmax", None, window=(5, 0))
    bm = _kernels().attn_fwd.best_config.kwargs["BLOCK_M"]
    bn = _kernels().attn_fwd.best_config.kwargs["BLOCK_N"]
    want = [len({j // bn for i in range(i0, min(i0 + bm, L)) for j in range(max(0, i - 5), i + 1)})
            for i0 in range(0, L, bm)]
    assert passes.flatten().tolist() == [1] * len(want)
    assert blocks.flatten().tolist() == want and want != [(S + bn - 1) // bn] * len(want)
    # Cache lengths: key blocks past a batch element's length are not read.
    lens = torch.tensor([20, 150], device=DEVICE)
    q2, k2, v2 = (torch.cat([t, t]) for t in (q[:, :, :3], k, v))
    _, shift, _, blocks = forward_pass_counts(q2, k2, v2, None, False, 0.5, "softmax", None, key_lengths=lens)
    assert blocks[0].flatten().tolist() == [1] and blocks[1].flatten().tolist() == [(S + bn - 1) // bn]


def _intervals(L, S, seed=0):
    """One run of keys per row, [lo, hi), near the diagonal i·S/L but drawn at
    random: the ends do not grow with the row and some rows are empty, as in
    no window or document mask."""
    g = torch.Generator().manual_seed(seed)
    lo = (torch.arange(L) * S // L + torch.randint(-12, 12, (L,), generator=g)).clamp(0, S)
    hi = torch.minimum(lo + torch.randint(0, 30, (L,), generator=g), torch.tensor(S))
    return lo, hi


BLOCK_MASKS = {
    "documents": (lambda: (lambda d: lambda b, h, q, kv: (d[q] == d[kv]) & (q >= kv))(
        torch.repeat_interleave(torch.arange(4), torch.tensor([30, 1, 80, 39]))), 150, 150, None),
    "random-runs": (lambda: (lambda r: lambda b, h, q, kv: (kv >= r[0][q]) & (kv < r[1][q]))(_intervals(97, 150)),
                    97, 150, None),
    "per-head": (lambda: lambda b, h, q, kv: (q >= kv) & (q - kv <= 5 + 40 * h), 150, 150, 2),
    # (Rows with gaps: block row by block row over the gathered key blocks, a dense mask inside them.)
    "global-and-local": (lambda: lambda b, h, q, kv: (kv < 3) | ((q >= kv) & (q - kv < 20)), 150, 150, None),
}


@pytest.mark.parametrize("mask", list(BLOCK_MASKS))
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_block_mask_matches_reference(normalizer, mask):
    """A FlexAttention BlockMask reaches the kernels as one run of keys per row
    (row_bounds): forward, dQ and the dK/dV kernel's scan for the query rows
    that see a key block, against the reference given torch's dense mask."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    make_mod, L, S, Hm = BLOCK_MASKS[mask]
    mod = make_mod()
    if Hm is not None and normalizer == "entmax":
        pytest.skip("a mask that differs across heads takes one α for all heads (tested on the CPU)")
    bm = flex.create_block_mask(mod, None, Hm, L, S, device="cpu", BLOCK_SIZE=64)
    dense = flex.create_mask(mod, 1, Hm or 1, L, S, device="cpu").to(DEVICE)
    q, k, v, do = make_inputs(1, 2, 1, L, S, 16, 16, seed=6)
    alpha = alpha_for(normalizer, 2, KERNEL_ALPHAS)
    kw = dict(scale=0.5, normalizer=normalizer, enable_gqa=True)
    got = run("triton", q, k, v, do, alpha, attn_mask=bm, **kw)
    want = run("reference", q, k, v, do, alpha, attn_mask=dense, **kw)
    tol = tolerance(q.dtype, "attention", "forward")
    for name, g, w in zip(["out", "dq", "dk", "dv", "dalpha"][:len(got)], got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_key_blocks_read_follow_the_row_bounds():
    """Each query block reads the key blocks from that of its rows' least first
    key to that of their greatest last key, no more; a block whose rows see
    nothing reads none."""
    from attnkern.backends.triton.attention import _kernels, forward_pass_counts

    L, S = 97, 150
    lo, hi = _intervals(L, S, seed=1)
    q, k, v = (t.float() for t in make_inputs(1, 1, 1, L, S, 16, 16)[:3])
    bounds = torch.stack([lo, hi], -1)[None].to(DEVICE)
    _, _, _, blocks = forward_pass_counts(q, k, v, None, False, 0.5, "softmax", None, row_bounds=bounds)
    bm = _kernels().attn_fwd.best_config.kwargs["BLOCK_M"]
    bn = _kernels().attn_fwd.best_config.kwargs["BLOCK_N"]
    expect = []
    for i0 in range(0, L, bm):
        runs = [(int(lo[i]), int(hi[i])) for i in range(i0, min(i0 + bm, L)) if hi[i] > lo[i]]
        expect.append((max(b for _, b in runs) - 1) // bn - min(a for a, _ in runs) // bn + 1 if runs else 0)
    assert blocks.flatten().tolist() == expect and max(expect) < (S + bn - 1) // bn
