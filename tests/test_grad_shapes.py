"""Gradients of softmax attention on unusual shapes, against SDPA's own error
(issue 27, item 5).

For every case: the largest error of attnkern.attention's dq, dk, dv (and
d attn_mask where the mask needs a gradient) against float64 SDPA on the same
(rounded) inputs, and the same for torch's SDPA in the case's dtype. The
target, for every gradient g:

    err_ours(g) <= max(2 * err_sdpa(g), 2 ulp of the dtype at max|g_exact|)

(the dtype: bfloat16 / float16, or float32 for PyTorch's float32 samples;
max|g_exact| = 0 gives the dtype's smallest subnormal spacing as its ulp).

Cases:
  - every sample of PyTorch's OpInfo for scaled_dot_product_attention, in
    float32 and bfloat16, with its loss: the sum of the squared outputs
    (each computation differentiates its own output). Samples with dropout:
    attnkern's keep mask (seeded), and SDPA through its math op given that
    mask (the path SDPA takes on the CPU for dropout), the float64 result with
    the same mask;
  - the grid E in {1, 59, 64, 257}, Ev in {1, 64, 257}, L, S in {1, 97, 1025},
    B = 1, H = 2, bfloat16 and float16, random inputs and peaked ones (q x 8),
    a fixed random output gradient: a CI subset (22 cases), the other 410
    cases of the grid marked slow (~15 s on 2 idle cores).

Fixed (issue 27, item 5): head dims E < 32 run the backward's GEMMs in
float32 (dS rounded to bfloat16 made dQ = dS·K cancel at E = 1); calls of at
most 4 query rows correct the saved float32 log-sum-exp against the
backward's own scores (their decoding forward summed the products in another
order); rows that fit one key tile take δ = Σ P dP from the tile's own P
(normalized) and dP instead of δ = dO·O from the forward's output, which
carried the forward's roundings, that of the half-type output among them
(one allowed key: dS = 0 exactly); longer bfloat16 / float16 rows with
E != Ev (where SDPA computes in float32) do the same in a pass over the keys
before the tiles (δ from the rounded output cancelled in dS = P ⊙ (dP - δ)
on peaked rows, up to 100x SDPA's error at E = 1).

Known misses, each reported as xfail with its measured error (measured on
AVX512 + AMX-BF16, torch 2.14.1):
  - float32 samples whose scores reach 73-85 (7, 16, 20, 21, 23: dropout, or
    a 3-D query broadcast against 4-D keys; at AVX2 on a Zen 3 also sample 9,
    causal, scores to 84, dq at 2.03x SDPA's error): their gradients follow
    how each score happens to round, so a float32 sample with scores of 70 or
    more that misses is an xfail. Perturbing the float32 scores by up to one ulp (40
    draws, a plain float32 graph of the same attention) spreads the dq error of
    sample 7 over 9.9e-5 to 5.5e-3 (median 1.7e-3), which holds SDPA's math
    path (1.5e-4) and attnkern (5.2e-3) alike; so for dk of 20 (2.1e-4 to
    1.5e-3: SDPA 3.7e-4, attnkern 7.4e-4), dq of 21 (3.0e-4 to 1.9e-3: 6.3e-4,
    1.3e-3) and dq of 23 (5.1e-4 to 4.1e-3: 1.4e-3, 4.4e-3). Sample 16's dv
    (1.9e-5, SDPA 8.2e-6, the spread 2.8e-6 to 1.1e-5) follows the forward
    output's error, 8 ulps of the largest output against SDPA's 3, from the
    same rounding. Holding 2x SDPA's error there would need scores beyond
    float32 (a compensated or double q·kᵀ) on every float32 call: not done.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import grads_in_fresh_leaves

import attnkern
from attnkern import _extension
from attnkern.attention import draw_dropout_seed
from attnkern.testing import attention_dropout_mask

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

_NAMES = ("dq", "dk", "dv", "dmask")


# --- the target --------------------------------------------------------------------


def _ulp(x: float, dtype: torch.dtype) -> float:
    """One ulp of dtype at magnitude x (the subnormal spacing at 0)."""
    fi = torch.finfo(dtype)
    if x < fi.tiny:
        return fi.tiny * fi.eps
    return 2.0 ** math.floor(math.log2(x)) * fi.eps


# float32 samples whose scores reach this far get gradients that follow how each
# score rounds (module docstring): their misses are reported as xfail.
_ROUNDING_BOUND_SCORE = 70.0


def _largest_score(q: torch.Tensor, k: torch.Tensor, enable_gqa: bool) -> float:
    """max |q·kᵀ / √E| of a sample (SDPA's default scale), q broadcast against k."""
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    return (q @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(q.shape[-1])


def _misses(ours, sdpa, exact, dtype) -> list[str]:
    """The gradients that miss the target, with their errors."""
    out = []
    for name, a, s, x in zip(_NAMES, ours, sdpa, exact, strict=False):
        assert a.shape == x.shape and a.dtype == s.dtype, (name, a.shape, x.shape, a.dtype, s.dtype)
        assert torch.isfinite(a).all(), f"{name}: not finite"
        if x.numel() == 0:
            continue
        mx = x.abs().max().item()
        err = (a.double() - x).abs().max().item()
        err_sdpa = (s.double() - x).abs().max().item()
        bound = max(2 * err_sdpa, 2 * _ulp(mx, dtype))
        if not err <= bound:
            ratio = err / err_sdpa if err_sdpa > 0 else math.inf
            out.append(f"{name}: err {err:.3e}, SDPA's {err_sdpa:.3e} ({ratio:.2f}x), max|{name}| {mx:.3e}, "
                       f"bound {bound:.3e}")
    return out


# --- PyTorch's OpInfo samples ------------------------------------------------------


_OPINFO_DTYPES = (torch.float32, torch.bfloat16)

# torch's OpInfo samples for scaled_dot_product_attention, made in a child
# process: importing torch's private test modules disables torch.backends'
# flag setters for the whole process (torch.backends.disable_global_flags),
# which other test files need. torch's test module imports expecttest for its
# TestCase base only: without it installed, unittest's TestCase stands in.
_SAMPLE_SCRIPT = r"""
import sys, types, unittest
import torch
try:
    import expecttest  # noqa: F401
except ImportError:
    stub = types.ModuleType("expecttest")
    stub.TestCase = unittest.TestCase
    sys.modules["expecttest"] = stub
from torch.testing._internal.common_methods_invocations import op_db
op = next(o for o in op_db if o.name == "nn.functional.scaled_dot_product_attention")
out = {}
for dtype in (torch.float32, torch.bfloat16):
    out[str(dtype)] = [(s.input.detach(), [a.detach() for a in s.args],
                        {k: (v.detach(), v.requires_grad) if isinstance(v, torch.Tensor) else v
                         for k, v in s.kwargs.items()})
                       for s in op.sample_inputs("cpu", dtype, requires_grad=True)]
torch.save(out, sys.argv[1])
"""


def _load_samples() -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "samples.pt")
        run = subprocess.run([sys.executable, "-c", _SAMPLE_SCRIPT, path], capture_output=True, text=True)
        if run.returncode != 0:
            return None
        raw = torch.load(path)
    samples = {}
    for key, items in raw.items():
        samples[key] = []
        for inp, args, kwargs in items:
            kw = {}
            for k, v in kwargs.items():
                if isinstance(v, tuple):
                    t, grad = v
                    kw[k] = t.requires_grad_(grad)
                else:
                    kw[k] = v
            samples[key].append(types.SimpleNamespace(input=inp, args=args, kwargs=kw))
    return samples


_SAMPLES = _load_samples()


def _samples(dtype):
    return _SAMPLES[str(dtype)] if _SAMPLES is not None else []


def _sample_id(i, s) -> str:
    kw = s.kwargs
    parts = [f"{i}", "q" + "x".join(map(str, s.input.shape)), "k" + "x".join(map(str, s.args[0].shape))]
    parts += [flag for flag in ("is_causal", "enable_gqa") if kw.get(flag)]
    if kw.get("dropout_p", 0) > 0:
        parts.append(f"dropout{kw['dropout_p']}")
    if kw.get("attn_mask") is not None:
        parts.append("mask_grad" if kw["attn_mask"].requires_grad else "mask")
    return "-".join(parts)


_OPINFO_CASES = [pytest.param(dtype, i, id=f"{str(dtype)[6:]}-{_sample_id(i, s)}")
                 for dtype in _OPINFO_DTYPES for i, s in enumerate(_samples(dtype))]


def _math_sdpa_with_keep(keep, p, is_causal, enable_gqa):
    """SDPA's math op with a given dropout keep mask (its path for dropout on
    the CPU); a query with fewer dims than the keys expanded to their batch."""
    def fn(q, k, v, *mask):
        if q.dim() < k.dim():
            q = q.expand(k.shape[:-3] + q.shape[-3:])
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask[0] if mask else None, p, is_causal, keep, enable_gqa=enable_gqa)[0]
    return fn


