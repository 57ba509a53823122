"""Fused attention on the CPU: attnkern (each normalizer) vs torch SDPA (softmax)
vs the unfused path (matmul + the `entmax` package + matmul).

B=1, H=8, E=64, N in {512, 2048, 8192}; modes fwd and fwd+bwd; inputs "normal"
(q, k, v ~ N(0, 1); sparsemax already keeps < 1% of the keys, scattered)
and "local" (q and k share a positional code, so the kept keys, < 1% for
sparsemax and a few % for entmax15, sit in contiguous key blocks: what block
skipping buys). GFLOP/s (of the dense attention, 4·B·H·N²·E per forward,
2.5x that for fwd+bwd) and the kept fraction go to extra_info.

    pytest benchmarks/bench_attention.py --benchmark-only -k "2048"
    pytest benchmarks/bench_attention.py --benchmark-only -k "memory"
"""

from __future__ import annotations

import math
import resource
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import record

import attnkern
from attnkern.backends import reference

B, H, E = 1, 8, 64
SIZES = [512, 2048, 8192]
PROVIDERS = ["attnkern-softmax", "attnkern-sparsemax", "attnkern-entmax15", "attnkern-entmax1.3",
             "sdpa-softmax", "unfused-sparsemax", "unfused-entmax15"]


def make_inputs(n: int, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return tuple(torch.randn(B, H, n, E, generator=g) for _ in range(3))
    # "local": q_i and k_j share a smooth positional code, so s_ij peaks at
    # |i - j| small; plus noise.
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = torch.exp(-torch.arange(E // 2, dtype=torch.float64) / (E // 2) * math.log(n))[None, :]
    code = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], -1).float() * 0.6
    q = code + 0.3 * torch.randn(B, H, n, E, generator=g)
    k = code + 0.3 * torch.randn(B, H, n, E, generator=g)
    return q, k, torch.randn(B, H, n, E, generator=g)


def run(provider: str, q, k, v):
    if provider == "sdpa-softmax":
        return F.scaled_dot_product_attention(q, k, v)
    if provider.startswith("attnkern-"):
        name = provider.split("-", 1)[1]
        if name == "entmax1.3":
            return attnkern.attention(q, k, v, normalizer="entmax", alpha=1.3)
        return attnkern.attention(q, k, v, normalizer=name)
    import entmax

    fn = {"unfused-sparsemax": entmax.sparsemax, "unfused-entmax15": entmax.entmax15}[provider]
    s = reference.attention_scores(q, k, scale=E**-0.5)
    return fn(s, dim=-1) @ v


def kept_fraction(q, k) -> float:
    """Fraction of keys sparsemax keeps (on the first head, up to 2048 queries)."""
    s = reference.attention_scores(q[0, 0, :2048], k[0, 0], scale=E**-0.5)
    return float((attnkern.sparsemax(s, -1) > 0).float().mean())


@pytest.mark.parametrize("kind", ["normal", "local"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_attention(benchmark, provider, n, mode, kind):
    if provider.startswith("unfused") and n > 2048:
        pytest.skip("unfused: N x N scores for every head (GiBs, minutes) at this size")
    if kind == "local" and not provider.endswith(("sparsemax", "softmax", "entmax15")):
        pytest.skip("local inputs: sparsemax/entmax15 against the softmax baselines")
    q, k, v = make_inputs(n, kind)
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return run(provider, q, k, v)
    else:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        go = torch.randn(B, H, n, E)

        def fn():
            out = run(provider, qq, kk, vv)
            return torch.autograd.grad(out, (qq, kk, vv), go)

    rounds = 3 if n >= 8192 else 5
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
    flops = 4 * B * H * n * n * E * (2.5 if mode == "fwd+bwd" else 1.0)
    source, op = provider.split("-", 1)
    record(benchmark, group="attention", op=op, provider=source, mode=mode, shape=f"N={n} {kind}",
           baseline=provider == "sdpa-softmax", n=n, kind=kind, B=B, H=H, E=E,
           gflops=flops / benchmark.stats.stats.median / 1e9)
    if kind == "local" or n == 2048:
        benchmark.extra_info["sparsemax_kept_fraction"] = kept_fraction(q, k)


_MEMORY_SCRIPT = """
import sys, torch, attnkern
import torch.nn.functional as F

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

provider, n = sys.argv[1], int(sys.argv[2])
B, H, E = 1, 8, 64
q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for _ in range(3))
go = torch.randn(B, H, n, E)
# Warm up on a small problem (thread pools, BLAS buffers), then reset the
# peak-RSS counter (Linux: writing 5 to clear_refs) so VmHWM is this call's.
small = [t[:, :, :256].detach().requires_grad_() for t in (q, k, v)]
if provider == "sdpa-softmax":
    fn = F.scaled_dot_product_attention
else:
    name = provider.split("-", 1)[1]
    fn = lambda a, b, c: attnkern.attention(a, b, c, normalizer=name)
fn(*small).sum().backward()
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS:")
out = fn(q, k, v)
out.backward(go)
print(rss("VmHWM:") - base)
"""


@pytest.mark.parametrize("provider", ["attnkern-softmax", "attnkern-sparsemax", "attnkern-entmax15",
                                      "sdpa-softmax"])
def test_memory_16384(benchmark, provider):
    """Peak resident memory of fwd+bwd at N=16384 above the inputs (measured in a
    fresh process: ru_maxrss after minus before; includes out and the grads)."""
    n = 16384

    def fn():
        res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, provider, str(n)], capture_output=True,
                             text=True, check=True)
        return int(res.stdout.strip().splitlines()[-1])

    extra = benchmark.pedantic(fn, rounds=1, iterations=1)
    grads = 4 * B * H * n * E * 4  # out, dq, dk, dv in float32
    source, op = provider.split("-", 1)
    record(benchmark, group="attention-memory", op=op, provider=source, mode="fwd+bwd", shape=f"N={n}",
           baseline=provider == "sdpa-softmax", n=n, peak_bytes_above_inputs=extra,
           peak_bytes_above_inputs_and_grads=extra - grads,
           self_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    assert extra - grads < 1 << 30
