"""The structured normalizers against attnkern's own sparsemax, row-wise.

fusedmax and oscarmax are sparsemax after an exact prox (a sequential sweep
per row; oscarmax also sorts the row), so their cost is measured against
sparsemax's, which does the same threshold work; crf_marginals (a
forward-backward per row) and sparsemap_chain (its closed forms: with every
transition allowed, and with 1 → 1 forbidden) against torch.softmax's. Forward and
forward+backward at [4096, 1024] float32, interleaved rounds, 1 and 2
threads. And fused fusedmax / oscarmax attention against the unfused path
(materialized scores, the row-wise op, the matmuls) at B=1, H=8, N=2048, E=64.
Writes <out>.json and <out>.md in the format of benchmarks/ratios.py
(docs.py renders them into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from ratios import interleaved, record_float32_cases, repeat_in_processes

import attnkern

SHAPE = (4096, 1024)
# Targets (issue: structured attention): fwd+bwd at most these multiples of sparsemax's.
TARGET_VS_SPARSEMAX = {"fusedmax": 3.0, "oscarmax": 6.0}
# λ per normalizer. oscarmax's weights grow with the row's length: on these
# N(0, 1) rows of 1024 its prox is 0 from about λ = 0.006 up, and from about
# λ = 0.01 every row skips the sort (max|x| below λ(n-1)/2; docs/algorithms.md,
# section 10), so one λ that sorts and pools and one that skips.
LAMS = {"fusedmax": (0.1, 1.0), "oscarmax": (0.001, 0.1)}
# crf_marginals: fwd+bwd at most this multiple of torch.softmax's.
CRF_TARGET_VS_SOFTMAX = 4.0
PAIRWISE = ((0.5, -1.0), (-0.5, 1.0))
PAIRWISE_FORBIDDEN = ((0.5, -1.0), (-0.5, float("-inf")))  # no 1 → 1: SparseMAP's ordered projection
SPARSEMAP_WORK_ROWS = 256  # the rows whose supports the notes count (return_active holds K × n per row)
# Fused attention (B, H, N, E) and its target: fwd and fwd+bwd at most this
# multiple of the unfused path's time (fusedmax; oscarmax reported).
ATTENTION_SHAPE = (1, 8, 2048, 64)
FUSED_TARGET_VS_UNFUSED = {"fusedmax": 0.7, "oscarmax": None}
ATTENTION_LAM = 0.1


def cases(rounds):
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(1))
    g = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(2))

    def fwd(fn, x=x):
        def call():
            with torch.no_grad():
                fn(x)
        return call

    def fwdbwd(fn, x=x, g=g):
        def call():
            t = x.detach().requires_grad_(True)
            fn(t).backward(g)
        return call

    label = f"row-wise {list(SHAPE)}, vs attnkern.sparsemax"
    for name, target in TARGET_VS_SPARSEMAX.items():
        for lam in LAMS[name]:
            def op(t, name=name, lam=lam):
                return getattr(attnkern, name)(t, lam=lam)

            yield label, f"{name} λ={lam}", "fwd", None, interleaved(fwd(op), fwd(attnkern.sparsemax), rounds)
            yield (label, f"{name} λ={lam}", "fwd+bwd", target,
                   interleaved(fwdbwd(op), fwdbwd(attnkern.sparsemax), rounds))
    pairwise = torch.tensor(PAIRWISE)

    def crf(t):
        return attnkern.crf_marginals(t, pairwise)

    def softmax(t):
        return torch.softmax(t, -1)

    label = f"row-wise {list(SHAPE)}, vs torch.softmax"
    yield label, "crf_marginals", "fwd", None, interleaved(fwd(crf), fwd(softmax), rounds)
    yield label, "crf_marginals", "fwd+bwd", CRF_TARGET_VS_SOFTMAX, interleaved(fwdbwd(crf), fwdbwd(softmax), rounds)
    def sparsemap(t):
        return attnkern.sparsemap_chain(t, pairwise)

    yield label, "sparsemap_chain", "fwd", None, interleaved(fwd(sparsemap), fwd(softmax), rounds)
    yield label, "sparsemap_chain", "fwd+bwd", None, interleaved(fwdbwd(sparsemap), fwdbwd(softmax), rounds)
    forbidden = torch.tensor(PAIRWISE_FORBIDDEN)

    def sparsemap_no_11(t):
        return attnkern.sparsemap_chain(t, forbidden)

    name = "sparsemap_chain, no 1→1"
    yield label, name, "fwd", None, interleaved(fwd(sparsemap_no_11), fwd(softmax), rounds)
    yield label, name, "fwd+bwd", None, interleaved(fwdbwd(sparsemap_no_11), fwdbwd(softmax), rounds)
    yield from attention_cases(rounds)


def sparsemap_work() -> str:
    """SparseMAP's work on the first rows of the timed ones: Viterbi calls (1: the closed form, certified) and
    active labelings per row."""
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(1))[:SPARSEMAP_WORK_ROWS]
    parts = []
    for name, pairwise in (("sparsemap_chain", PAIRWISE), ("sparsemap_chain, no 1→1", PAIRWISE_FORBIDDEN)):
        res = attnkern.sparsemap_chain(x, torch.tensor(pairwise), return_active=True)
        calls, support = res.oracle_calls.double(), (res.weights > 0).sum(-1).double()
        parts.append(f"{name} on the first {SPARSEMAP_WORK_ROWS} timed rows: Viterbi calls per row mean "
                     f"{calls.mean():.1f} (max {int(calls.max())}), active labelings per row mean "
                     f"{support.mean():.1f} (max {int(support.max())}).")
    return " ".join(parts)


def attention_cases(rounds):
    B, H, N, E = ATTENTION_SHAPE
    gen = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(B, H, N, E, generator=gen) for _ in range(4))

    def fused(name):
        def run(q, k, v):
            return attnkern.attention(q, k, v, normalizer=name, lam=ATTENTION_LAM)
        return run

    def unfused(name):
        def run(q, k, v):
            s = (q @ k.transpose(-1, -2)) * E**-0.5
            return getattr(attnkern, name)(s, -1, ATTENTION_LAM) @ v
        return run

    def fwd(fn):
        def call():
            with torch.no_grad():
                fn(q, k, v)
        return call

    def fwdbwd(fn):
        def call():
            qkv = [t.detach().requires_grad_(True) for t in (q, k, v)]
            torch.autograd.grad(fn(*qkv), qkv, go)
        return call

    label = f"attention B={B} H={H} N={N} E={E} λ={ATTENTION_LAM}, fused vs unfused"
    for name, target in FUSED_TARGET_VS_UNFUSED.items():
        yield label, name, "fwd", target, interleaved(fwd(fused(name)), fwd(unfused(name)), rounds)
        yield label, name, "fwd+bwd", target, interleaved(fwdbwd(fused(name)), fwdbwd(unfused(name)), rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--processes", type=int, default=1,
                    help="repeat the run in this many fresh processes; report the median ratio and the range")
    ap.add_argument("--out", required=True, help="prefix of the .md and .json written")
    args = ap.parse_args()
    if args.processes < 1:
        ap.error("--processes must be at least 1")
    if args.processes > 1:
        return repeat_in_processes(args, "benchmarks/structured.py")
    note = ("Ratio = the structured normalizer's time / attnkern.sparsemax's on the same rows (crf_marginals, "
            "sparsemap_chain: / torch.softmax's; attention: fused / unfused; the \"baseline ms\" column holds the "
            "baseline's time). " + sparsemap_work())
    record_float32_cases("benchmarks/structured.py", note, args.threads, lambda: cases(args.rounds), Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