@pytest.mark.skipif(_SAMPLES is None, reason="torch's OpInfo for scaled_dot_product_attention is not importable")
@pytest.mark.parametrize("dtype,index", _OPINFO_CASES)
def test_opinfo_sample_gradients(dtype, index):
    s = _samples(dtype)[index]
    kw = dict(s.kwargs)
    mask = kw.pop("attn_mask", None)
    p = kw.pop("dropout_p", 0.0)
    is_causal, enable_gqa = kw.pop("is_causal", False), kw.pop("enable_gqa", False)
    assert not kw, kw
    inputs = [t.detach() for t in (s.input, *s.args)]
    mask_grad = mask is not None and mask.requires_grad
    if mask_grad:
        inputs.append(mask.detach())
    mask_kw = {} if mask is None or mask_grad else {"attn_mask": mask.detach()}

    def with_mask(fn):
        def call(q, k, v, *m):
            return fn(q, k, v, **({"attn_mask": m[0]} if m else mask_kw))
        return call

    flags = dict(is_causal=is_causal, enable_gqa=enable_gqa)
    exact_inputs = [t.double() for t in inputs]
    if p > 0:
        # attnkern's keep mask: the seed its call draws after torch.manual_seed(0).
        torch.manual_seed(0)
        seed = draw_dropout_seed()
        out_shape = F.scaled_dot_product_attention(*exact_inputs[:3], **flags).shape
        H, L, S = out_shape[-3], out_shape[-2], inputs[1].shape[-2]
        keep = attention_dropout_mask(math.prod(out_shape[:-3]), H, L, S, p, seed).view(*out_shape[:-1], S)
        theirs = _math_sdpa_with_keep(keep, p, is_causal, enable_gqa)

        def ours(q, k, v, *m):
            torch.manual_seed(0)
            return attnkern.attention(q, k, v, *m, dropout_p=p, **flags)
    else:
        theirs = with_mask(lambda q, k, v, **m: F.scaled_dot_product_attention(q, k, v, **m, **flags))
        ours = with_mask(lambda q, k, v, **m: attnkern.attention(q, k, v, **m, **flags))
    exact = grads_in_fresh_leaves(theirs, exact_inputs, loss="square")
    g_sdpa = grads_in_fresh_leaves(theirs, inputs, loss="square")
    g_ours = grads_in_fresh_leaves(ours, inputs, loss="square")
    misses = _misses(g_ours, g_sdpa, exact, dtype)
    if misses and dtype == torch.float32 and _largest_score(*exact_inputs[:2], enable_gqa) >= _ROUNDING_BOUND_SCORE:
        pytest.xfail("float32, scores of order 80 (known, see the module docstring): " + "; ".join(misses))
    assert not misses, "; ".join(misses)


