"""Turns a pytest-benchmark JSON file into a markdown table of ratios and a PNG plot.

    python benchmarks/report.py .benchmarks/latest.json [--out results/bench]

Each benchmark's extra_info names its group, op, provider, mode and shape; the
baseline of a (group, shape, mode) is the benchmark with baseline=True (torch's
softmax for the normalizers, scaled_dot_product_attention for attention).
Rows of group "triton-passes" (bench_triton_passes.py) are counts, not times:
they get their own section.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch

import attnkern


def load(path: str) -> tuple[list[dict], dict]:
    data = json.loads(Path(path).read_text())
    rows = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "group" not in info:
            continue
        rows.append(dict(info, median_ms=b["stats"]["median"] * 1e3, iqr_ms=b["stats"]["iqr"] * 1e3))
    return rows, data.get("machine_info", {})


def table(rows: list[dict]) -> str:
    base = {}
    for r in rows:
        if r.get("baseline"):
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


PASSES_TITLE = "Triton forward passes over K (interpreter, float32)"


def passes_section(rows: list[dict]) -> str:
    """The pass-count table of bench_triton_passes.py; "" without its rows."""
    if not rows:
        return ""
    sys.path.insert(0, str(Path(__file__).parent))
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
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--out", default="results/bench", help="prefix of the .md and .png written")
    args = ap.parse_args()
    rows, machine = load(args.json)
    passes = [r for r in rows if r["group"] == "triton-passes"]
    rows = [r for r in rows if r["group"] != "triton-passes"]
    md = table(rows)
    if passes:
        md += "\n\n" + passes_section(passes)
    cpu = machine.get("cpu", {}).get("brand_raw", platform.processor() or platform.machine())
    level = attnkern.isa.dispatch()
    header = (f"Machine: {cpu}, {machine.get('cpu', {}).get('count', '?')} cores; attnkern CPU kernels at "
              f"{level.get('active', '?')} (this CPU runs up to {level.get('machine', '?')}); torch CPU capability "
              f"{torch.backends.cpu.get_cpu_capability()}; medians of the rounds.\n\n")
    print(header + md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(header + md + "\n")
    if rows and plot(rows, out.with_suffix(".png")):
        print(f"\nwrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
