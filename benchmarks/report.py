"""Turns a pytest-benchmark JSON file into a committed result file with its tables and plot.

    python benchmarks/report.py .benchmarks/latest.json --out results/bench/<cpu>/suites
    python benchmarks/report.py --render results/bench/<cpu>/suites.json   # .md and .png again

The result file (<out>.json) keeps, per benchmark, what its suite recorded
(conftest.record: group, op, provider, mode, shape, baseline and extras) with
its median and IQR, and the machine and code that produced it
(machine.machine_meta); <out>.md and <out>.png are rendered from it alone,
so docs/benchmarks.md can be regenerated from committed files. The baseline
of a (group, shape, mode) is the benchmark with baseline=True (torch's softmax
for the normalizers, scaled_dot_product_attention for attention). Rows of
group "triton-passes" (bench_triton_passes.py) are counts, not times, and rows
of group "attention-memory" peak bytes: each gets its own section.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe, machine_meta  # noqa: E402

# What every timed record must carry (conftest.record's arguments).
RECORD_KEYS = ("group", "op", "provider", "mode", "shape", "baseline")
# Groups that are not times: their own sections.
PASSES_GROUP, MEMORY_GROUP = "triton-passes", "attention-memory"


def load(path: str) -> tuple[list[dict], dict]:
    """The records of a pytest-benchmark JSON file and its machine and commit
    information. A record without one of RECORD_KEYS is an error naming the
    benchmark (a suite that does not call conftest.record)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if info.get("group") != PASSES_GROUP:
            missing = [k for k in RECORD_KEYS if k not in info]
            if missing:
                raise ValueError(f"benchmark {b.get('fullname', b.get('name'))} records no {', '.join(missing)} "
                                 f"(its suite must call conftest.record)")
        rows.append(dict(info, name=b.get("fullname", b.get("name")), median_ms=b["stats"]["median"] * 1e3,
                         iqr_ms=b["stats"]["iqr"] * 1e3, rounds=b["stats"]["rounds"]))
    return rows, dict(cpu=data.get("machine_info", {}).get("cpu", {}).get("brand_raw"),
                      commit=data.get("commit_info", {}).get("id"), dirty=data.get("commit_info", {}).get("dirty"))


def table(rows: list[dict]) -> str:
    base = {}
    for r in rows:
        if r["baseline"]:
            base[(r["group"], r["shape"], r["mode"])] = r["median_ms"]
    by_op = defaultdict(dict)
    for r in rows:
        by_op[(r["group"], r["shape"], r["mode"], r["op"])][r["provider"]] = r
    out = ["| group | shape | mode | op | provider | median ms | × baseline | attnkern speed-up |",
           "|---|---|---|---|---|---:|---:|---:|"]
    for (group, shape, mode, op), provs in sorted(by_op.items()):
        b = base.get((group, shape, mode))
        ours = provs.get("attnkern")
        for prov, r in sorted(provs.items(), key=lambda kv: kv[0] != "attnkern"):
            ratio = f"{r['median_ms'] / b:.2f}" if b else "–"
            speedup = ""
            if ours is not None and prov != "attnkern":
                speedup = f"{r['median_ms'] / ours['median_ms']:.1f}×"
            out.append(f"| {group} | {shape} | {mode} | {op} | {prov} | {r['median_ms']:.2f} | {ratio} | {speedup} |")
    return "\n".join(out)


