"""Passes over K of the Triton attention forward, counted by an instrumented run.

The sparse normalizers find each query block's shifts by passes over the key
blocks, each recomputing q·kᵀ on the blocks it reads: on a GPU their number,
not the CPU time of the interpreter, is the cost. This counts them (including
the first pass and the final P·V pass) per query block, under the Triton
interpreter when there is no GPU, in float32, on "random" and "local" inputs
(attnkern.backends.triton.attention.pass_count_inputs), L = S in {256, 1024},
E = 64, block sizes as the launcher picks them.

    python benchmarks/bench_triton_passes.py [--sizes 256 1024]   # prints the table
    pytest benchmarks/bench_triton_passes.py --benchmark-only     # rows for report.py

Each pytest case runs the count in a fresh process with TRITON_INTERPRET=1
(triton reads it when first imported) and stores the numbers in extra_info,
group "triton-passes"; benchmarks/report.py tabulates them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

NORMALIZERS = ("sparsemax", "entmax15", "entmax")
KINDS = ("random", "local")
SIZES = (256, 1024)
E = 64


def measure(normalizer: str, kind: str, n: int) -> dict:
    """The counts of one (normalizer, kind, L = S = n), in this process."""
    import torch

    from attnkern.backends.triton import attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    row = attention.pass_count_summary(normalizer, kind, n, n, E, device=device)
    label = normalizer
    if normalizer == "entmax":
        label += " α=" + "/".join(f"{a:g}" for a in attention.PASS_COUNT_ALPHAS)
    return dict(row, normalizer=label, kind=kind, n=n)


def markdown(rows: list[dict]) -> str:
    out = ["| normalizer | inputs | L = S | max passes | mean passes | key blocks read (mean) | key blocks |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['normalizer']} | {r['kind']} | {r['n']} | {r['max_passes']} | {r['mean_passes']:.2f} "
                   f"| {r['mean_blocks']:.1f} | {r['key_blocks']} |")
    return "\n".join(out)


def _in_subprocess(normalizer: str, kind: str, n: int) -> dict:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    res = subprocess.run([sys.executable, __file__, "--json", normalizer, kind, str(n)], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


try:
    import pytest
except ImportError:  # the script needs no pytest
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("n", SIZES)
    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("normalizer", NORMALIZERS)
    def test_triton_forward_passes(benchmark, normalizer, kind, n):
        pytest.importorskip("triton", reason="triton is not installed")
        row = benchmark.pedantic(lambda: _in_subprocess(normalizer, kind, n), rounds=1, iterations=1)
        benchmark.extra_info.update(row, group="triton-passes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--json", nargs=3, metavar=("NORMALIZER", "KIND", "N"),
                    help="count one case in this process and print it as JSON")
    args = ap.parse_args()
    if args.json:
        normalizer, kind, n = args.json
        print(json.dumps(measure(normalizer, kind, int(n))))
        return
    rows = [_in_subprocess(norm, kind, n) for norm in NORMALIZERS for kind in KINDS for n in args.sizes]
    print("Triton forward passes over K (interpreter, float32)\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
