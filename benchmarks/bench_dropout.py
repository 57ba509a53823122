"""A training step (forward + backward, need_weights=False) of multi-head
attention with and without dropout: attnkern.nn.MultiheadAttention for each
normalizer (dropout fused in the kernels) against torch.nn.MultiheadAttention.

N = 2048 tokens, E = 512, 8 heads, batch 1, float32, dropout 0.1. The ratio
to read is each row's time with dropout over the same module's time without
(target <= 1.2), and attnkern softmax with dropout over torch's with dropout
(target <= 1.0); `python benchmarks/bench_dropout.py` prints both from
interleaved rounds.

    pytest benchmarks/bench_dropout.py --benchmark-only
"""

from __future__ import annotations

import statistics
import sys
import time

import pytest
import torch
from conftest import record

import attnkern

N, E, HEADS = 2048, 512, 8
NORMALIZERS = ["softmax", "sparsemax", "entmax15", "entmax1.3"]


def make_module(provider: str, dropout: float):
    torch.manual_seed(0)
    if provider == "torch":
        return torch.nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=True)
    name = provider.split("-", 1)[1]
    kw = dict(normalizer="entmax", alpha=1.3) if name == "entmax1.3" else dict(normalizer=name)
    return attnkern.nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=True, **kw)


def step(mod, x):
    out, _ = mod(x, x, x, need_weights=False)
    out.sum().backward()


def inputs():
    return torch.randn(1, N, E, generator=torch.Generator().manual_seed(1)).requires_grad_()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("provider", ["torch"] + [f"attnkern-{n}" for n in NORMALIZERS])
def test_training_step(benchmark, provider, dropout):
    mod = make_module(provider, dropout).train()
    x = inputs()
    record(benchmark, group="mha-dropout", op="training step", provider=provider, mode="fwd+bwd",
           shape=f"N={N} E={E} heads={HEADS} dropout={dropout}", baseline=provider == "torch", dropout=dropout)
    benchmark.pedantic(step, args=(mod, x), rounds=5, warmup_rounds=1, iterations=1)


def interleaved(rounds: int = 7) -> dict:
    """Median step times (s) with the contenders alternating in every round."""
    mods = {(p, d): make_module(p, d).train() for p in ["torch"] + [f"attnkern-{n}" for n in NORMALIZERS]
            for d in (0.0, 0.1)}
    x = inputs()
    times = {key: [] for key in mods}
    for mod in mods.values():
        step(mod, x)  # warm-up
    for _ in range(rounds):
        for key, mod in mods.items():
            t0 = time.perf_counter()
            step(mod, x)
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


if __name__ == "__main__":
    med = interleaved(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
    print(f"training step, N={N}, E={E}, {HEADS} heads, float32, {torch.get_num_threads()} threads")
    print("| module | no dropout ms | dropout 0.1 ms | dropout / none | vs torch (dropout) |")
    print("|---|---:|---:|---:|---:|")
    for p in ["torch"] + [f"attnkern-{n}" for n in NORMALIZERS]:
        a, b = med[(p, 0.0)], med[(p, 0.1)]
        print(f"| {p} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | {b / med[('torch', 0.1)]:.2f} |")