def memory_section(rows: list[dict]) -> str:
    """Peak resident memory of attention forward and backward (bench_attention.test_memory_16384)."""
    if not rows:
        return ""
    out = ["## Peak memory of attention forward and backward", "",
           "Resident memory above the inputs at its peak, measured in a fresh process (MiB; out, dq, dk, dv "
           "included, then without them).", "",
           "| shape | op | provider | peak MiB | without out and grads MiB |", "|---|---|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["shape"], r["provider"], r["op"])):
        out.append(f"| {r['shape']} | {r['op']} | {r['provider']} | {r['peak_bytes_above_inputs'] / 2**20:.0f} | "
                   f"{r['peak_bytes_above_inputs_and_grads'] / 2**20:.0f} |")
    return "\n".join(out) + "\n"


PASSES_TITLE = "Triton forward passes over K (interpreter, float32)"


def passes_section(rows: list[dict]) -> str:
    """The pass-count table of bench_triton_passes.py; "" without its rows."""
    if not rows:
        return ""
    from bench_triton_passes import KINDS, NORMALIZERS, markdown

    def key(r):
        name, kind = r["normalizer"].split()[0], r["kind"]
        return (NORMALIZERS.index(name) if name in NORMALIZERS else len(NORMALIZERS),
                KINDS.index(kind) if kind in KINDS else len(KINDS), r["n"])

    rows = sorted(rows, key=key)
    return (f"## {PASSES_TITLE}\n\nPer query block, every pass over the key blocks (the first, the "
            f"threshold search's, the P·V one); max and mean over query blocks and heads.\n\n"
            + markdown(rows) + "\n")


def plot(rows: list[dict], path: Path) -> bool:
    """Bars of every timed benchmark's median, one panel per (group, shape, mode); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    groups = sorted({(r["group"], r["shape"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.2 * len(groups)), squeeze=False)
    for ax, key in zip(axes[:, 0], groups, strict=True):
        sel = [r for r in rows if (r["group"], r["shape"], r["mode"]) == key]
        labels = [f"{r['op']} [{r['provider']}]" for r in sel]
        ax.barh(labels, [r["median_ms"] for r in sel], color=["C0" if r["provider"] == "attnkern" else "C7"
                                                              for r in sel])
        ax.set_xscale("log")
        ax.set_title(" ".join(key), fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("median ms (log)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def split(records: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """The timed records, the memory records and the pass counts."""
    timed = [r for r in records if r["group"] not in (PASSES_GROUP, MEMORY_GROUP)]
    return (timed, [r for r in records if r["group"] == MEMORY_GROUP],
            [r for r in records if r["group"] == PASSES_GROUP])


def render(data: dict) -> str:
    """The markdown of a result file of this script."""
    timed, memory, passes = split(data["records"])
    suite = data.get("suite", {})
    ran = f" The suites ran at commit {suite['commit'][:7]}{' with changes' if suite.get('dirty') else ''}." \
        if suite.get("commit") else ""
    parts = [f"{describe(data['machine'])}{ran} Medians of each benchmark's rounds (pytest-benchmark); "
             f"× baseline: the time over the baseline's in the same group, shape and mode.", ""]
    if timed:
        parts += [table(timed), ""]
    for section in (memory_section(memory), passes_section(passes)):
        if section:
            parts += [section]
    return "\n".join(parts).rstrip() + "\n"


def write(data: dict, out: Path, json_too: bool = True) -> None:
    """out.json (unless json_too is False), out.md and out.png, from data."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if json_too:
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(data))
    timed = split(data["records"])[0]
    wrote = [out.with_suffix(".md")] + ([out.with_suffix(".png")] if timed and plot(timed, out.with_suffix(".png"))
                                        else [])
    print("wrote " + ", ".join(map(str, ([out.with_suffix(".json")] if json_too else []) + wrote)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", help="pytest-benchmark's JSON file (--benchmark-json)")
    ap.add_argument("--out", default="out/bench/suites", help="prefix of the .json, .md and .png written")
    ap.add_argument("--render", metavar="RESULT_JSON", help="render the .md and .png of a result file again")
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        return write(json.loads(path.read_text()), path.with_suffix(""), json_too=False)
    if not args.json:
        ap.error("give pytest-benchmark's JSON file, or --render RESULT_JSON")
    records, suite = load(args.json)
    data = dict(machine=machine_meta("benchmarks/report.py"), suite=suite, records=records)
    print(render(data))
    write(data, Path(args.out))


if __name__ == "__main__":
    main()
