"""Speed ratios of attnkern against PyTorch, measured in interleaved rounds.

Each case times attnkern and its PyTorch counterpart alternately (the order
flips every round), so machine drift hits both; the ratio reported is the
median over rounds of attnkern's time divided by PyTorch's (below 1: attnkern
is faster). Every table names the CPU, the instruction set attnkern's CPU
kernels dispatched to, PyTorch's CPU capability, the dtype and the threads.

    python benchmarks/ratios.py                      # everything (10-15 min on 2 cores)
    python benchmarks/ratios.py --quick              # N = 2048 and the row-wise shapes
    python benchmarks/ratios.py --dtypes float32 --threads 2
    python benchmarks/ratios.py --cases rowwise --rounds 21
    python benchmarks/ratios.py --cases rowwise --rounds 21 --processes 4

Cases (B = 1, H = 8, E = 64 unless said):
  attention   N = 2048, 8192; softmax, sparsemax, entmax15, entmax α = 1.3;
              fwd and fwd+bwd; against SDPA (softmax) in the same dtype
  causal      softmax, is_causal=True, against SDPA causal
  vs float32  (bfloat16 and float16 only) the attention and causal cases
              against attnkern's own float32 attention on the same shapes
  decode      one query against S = 8192 keys, H = 8 and H = 1 (fwd)
  few rows    16 query rows against S = 2048 keys (the BLAS path), fwd and
              fwd+bwd, against SDPA
  row-wise    [4096, 1024] and [256, 32768], fwd+bwd against torch.softmax;
              attnkern.softmax also fwd

The attention targets depend on the CPU: bfloat16 on AMX tiles (attnkern's
bfloat16 GEMMs on "AMX-BF16", attnkern.isa.dispatch()) has targets of its
own, AMX_BF16_TARGET.

The process's heap keeps the memory it frees (conftest.steady_heap), so that
neither contender pays page faults for fresh tensors in some cases and not in
others.

--processes N repeats the whole run in N fresh processes, one after another,
and reports each case's median ratio over them with their range: where both
contenders stream tensors from memory (the row-wise cases), where a process's
buffers land sets its speed, and on a 2-core Zen 5 a case's ratio moved by
±15% from process to process while staying steady within one.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from conftest import steady_heap
from machine import describe, machine_meta

import attnkern

B, H, E = 1, 8, 64

# The speed targets: the largest ratio that passes.
ATTN_TARGET = {
    ("softmax", "fwd"): 1.0, ("softmax", "fwd+bwd"): 1.0,
    ("sparsemax", "fwd"): 0.7, ("sparsemax", "fwd+bwd"): 0.5,
    ("entmax15", "fwd"): 0.7, ("entmax15", "fwd+bwd"): 0.5,
    ("entmax α=1.3", "fwd"): 1.3, ("entmax α=1.3", "fwd+bwd"): 1.0,
}
# bfloat16 attention where attnkern's bfloat16 GEMMs run on AMX tiles (SDPA's
# do too): the matrix units leave the vector work to set the speed. The
# causal case has softmax's targets.
AMX_BF16_TARGET = {
    ("softmax", "fwd"): 0.8, ("softmax", "fwd+bwd"): 0.6,
    ("sparsemax", "fwd"): 0.7, ("sparsemax", "fwd+bwd"): 0.45,
    ("entmax15", "fwd"): 0.7, ("entmax15", "fwd+bwd"): 0.45,
    ("entmax α=1.3", "fwd"): 1.0, ("entmax α=1.3", "fwd+bwd"): 0.8,
}
# A half type against attnkern's own float32 attention (5% for noise).
OWN_FLOAT32_TARGET = 1.05
ROW_TARGET = {"softmax": 1.05, "sparsemax": 1.0, "entmax15": 1.2, "entmax_bisect α=1.3": 2.0}


def attention_target(dtype, name: str, mode: str) -> float:
    """The largest passing ratio against SDPA for a normalizer ("causal" for
    causal softmax) in dtype on this CPU."""
    amx = dtype == torch.bfloat16 and attnkern.isa.dispatch().get("bf16_gemm_unit") == "AMX-BF16"
    table = AMX_BF16_TARGET if amx else ATTN_TARGET
    if name == "causal":
        return table[("softmax", mode)] if amx else 1.0
    return table[(name, mode)]


# Seconds a case may take: slower cases get fewer rounds (at least one after the warm-up).
CASE_BUDGET_S = 90.0


class Timing(NamedTuple):
    ratio: float  # median over rounds of ours / theirs
    ours: float  # median seconds
    theirs: float
    rounds: int
    ours_faults: float  # median minor page faults during one timed call (all threads)
    theirs_faults: float


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# Warm-up calls at most, and seconds, spent waiting for a contender's calls to
# stop paying page faults.
HEAP_WARM_CALLS, HEAP_WARM_S = 12, 3.0


def _settle_heap(fn: Callable[[], object], faults: int, seconds: float) -> None:
    """Calls fn again while its last call paid page faults. glibc carves each
    aligned 16 MB tensor from fresh pages at the top of the heap until freed
    blocks have coalesced into ones large enough, which took up to a dozen
    calls (sparsemax forward at [4096, 1024]: 11 ms with 4096 faults a call,
    then 2 ms with none); the timed rounds measure the settled heap."""
    calls, spent = 0, seconds
    while faults >= FAULT_NOTE_MIN and calls < HEAP_WARM_CALLS and spent < HEAP_WARM_S:
        f0, t0 = _minor_faults(), time.perf_counter()
        fn()
        faults, spent, calls = _minor_faults() - f0, spent + time.perf_counter() - t0, calls + 1


def interleaved(ours: Callable[[], object], theirs: Callable[[], object], rounds: int) -> Timing:
    """Medians over rounds, the two alternating (order flipped every round)
    after one warm-up each. When both warm-up calls take over a second,
    first-call costs are noise and the warm-up counts as the first round;
    rounds are cut to fit CASE_BUDGET_S. Page faults are counted per call: a
    call that pays thousands of them runs on fresh pages (its buffers were
    returned to the system, or the heap grew), which can cost more than the
    kernel itself."""
    ratios, t_ours, t_theirs, f_ours, f_theirs = [], [], [], [], []
    f0, t0 = _minor_faults(), time.perf_counter()
    ours()
    f1, t1 = _minor_faults(), time.perf_counter()
    theirs()
    f2, t2 = _minor_faults(), time.perf_counter()
    if min(t1 - t0, t2 - t1) > 1.0:
        t_ours.append(t1 - t0)
        t_theirs.append(t2 - t1)
        f_ours.append(f1 - f0)
        f_theirs.append(f2 - f1)
        ratios.append((t1 - t0) / (t2 - t1))
    if not ratios:
        _settle_heap(ours, f1 - f0, t1 - t0)
        _settle_heap(theirs, f2 - f1, t2 - t1)
    rounds = max(1, min(rounds, int(CASE_BUDGET_S / (t2 - t0))))
    for r in range(len(ratios), rounds):
        order = (ours, theirs) if r % 2 == 0 else (theirs, ours)
        times, faults = {}, {}
        for fn in order:
            f0, t0 = _minor_faults(), time.perf_counter()
            fn()
            times[fn] = time.perf_counter() - t0
            faults[fn] = _minor_faults() - f0
        t_ours.append(times[ours])
        t_theirs.append(times[theirs])
        f_ours.append(faults[ours])
        f_theirs.append(faults[theirs])
        ratios.append(times[ours] / times[theirs])
    med = statistics.median
    return Timing(med(ratios), med(t_ours), med(t_theirs), len(ratios), med(f_ours), med(f_theirs))


def attention_call(fn, q, k, v, mode: str, dout):
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn(q, k, v)
        return call

    def call():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        fn(qq, kk, vv).backward(dout)
    return call


def qkv(L: int, S: int, heads: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, L, E, generator=g).to(dtype)
    k = torch.randn(B, heads, S, E, generator=g).to(dtype)
    v = torch.randn(B, heads, S, E, generator=g).to(dtype)
    return q, k, v, torch.randn(B, heads, L, E, generator=g).to(dtype)


NORMALIZER_KW = {"softmax": {"normalizer": "softmax"}, "sparsemax": {"normalizer": "sparsemax"},
                 "entmax15": {"normalizer": "entmax15"}, "entmax α=1.3": {"normalizer": "entmax", "alpha": 1.3}}


def attnkern_fn(kw):
    def fn(a, b, c):
        return attnkern.attention(a, b, c, **kw)
    return fn


def attention_cases(sizes, dtype, rounds_for):
    for n in sizes:
        q, k, v, dout = qkv(n, n, H, dtype)
        for mode in ("fwd", "fwd+bwd"):
            sdpa = attention_call(F.scaled_dot_product_attention, q, k, v, mode, dout)
            for name, kw in NORMALIZER_KW.items():
                ours = attention_call(attnkern_fn(kw), q, k, v, mode, dout)
                yield (f"attention N={n}", name, mode, attention_target(dtype, name, mode),
                       interleaved(ours, sdpa, rounds_for(n)))
            # causal softmax
            ours = attention_call(attnkern_fn({"is_causal": True}), q, k, v, mode, dout)
            theirs = attention_call(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                                    q, k, v, mode, dout)
            yield (f"causal N={n}", "softmax", mode, attention_target(dtype, "causal", mode),
                   interleaved(ours, theirs, rounds_for(n)))


def own_float32_cases(sizes, dtype, rounds_for):
    """A half type's attention against attnkern's own float32 attention on the
    same inputs (the half-type values widened): the half type must not be
    the slower choice."""
    if dtype not in (torch.bfloat16, torch.float16):
        return
    for n in sizes:
        q, k, v, dout = qkv(n, n, H, dtype)
        q32, k32, v32, dout32 = (t.float() for t in (q, k, v, dout))
        cases = [(name, kw) for name, kw in NORMALIZER_KW.items()] + [("causal softmax", {"is_causal": True})]
        for mode in ("fwd", "fwd+bwd"):
            for name, kw in cases:
                ours = attention_call(attnkern_fn(kw), q, k, v, mode, dout)
                own32 = attention_call(attnkern_fn(kw), q32, k32, v32, mode, dout32)
                yield (f"vs attnkern float32 N={n}", name, mode, OWN_FLOAT32_TARGET,
                       interleaved(ours, own32, rounds_for(n)))


def few_rows_cases(dtype, rounds):
    """16 query rows against 2048 keys: K and V read as they are, the products
    by the BLAS (float32, float64) or the half-type GEMMs."""
    q, k, v, dout = qkv(16, 2048, H, dtype)
    for mode in ("fwd", "fwd+bwd"):
        sdpa = attention_call(F.scaled_dot_product_attention, q, k, v, mode, dout)
        for name in ("softmax", "sparsemax"):
            ours = attention_call(attnkern_fn(NORMALIZER_KW[name]), q, k, v, mode, dout)
            yield "few rows L=16 S=2048", name, mode, 1.0, interleaved(ours, sdpa, rounds * 4)


def decode_cases(dtype, rounds):
    for heads in (8, 1):
        q, k, v, dout = qkv(1, 8192, heads, dtype)
        ours = attention_call(lambda a, b, c: attnkern.attention(a, b, c), q, k, v, "fwd", dout)
        theirs = attention_call(F.scaled_dot_product_attention, q, k, v, "fwd", dout)
        yield (f"decode S=8192 H={heads}", "softmax", "fwd", 1.0, interleaved(ours, theirs, rounds * 4))


def rowwise_cases(dtype, rounds):
    for shape in ((4096, 1024), (256, 32768)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(dtype)

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

        def torch_softmax(t):
            return torch.softmax(t, -1)

        label = f"row-wise {list(shape)}"
        yield (label, "softmax", "fwd", ROW_TARGET["softmax"],
               interleaved(fwd(lambda t: attnkern.softmax(t, -1)), fwd(torch_softmax), rounds))
        for name, fn in (("softmax", lambda t: attnkern.softmax(t, -1)), ("sparsemax", attnkern.sparsemax),
                         ("entmax15", attnkern.entmax15),
                         ("entmax_bisect α=1.3", lambda t: attnkern.entmax_bisect(t, 1.3))):
            yield label, name, "fwd+bwd", ROW_TARGET[name], interleaved(fwdbwd(fn), fwdbwd(torch_softmax), rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 2048 only")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds per case (N = 8192: half, at least 3; cut further to fit CASE_BUDGET_S)")
    ap.add_argument("--cases", nargs="+", choices=["attention", "own32", "decode", "fewrows", "rowwise"],
                    default=["attention", "own32", "decode", "fewrows", "rowwise"],
                    help="which groups of cases to run")
    ap.add_argument("--out", default="results/bench/ratios", help="prefix of the .md and .json written")
    ap.add_argument("--processes", type=int, default=1,
                    help="repeat the run in this many fresh processes; report the median ratio and the range")
    args = ap.parse_args()
    if args.processes < 1:
        ap.error("--processes must be at least 1")
    if args.processes > 1:
        return repeat_in_processes(args)
    heap = "steady (glibc mallopt)" if steady_heap() else "the C library's default"
    sizes = [2048] if args.quick else [2048, 8192]

    def rounds_for(n):
        return max(3, args.rounds // 2) if n >= 8192 else args.rounds

    meta = dict(machine_meta("benchmarks/ratios.py"), heap=heap)
    print(describe(meta), flush=True)
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for threads in args.threads:
            torch.set_num_threads(threads)
            title = f"### {dtype_name}, {threads} thread{'s' if threads > 1 else ''}"
            print(title, flush=True)
            groups = {"attention": lambda dt=dtype: attention_cases(sizes, dt, rounds_for),
                      "own32": lambda dt=dtype: own_float32_cases(sizes, dt, rounds_for),
                      "decode": lambda dt=dtype: decode_cases(dt, args.rounds),
                      "fewrows": lambda dt=dtype: few_rows_cases(dt, args.rounds),
                      "rowwise": lambda dt=dtype: rowwise_cases(dt, args.rounds)}
            cases = [groups[name]() for name in args.cases]
            table = []
            for gen in cases:
                for case, name, mode, target, t in gen:
                    table.append(result_row(dtype_name, threads, case, name, mode, target, t))
                    print(table_row(table[-1], 1), flush=True)
            results += table
    write(dict(machine=meta, processes=1, results=results), Path(args.out))


def write(data: dict, out: Path) -> None:
    """out.json (the result file) and out.md (render of it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(render(data))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


def render(data: dict) -> str:
    """The markdown tables of a result file of this script (one process, or
    merged over several: then with each ratio's range over the processes)."""
    meta, procs = data["machine"], data.get("processes", 1)
    how = (f"in each of {procs} processes the median of interleaved rounds; here the median over the "
           f"processes, with their range" if procs > 1 else "median of interleaved rounds")
    heap = f" Heap: {meta['heap']}." if meta.get("heap") else ""
    what = meta.get("ratio_note") or ("Ratio = attnkern time / baseline time (PyTorch's op; in the \"vs attnkern "
                                      "float32\" cases attnkern's float32 attention; < 1: attnkern faster)")
    lines = [f"{describe(meta)}\n{what}: {how}.{heap}", ""]
    tables: dict[tuple, list[dict]] = {}
    for r in data["results"]:
        tables.setdefault((r["dtype"], r["threads"]), []).append(r)
    for (dtype_name, threads), rows in tables.items():
        lines += [f"### {dtype_name}, {threads} thread{'s' if threads > 1 else ''}", "",
                  "| case | normalizer | mode | ratio |" + (" range |" if procs > 1 else "")
                  + " target | attnkern ms | baseline ms | rounds |",
                  "|---|---|---|---:|" + ("---:|" if procs > 1 else "") + "---:|---:|---:|---:|"]
        lines += [table_row(r, procs) for r in rows]
        lines += ["", *fault_notes(rows, "the worst process's median" if procs > 1 else "median")]
    return "\n".join(lines) + "\n"


def result_row(dtype_name: str, threads: int, case: str, name: str, mode: str, target, t: Timing) -> dict:
    """One timed case as write() stores it and table_row() prints it."""
    return dict(dtype=dtype_name, threads=threads, case=case, normalizer=name, mode=mode, ratio=t.ratio,
                target=target, ours_s=t.ours, torch_s=t.theirs, rounds=t.rounds, ours_faults=t.ours_faults,
                torch_faults=t.theirs_faults)


def record_float32_cases(script: str, ratio_note: str, threads: list[int], run_cases, out: Path) -> None:
    """The main loop of the scripts that time float32 cases against a baseline
    each (bands.py, structured.py): at each thread count, the rows run_cases()
    yields as (case, name, mode, target, Timing), printed and stored by write()."""
    heap = "steady (glibc mallopt)" if steady_heap() else "the C library's default"
    meta = dict(machine_meta(script), heap=heap, ratio_note=ratio_note)
    print(describe(meta), ratio_note, flush=True)
    results = []
    for n in threads:
        torch.set_num_threads(n)
        for case, name, mode, target, t in run_cases():
            results.append(result_row("float32", n, case, name, mode, target, t))
            print(f"{n} thr", table_row(results[-1], 1), flush=True)
    write(dict(machine=meta, processes=1, results=results), out)


def table_row(r: dict, procs: int) -> str:
    """One result's markdown row (with the range over the processes when procs > 1)."""
    ok = "" if r["target"] is None or r["ratio"] <= r["target"] else " ✗"
    target = "–" if r["target"] is None else f"≤ {r['target']:g}"
    spread = f" {r['ratio_min']:.2f}–{r['ratio_max']:.2f} |" if procs > 1 else ""
    rounds = f"{r['processes']} × {r['rounds']}" if procs > 1 else f"{r['rounds']}"
    digits = 3 if r["ratio"] < 0.1 else 2  # banded calls run at a few hundredths of the baseline
    return (f"| {r['case']} | {r['normalizer']} | {r['mode']} | {r['ratio']:.{digits}f}{ok} |{spread} "
            f"{target} | {r['ours_s'] * 1e3:.1f} | {r['torch_s'] * 1e3:.1f} | {rounds} |")


# Median page faults a timed call from which a case is named under its table.
FAULT_NOTE_MIN = 64


def fault_notes(rows: list[dict], which: str = "median") -> list[str]:
    """Lines naming the cases of one table whose timed calls paid page faults
    (either contender), to tell a slow heap from a slow kernel."""
    hits = [r for r in rows if max(r["ours_faults"], r["torch_faults"]) >= FAULT_NOTE_MIN]
    if not hits:
        return []
    return [f"Page faults a timed call ({which}; attnkern / PyTorch): " + "; ".join(
        f"{r['case']} {r['normalizer']} {r['mode']} {r['ours_faults']:.0f} / {r['torch_faults']:.0f}"
        for r in hits) + ".", ""]


def _argv_without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (either "--flag v" or "--flag=v")."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def repeat_in_processes(args, script: str = "benchmarks/ratios.py") -> None:
    """Runs the script (this one, or another that records its results with
    write()) args.processes times, each in a fresh process with the same
    arguments, and merges their results: per case, the median of the
    processes' ratios (and of their times) with the lowest and highest ratio."""
    runs = []
    base = _argv_without(_argv_without(sys.argv[1:], "--processes"), "--out")
    path = Path(__file__).resolve().parent / Path(script).name
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            prefix = Path(tmp) / f"run{i}"
            cmd = [sys.executable, str(path), *base, "--out", str(prefix)]
            print(f"process {i + 1} of {args.processes}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True)
            runs.append(json.loads(prefix.with_suffix(".json").read_text()))
    merged, order = {}, []
    for run in runs:
        for r in run["results"]:
            key = (r["dtype"], r["threads"], r["case"], r["normalizer"], r["mode"])
            if key not in merged:
                merged[key] = []
                order.append(key)
            merged[key].append(r)
    # (The processes' own command lines name their scratch output; the header names this one's.)
    meta = dict(runs[0]["machine"], command=" ".join([script, *sys.argv[1:]]))
    results = []
    for key in order:
        rs = merged[key]
        dtype_name, threads, case, name, mode = key
        ratios = [r["ratio"] for r in rs]
        results.append(dict(dtype=dtype_name, threads=threads, case=case, normalizer=name, mode=mode,
                            ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                            ratios=ratios, target=rs[0]["target"],
                            ours_s=statistics.median(r["ours_s"] for r in rs),
                            torch_s=statistics.median(r["torch_s"] for r in rs), rounds=rs[0]["rounds"],
                            processes=len(rs), ours_faults=max(r["ours_faults"] for r in rs),
                            torch_faults=max(r["torch_faults"] for r in rs)))
    data = dict(machine=meta, processes=args.processes, results=results)
    print(render(data))
    write(data, Path(args.out))


if __name__ == "__main__":
    main()