# --- the grid ----------------------------------------------------------------------

_ES, _EVS, _LS = (1, 59, 64, 257), (1, 64, 257), (1, 97, 1025)
_HALF = (torch.bfloat16, torch.float16)
_PEAK = 8.0

# The CI subset: each cause found, and controls that pass (E = Ev, where
# SDPA takes its flash path). (E, Ev, L, S, kind)
_SUBSET = [
    (257, 1, 1, 97, "peaked"),      # decoding, δ from the rounded output (issue: 6.1x)
    (257, 1, 1025, 1025, "peaked"),  # the biggest: δ, bfloat16 GEMMs
    (59, 1, 1, 97, "peaked"),
    (64, 257, 1, 97, "peaked"),
    (1, 64, 97, 97, "peaked"),       # E = 1: δ, and dS in bfloat16 for dQ, dK
    (1, 257, 1, 1025, "peaked"),
    (1, 64, 1025, 97, "random"),
    (59, 257, 97, 1, "random"),      # S = 1: exact dq = dk = 0
    (64, 64, 97, 97, "peaked"),      # controls
    (257, 257, 97, 1025, "random"),
    (59, 64, 1025, 97, "random"),
]


def _grid_inputs(E, Ev, L, S, kind, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, S, Ev, generator=g, dtype=torch.float64)
    go = torch.randn(1, 2, L, Ev, generator=g, dtype=torch.float64).to(dtype)
    if kind == "peaked":
        q = q * _PEAK
    return [t.to(dtype) for t in (q, k, v)], go


def _grid_case(E, Ev, L, S, kind, dtype):
    inputs, go = _grid_inputs(E, Ev, L, S, kind, dtype)
    exact = grads_in_fresh_leaves(F.scaled_dot_product_attention, [t.double() for t in inputs], go.double())
    g_sdpa = grads_in_fresh_leaves(F.scaled_dot_product_attention, inputs, go)
    g_ours = grads_in_fresh_leaves(attnkern.attention, inputs, go)
    misses = _misses(g_ours, g_sdpa, exact, dtype)
    assert not misses, "; ".join(misses)


def _grid_id(dtype, E, Ev, L, S, kind):
    return f"{str(dtype)[6:]}-{kind}-E{E}-Ev{Ev}-L{L}-S{S}"


@pytest.mark.parametrize("dtype,E,Ev,L,S,kind", [pytest.param(dt, *c, id=_grid_id(dt, *c))
                                                  for dt in _HALF for c in _SUBSET])
def test_grid_gradients(dtype, E, Ev, L, S, kind):
    _grid_case(E, Ev, L, S, kind, dtype)


_FULL = [(E, Ev, L, S, kind) for E in _ES for Ev in _EVS for L in _LS for S in _LS for kind in ("random", "peaked")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,E,Ev,L,S,kind", [pytest.param(dt, *c, id=_grid_id(dt, *c))
                                                  for dt in _HALF for c in _FULL if c not in _SUBSET])
def test_grid_gradients_full(dtype, E, Ev, L, S, kind):
    _grid_case(E, Ev, L, S, kind, dtype)
