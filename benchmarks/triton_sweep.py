"""Compiles the Triton attention kernels ahead of time for GPU targets, with no GPU,
and records what each launch configuration costs on the chip: shared memory
(Triton's metadata), registers and spill bytes (ptxas -v on the PTX).

    python benchmarks/triton_sweep.py --out results/triton-sweep [--archs 80 90] [--modes one small]
        [--dtypes bf16 fp32] [--head-dims 64 128] [--jobs 2] [--render-only]

Every (kernel, normalizer variant, dtype, head dim, configuration of the chosen
ATTNKERN_TRITON_AUTOTUNE modes, architecture) is compiled once plain and once
with the heaviest flags (mask, causal, dropout), in worker processes without
the interpreter. Rows
go to sweep.jsonl as they finish (a rerun skips the ones there); sweep.md
tabulates them, flagging a configuration whose shared memory exceeds the
architecture's per-block limit or that spills.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Shared memory one block may opt into (bytes): A100 (sm_80), H100/H200 (sm_90).
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# (name, FAMILY code, EDGE): every normalizer, and α-entmax with heads at α > 2.
VARIANTS = (("softmax", 0, False), ("sparsemax", 1, False), ("entmax15", 2, False), ("entmax", 3, False),
            ("entmax α>2", 3, True))
KERNELS = ("fwd", "dq", "dkdv")


def _compile_one(job: dict) -> dict:
    """Runs in a worker: compiles one kernel configuration, returns its row."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from attnkern.backends.triton import kernels as K
    from attnkern.backends.triton.attention import _NSETS

    dt = job["dtype"]
    acc = tl.float64 if dt == "fp64" else tl.float32
    heavy = job["flags"] == "mask+causal+dropout"
    base = dict(FAMILY=job["family"], HAS_MASK=heavy, BAND=heavy, HAS_KEYLEN=heavy, HAS_ROWB=False,
                HEAD_DIM=job["head_dim"],
                HEAD_DIM_V=job["head_dim"], BLOCK_M=job["block_m"], BLOCK_N=job["block_n"], ACC=acc, DROPOUT=heavy,
                EDGE=job["edge"], DOT="ieee")
    fn, const = {
        "fwd": (K._attn_fwd_kernel, dict(base, MAX_ITER=64, N_WORDS=32, NSETS=_NSETS, COUNT=False)),
        "dq": (K._attn_bwd_dq_kernel, dict(base, STATS=job["family"] != 0, ALPHA_GRAD=job["family"] == 3)),
        "dkdv": (K._attn_bwd_dkdv_kernel, base),
    }[job["kernel"]]
    sig = K.aot_signature(fn, const, dt)
    row = dict(job)
    t0 = time.time()
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", job["arch"], 32),
                           options=dict(num_warps=job["num_warps"], num_stages=job["num_stages"]))
    except Exception as exc:  # a configuration the compiler refuses is a result
        row.update(compiled=False, error=f"{type(exc).__name__}: {exc}"[:300], seconds=round(time.time() - t0, 1))
        return row
    row.update(compiled=True, seconds=round(time.time() - t0, 1), shared=int(k.metadata.shared))
    ptx = k.asm["ptx"]
    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([get_ptxas(job["arch"]).path, f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    row.update(registers=int(regs.group(1)) if regs else None,
               spill_stores=int(spills.group(1)) if spills else None,
               spill_loads=int(spills.group(2)) if spills else None)
    return row


def jobs(args) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    os.environ.pop("TRITON_INTERPRET", None)
    from attnkern.backends.triton import kernels as K

    out = []
    for arch, flags, mode, dt, hd, (name, fam, edge), kernel in itertools.product(
            args.archs, args.flags, args.modes, args.dtypes, args.head_dims, VARIANTS, KERNELS):
        table = K._KEY_CANDIDATES if kernel == "dkdv" else K._ROW_CANDIDATES
        for bm, bn, w, st in table[mode]:
            job = dict(arch=arch, flags=flags, dtype=dt, head_dim=hd, normalizer=name, family=fam, edge=edge,
                       kernel=kernel, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            if job not in out:
                out.append(job)
    return out


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in ("arch", "flags", "dtype", "head_dim", "normalizer", "kernel", "block_m",
                                  "block_n", "num_warps", "num_stages"))


def _summary(rows: list[dict]) -> list[str]:
    """Per architecture, flags, dtype, head dim, normalizer and kernel: how many
    configurations compile, fit and spill nothing, and the least spill."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["arch"], r["flags"], r["dtype"], r["head_dim"], r["normalizer"], r["kernel"])
        groups.setdefault(key, []).append(r)
    lines = ["| arch | flags | dtype | E | normalizer | kernel | configurations | fit | spill-free | least spill "
             "stores (bytes) |", "|" + "---|" * 10]
    for key in sorted(groups):
        g = groups[key]
        ok = [r for r in g if r.get("compiled") and r["shared"] <= SMEM_LIMIT[r["arch"]]]
        free = [r for r in ok if r["spill_stores"] == 0]
        least = min((r["spill_stores"] for r in ok if r["spill_stores"] is not None), default="–")
        arch, flags, dt, hd, name, kernel = key
        lines.append(f"| sm_{arch} | {flags} | {dt} | {hd} | {name} | {kernel} | {len(g)} | {len(ok)} | {len(free)} "
                     f"| {least} |")
    return lines


def render(rows: list[dict]) -> str:
    lines = ["# Triton kernels compiled ahead of time", "", "## Summary", ""] + _summary(rows)
    lines += ["", "## Every configuration", "",
             f"{len(rows)} configurations; shared memory in KiB against the architecture's per-block limit "
             f"({', '.join(f'sm_{a}: {v // 1024}' for a, v in SMEM_LIMIT.items())}); registers and spill bytes "
             "from ptxas -v.", "",
             "| arch | flags | dtype | E | normalizer | kernel | BLOCK_M×N, warps, stages | shared KiB | fits "
             "| registers | spill stores | spill loads | compile s |", "|" + "---|" * 13]
    for r in sorted(rows, key=_key):
        cfg = f"{r['block_m']}×{r['block_n']}, {r['num_warps']}, {r['num_stages']}"
        if not r.get("compiled"):
            lines.append(f"| sm_{r['arch']} | {r['flags']} | {r['dtype']} | {r['head_dim']} | {r['normalizer']} "
                         f"| {r['kernel']} | {cfg} | – | NO | – | – | – | {r['seconds']} |")
            continue
        fits = r["shared"] <= SMEM_LIMIT[r["arch"]]
        lines.append(f"| sm_{r['arch']} | {r['flags']} | {r['dtype']} | {r['head_dim']} | {r['normalizer']} "
                     f"| {r['kernel']} | {cfg} | {r['shared'] / 1024:.0f} | {'yes' if fits else 'NO'} "
                     f"| {r['registers']} | {r['spill_stores']} | {r['spill_loads']} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/triton-sweep")
    ap.add_argument("--archs", nargs="+", type=int, default=[80, 90])
    ap.add_argument("--modes", nargs="+", default=["one", "small"], choices=["one", "small", "full"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32", "fp64"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--flags", nargs="+", default=["plain", "mask+causal+dropout"],
                    choices=["plain", "mask+causal+dropout"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--render-only", action="store_true", help="rewrite sweep.md from sweep.jsonl, compile nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sweep.jsonl"
    done = {_key(json.loads(line)): json.loads(line) for line in path.read_text().splitlines()} \
        if path.exists() else {}
    todo = [] if args.render_only else [j for j in jobs(args) if _key(j) not in done]
    print(f"{len(done)} done, {len(todo)} to compile", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool, open(path, "a") as f:
        for fut in as_completed([pool.submit(_compile_one, j) for j in todo]):
            row = fut.result()
            done[_key(row)] = row
            f.write(json.dumps(row) + "\n")
            f.flush()
    (out / "sweep.md").write_text(render(list(done.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
