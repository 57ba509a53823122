"""Regenerates the measured parts of the documentation from the committed result files.

    python benchmarks/docs.py           # rewrite them (make docs; make bench ends with it)
    python benchmarks/docs.py --check   # exit 1 when a page differs from what the files give

Generated regions sit between `<!-- begin generated: NAME -->` and
`<!-- end generated: NAME -->` lines; everything outside them is written by
hand. docs/benchmarks.md's region "tables" holds, for every CPU folder under
results/bench/ (machine.cpu_slug), the tables of its `suites.json` (the
pytest-benchmark suites, report.py) and `ratios.json` (ratios.py) and a list of
the folder's other committed runs. The README's region "headline-speed" shows the row-wise
normalizers of the newest suites.json as a plot (written beside it as
headline.png) with the CPU, commit and configuration that produced it; its
region "headline-experiments" a table of the experiments' committed results
(results/experiments/*/: the full-scale importance run, else the relevance
run), or says that none is committed; docs/experiments.md's regions
"importance", "importance-by-class" and "importance-cross-machine" the full-scale
importance tables, its region "committed" a list of every committed experiment result.
docs/transformers.md's region "training" renders the committed training runs of
examples/transformers_train_rotten.py (results/transformers/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ratios  # noqa: E402
import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "results" / "bench"
BENCH_PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
# The headline plot: the row-wise normalizers at this shape, forward and backward.
HEADLINE_SHAPE, HEADLINE_MODE = "4096x1024", "fwdbwd"


def region(text: str, name: str, body: str, page: Path) -> str:
    """text with the generated region `name` replaced by body."""
    pattern = re.compile(rf"(<!-- begin generated: {re.escape(name)} -->\n).*?(<!-- end generated: "
                         rf"{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{page.relative_to(ROOT)} has no region '{name}' (<!-- begin generated: {name} --> ... "
                         f"<!-- end generated: {name} -->)")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text, count=1)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def kind(data: dict) -> str | None:
    """"suites" (report.py), "ratios" (ratios.py) or None for another JSON file."""
    if "records" in data and "machine" in data:
        return "suites"
    if "results" in data and "machine" in data:
        return "ratios"
    return None


def demote(markdown: str, levels: int) -> str:
    """markdown with its headings `levels` deeper, to nest under a CPU's heading."""
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + levels) + " ", markdown, flags=re.M)


def link(path: Path) -> str:
    """A link from docs/ to a file of the repository."""
    return "../" + path.relative_to(ROOT).as_posix()


def run_line(path: Path, data: dict) -> str:
    meta = data["machine"]
    when = f", {meta['date']}" if meta.get("date") else ""
    md = path.with_suffix(".md")
    target = md if md.exists() else path
    return f"- [{path.stem}]({link(target)}): commit {meta.get('commit', '?')}{when}; `{meta.get('command', '?')}`"


def cpu_section(folder: Path) -> str:
    files = {p: load(p) for p in sorted(folder.glob("*.json"))}
    files = {p: d for p, d in files.items() if kind(d)}
    if not files:
        return ""
    main = [folder / "suites.json", folder / "ratios.json", folder / "bands.json", folder / "blockmask.json",
            folder / "structured.json", folder / "transformers.json"]
    newest = max(files.values(), key=lambda d: d["machine"].get("date", ""))
    out = [f"### {newest['machine']['cpu']}", "", f"Result files: `{folder.relative_to(ROOT).as_posix()}/`.", ""]
    for path in main:
        if path not in files:
            continue
        data = files[path]
        if kind(data) == "suites":
            out += ["#### The pytest-benchmark suites", "", demote(report.render(data), 3).rstrip(), ""]
            if path.with_suffix(".png").exists():
                out += [f"![every suite's medians]({link(path.with_suffix('.png'))})", ""]
        elif path.name == "bands.json":
            out += ["#### Windows, packed documents and cache lengths (benchmarks/bands.py)", "",
                    demote(ratios.render(data), 2).rstrip(), ""]
        elif path.name == "blockmask.json":
            out += ["#### FlexAttention BlockMask (benchmarks/bands.py --cases blockmask)", "",
                    demote(ratios.render(data), 2).rstrip(), ""]
        elif path.name == "structured.json":
            out += ["#### Structured normalizers against sparsemax (benchmarks/structured.py)", "",
                    demote(ratios.render(data), 2).rstrip(), ""]
        elif path.name == "transformers.json":
            out += ["#### A transformers model, attnkern against sdpa (benchmarks/transformers_step.py)", "",
                    demote(ratios.render(data), 2).rstrip(), ""]
            check = data["machine"].get("peer_check")
            if check:
                out += ["Logits of hf-attention-normalizers' backends against ours (max |difference|, float32, "
                        "causal, 2 × 64 tokens): " + "; ".join(
                            f"{k}: {v:.2g}" if isinstance(v, float) else f"{k}: {v}" for k, v in check.items()),
                        ""]
        else:
            out += ["#### Ratios against PyTorch (benchmarks/ratios.py)", "", demote(ratios.render(data), 2).rstrip(),
                    ""]
    others = [p for p in files if p not in main]
    if others:
        out += ["#### Other committed runs on this CPU", ""]
        out += [run_line(p, files[p]) for p in sorted(others, key=lambda p: files[p]["machine"].get("date", ""))]
        out += [""]
    return "\n".join(out)


def tables() -> str:
    sections = [cpu_section(f) for f in sorted(p for p in BENCH.iterdir() if p.is_dir())] if BENCH.is_dir() else []
    return "\n".join(s for s in sections if s) or "No committed results yet: run `make bench`."


def newest_suites() -> Path | None:
    found = [(load(p)["machine"].get("date", ""), p) for p in BENCH.glob("*/suites.json")] if BENCH.is_dir() else []
    return max(found)[1] if found else None


def headline_rows(data: dict) -> list[dict]:
    return [r for r in data["records"] if r["group"] == "normalizers" and r["shape"] == HEADLINE_SHAPE
            and r["mode"] == HEADLINE_MODE]


def headline_plot(rows: list[dict], meta: dict, path: Path) -> bool:
    """Grouped bars per op: attnkern, the entmax package, and torch.softmax as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    ops = [r["op"] for r in rows if r["provider"] == "attnkern"]
    by = {(r["op"], r["provider"]): r["median_ms"] for r in rows}
    fig, ax = plt.subplots(figsize=(8, 3.4))
    y = range(len(ops))
    ax.barh([i - 0.2 for i in y], [by[(o, "attnkern")] for o in ops], height=0.4, color="C0", label="attnkern")
    ax.barh([i + 0.2 for i in y], [by.get((o, "entmax"), 0) for o in ops], height=0.4, color="C7",
            label="entmax package")
    if ("softmax", "torch") in by:
        ax.axvline(by[("softmax", "torch")], color="C3", ls="--", lw=1, label="torch.softmax")
    ax.set_yticks(list(y), ops, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"forward + backward, [{HEADLINE_SHAPE.replace('x', ', ')}] float32, median ms (log)", fontsize=8)
    ax.set_title(f"{meta['cpu']}, {meta.get('threads', '?')} threads", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def headline(write_plot: bool) -> str:
    path = newest_suites()
    rows = headline_rows(load(path)) if path else []
    if not rows:
        return "No committed row-wise results yet: run `make bench`."
    meta = load(path)["machine"]
    png = path.with_name("headline.png")
    if write_plot:
        headline_plot(rows, meta, png)
    rel = path.relative_to(ROOT).as_posix()
    return (f"![attnkern against torch.softmax and the entmax package]({png.relative_to(ROOT).as_posix()})\n\n"
            f"Row-wise normalizers, forward and backward on a [{HEADLINE_SHAPE.replace('x', ', ')}] float32 batch "
            f"(medians, log scale). CPU: {meta['cpu']}, {meta.get('threads', '?')} threads, kernels at "
            f"{meta['attnkern_level'].get('active', '?')}; commit {meta.get('commit', '?')}; generated by "
            f"`make docs` from `{rel}`.")


EXPERIMENTS = ROOT / "results" / "experiments"


def _relevance_table(path: Path) -> str:
    """The headline of a committed `relevance` result: τ(a, r) over all tokens and on the support, per data set
    and normalizer, mean ± std over seeds, with its configuration and provenance."""
    data = load(path)
    cfg, prov = data["config"], data["sweep"]["provenance"]

    def cell(c, key, fmt="{:.2f}"):
        v = c.get(key)
        if not v or v[0] is None or v[0] != v[0]:
            return "–"
        return fmt.format(v[0]) + ("" if v[1] is None or v[1] != v[1] else f" ± {fmt.format(v[1])}")

    rows = ["| data | normalizer | τ(a, r), all tokens | τ(a, r), on the support | support coverage |",
            "|---|---|---|---|---|"]
    for ds, cells in data["summary"].items():
        for norm, c in cells.items():
            rows.append(f"| {ds} | {norm} | {cell(c, 'tau_a_r_standard')} | {cell(c, 'tau_a_r_standard_support')} "
                        f"| {cell(c, 'support_coverage')} |")
    scale = "--quick" if cfg.get("quick") else "full scale"
    return (f"Attention against output relevance (after Snell et al.; `relevance`, {scale}, {cfg.get('seeds')} "
            f"seeds, mean ± std over seeds): over all tokens the zeros of sparse attention tie, on the support "
            f"they do not.\n\n" + "\n".join(rows) + f"\n\nCommit {', '.join(c[:7] for c in prov['commits'])}; "
            f"{', '.join(prov['processors'])}; kernels at {', '.join(prov['isa_levels'])}, backend "
            f"{', '.join(prov['backends'])}; generated by `make docs` from `{path.relative_to(ROOT).as_posix()}`.")


def _commit_date(commit: str) -> str | None:
    """The commit date (YYYY-MM-DD) of a commit of this repository, or None where git cannot say."""
    import subprocess

    proc = subprocess.run(["git", "show", "-s", "--format=%cs", commit], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def _provenance_line(results: list[dict], paths: list[Path]) -> str:
    """Commit, machine, kernels, dates and source files of committed experiment results."""
    commits, processors, levels, backends, dates = set(), set(), set(), set(), []
    for d in results:
        prov = d["sweep"]["provenance"]
        commits.update(c[:7] for c in prov["commits"])
        processors.update(prov["processors"])
        levels.update(prov["isa_levels"])
        backends.update(prov["backends"])
        dates += [t[:10] for t in prov.get("started", [])]
    what = "runs of"
    if not dates:  # results written before sweeps recorded their start times: the date of the runs' commit
        dates, what = [d for d in map(_commit_date, commits) if d], "code committed on"
    when = (f"{what} {min(dates)}" + ("" if min(dates) == max(dates) else f" to {max(dates)}")) if dates else ""
    files = ", ".join(f"`{p.relative_to(ROOT).as_posix()}`" for p in paths)
    return (f"Commit {', '.join(sorted(commits))}; {', '.join(sorted(processors))}; kernels at "
            f"{', '.join(sorted(levels))}, backend {', '.join(sorted(backends))}" + (f"; {when}" if when else "")
            + f"; generated by `make docs` from {files}.")


def _processors(data: dict) -> tuple[str, ...]:
    return tuple(data["sweep"]["provenance"]["processors"])


def _first_date(data: dict) -> str:
    """When a result's runs were made: their first start time, else their code's commit date."""
    prov = data["sweep"]["provenance"]
    dates = prov.get("started") or [d for d in map(_commit_date, prov["commits"]) if d]
    return min(dates) if dates else ""


def _all_importance_results() -> list[tuple[Path, dict]]:
    """Every committed full-scale `importance` result (not --quick): embeddings from scratch first, then the
    earliest runs first (the reference a rerun on another machine is checked against)."""
    found = sorted(EXPERIMENTS.glob("*/importance.json")) if EXPERIMENTS.is_dir() else []
    pairs = [(p, load(p)) for p in found]
    pairs = [(p, d) for p, d in pairs if not d.get("quick")]
    pairs.sort(key=lambda pd: (pd[1].get("embeddings", "scratch") != "scratch", _first_date(pd[1]), str(pd[0])))
    return pairs


def _row_key(row: dict) -> tuple[str, str, str]:
    return row["dataset"], row["encoder"], row["normalizer"]


def _with_row_reruns(first: tuple[Path, dict], pairs: list[tuple[Path, dict]]) -> tuple[list[Path], dict]:
    """A full-scale `importance` result with its rows rerun: a later result on the same machine with the same
    embeddings whose rows are all rows of this one (a rerun of some of them, after a fix) replaces those rows,
    the latest last; its provenance joins this one's. Returns the source files and the merged result."""
    path, data = first
    keys = {_row_key(r) for r in data["rows"]}
    later = sorted(((p, d) for p, d in pairs if p != path and _processors(d) == _processors(data)
                    and d.get("embeddings", "scratch") == data.get("embeddings", "scratch")
                    and _first_date(d) > _first_date(data) and {_row_key(r) for r in d["rows"]} <= keys),
                   key=lambda pd: _first_date(pd[1]))
    if not later:
        return [path], data
    rows = {_row_key(r): r for r in data["rows"]}
    provenance = {k: list(v) if isinstance(v, list) else v for k, v in data["sweep"]["provenance"].items()}
    for _, d in later:
        rows.update((_row_key(r), r) for r in d["rows"])
        for k, v in d["sweep"]["provenance"].items():
            if isinstance(v, list):
                provenance[k] = list(dict.fromkeys(provenance.get(k, []) + v))
    merged = dict(data, rows=[rows[_row_key(r)] for r in data["rows"]],
                  sweep=dict(data["sweep"], provenance=provenance))
    return [path] + [p for p, _ in later], merged


def _importance_results() -> tuple[list[Path], list[dict]]:
    """The committed full-scale `importance` results of the reference machine (the CPU of the first result with
    embeddings from scratch), that one first, and the earliest of each other kind of embeddings: Table 2's runs,
    each with its rows rerun on that machine (_with_row_reruns). Reruns on other machines are for
    importance_cross_machine; a later run with the same embeddings and rows of its own is another study (the
    structured normalizers'), which docs/experiments.md links and committed_experiments lists."""
    pairs = _all_importance_results()
    paths, results = [], []
    if pairs:
        reference = _processors(pairs[0][1])
        same = [(p, d) for p, d in pairs if _processors(d) == reference]
        first_of_each = {}
        for p, d in same:
            first_of_each.setdefault(d.get("embeddings", "scratch"), (p, d))
        for first in first_of_each.values():
            sources, merged = _with_row_reruns(first, same)
            paths += sources
            results.append(merged)
    return paths, results


def importance_cross_machine() -> str:
    """Whether the full-scale `importance` means measured on another machine fall within the reference machine's
    95% intervals (the same configuration rerun: results differ across CPU vendors in the floating-point paths of
    training, so the intervals, not the digits, are the criterion)."""
    pairs = _all_importance_results()
    if not pairs:
        return "No full-scale `importance` result is committed yet (`results/experiments/`)."
    ref_paths, ref = _with_row_reruns(pairs[0], pairs)
    ref_path = ref_paths[0]
    others = [(p, d) for p, d in pairs if _processors(d) != _processors(ref)
              and d.get("embeddings", "scratch") == ref.get("embeddings", "scratch")]
    if not others:
        return ("Not yet rerun on another machine: run the same command on a CPU of the other vendor and commit "
                "its results under `results/experiments/<name>-<cpu>/`; this check then compares every row with "
                f"`{ref_path.relative_to(ROOT).as_posix()}`.")
    keyed = {_row_key(r): r for r in ref["rows"]}
    # Each row from the latest rerun that has it (a later rerun of some rows, after a fix, replaces them).
    latest = {}
    for _, d in sorted(others, key=lambda pd: _first_date(pd[1])):
        for r in d["rows"]:
            latest[_row_key(r)] = (r, d)
    header = ("| data | encoder | attention | statistic | reference mean [95%] | rerun mean | rerun machine, commit "
              "| within |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    inside = total = 0
    for key in sorted(latest):
        r, d = latest[key]
        base = keyed.get(key)
        if base is None:
            continue
        for prefix, label in (("gradient", "τ_g"), ("loo", "τ_loo")):
            lo_hi, mean = base.get(f"{prefix}_tau_ci"), r.get(f"{prefix}_tau_mean")
            if not lo_hi or None in lo_hi or mean is None or mean != mean:
                continue
            ok = lo_hi[0] <= mean <= lo_hi[1]
            inside, total = inside + ok, total + 1
            lines.append(f"| {r['dataset']} | {r['encoder']} | {r['normalizer']} | {label} | "
                         f"{base[f'{prefix}_tau_mean']:.3f} [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}] | {mean:.3f} | "
                         f"{', '.join(_processors(d))}, "
                         f"{', '.join(c[:7] for c in d['sweep']['provenance']['commits'])} | "
                         f"{'yes' if ok else 'no'} |")
    return (f"The reference run rerun on another machine: {inside} of {total} means within the reference's 95% "
            "intervals.\n\n" + "\n".join(lines) + "\n\n"
            + _provenance_line([ref] + [d for _, d in others], ref_paths + [p for p, _ in others]))


def importance_table() -> str:
    """Jain & Wallace's Table 2 at full scale from the committed `importance` results: every row of the
    from-scratch run and, beside its softmax rows, the word2vec rows; with the paper's and the authors' released
    reference cells and the statistics on the support that the ties of sparse attention cannot inflate."""
    from attnkern.experiments.interpret.importance import PAPER_TABLE2, RELEASED_TABLE2, _fmt, _paper_cells

    paths, results = _importance_results()
    if not results:
        return "No full-scale `importance` result is committed yet (`results/experiments/`)."

    def ci(row, prefix):
        return _fmt(row.get(f"{prefix}_tau_mean"), ci=row.get(f"{prefix}_tau_ci"))

    def support(row):
        mean = row.get("gradient_support_tau_mean")
        if row["normalizer"] == "softmax" or mean is None or mean != mean:
            return "(all)" if row["normalizer"] == "softmax" else "–"
        return f"{mean:.2f} ({row['support_mean']:.1f} of {row['length_mean']:.1f} tokens)"

    def top3(row):
        value, coverage = row["gradient_topk"]["3"], row["gradient_topk_coverage"]["3"]
        return "–" if value is None or value != value else f"{value:.2f} ({coverage:.2f})"

    def refs(row, source):
        grad, loo = _paper_cells(row["dataset"], row["encoder"], None, source)
        return grad.replace("; ", "<br>"), loo.replace("; ", "<br>")

    main, extra = results[0], results[1:]
    by_key = {(e.get("embeddings"), r["dataset"], r["encoder"], r["normalizer"]): r for e in extra for r in e["rows"]}
    header = ("| data | encoder | attention | embeddings | acc | τ_g [95%] | τ_g on the support (support) | "
              "top-3 agreement (coverage) | τ_loo [95%] | paper τ_g | authors' files τ_g | paper τ_loo | "
              "authors' files τ_loo |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in main["rows"]:
        rows = [(main.get("embeddings", "scratch"), r)]
        if r["normalizer"] == "softmax":
            rows += [(e.get("embeddings"), by_key[(e.get("embeddings"), r["dataset"], r["encoder"], "softmax")])
                     for e in extra if (e.get("embeddings"), r["dataset"], r["encoder"], "softmax") in by_key]
        for embeddings, row in rows:
            first = embeddings == main.get("embeddings", "scratch") and row["normalizer"] == "softmax"
            pg, pl = refs(row, PAPER_TABLE2) if first else ("", "")
            rg, rl = refs(row, RELEASED_TABLE2) if first else ("", "")
            lines.append(f"| {row['dataset']} | {row['encoder']} | {row['normalizer']} | {embeddings} | "
                         f"{row['accuracy']:.3f} | {ci(row, 'gradient')} | {support(row)} | {top3(row)} | "
                         f"{ci(row, 'loo')} | "
                         f"{pg} | {rg} | {pl} | {rl} |")
    seeds = sorted({str(d["seeds"]) for d in results})
    cfg = ("embeddings of 200, hidden 128, batch 32, Adam 1e-3, 10 epochs (best dev epoch kept), texts cut to 80 "
           "tokens, every test instance")
    return ("Jain & Wallace's Table 2 at the full configuration (`importance`, "
            f"{'/'.join(seeds)} seeds per model; {cfg}). τ: Kendall τ-b between attention and gradient (τ_g) or "
            "leave-one-out (τ_loo) importance, mean over the test instances of all seeds [95% interval: nested "
            "bootstrap over seeds, then instances]. For sparse attention, τ_g over the support only (the zeros "
            "outside it tie) and the support's size. Top-3 agreement: the fraction of attention's 3 highest "
            "tokens among gradient importance's 3 highest, over the instances whose attention has more than 3 "
            "non-zero tokens (coverage: their fraction; with 3 or fewer the tied zeros agree by construction). "
            "The reference cells are per predicted class (c0, c1): the "
            "paper's Table 2 and the result files its authors released (a different run). Our data stand beside "
            "the paper's nearest rows: Rotten Tomatoes snippets (rt) beside SST, rated tweets beside ADR Tweets; "
            "the embeddings were trained from scratch or started from word2vec vectors trained on unlabelled "
            "text without the test split (the paper used pretrained vectors).\n\n"
            + "\n".join(lines) + "\n\n" + _provenance_line(results, paths))


def importance_by_class() -> str:
    """The softmax rows of the committed full-scale `importance` results per predicted class, beside the paper's
    cells and the authors' released ones (Table 2 is per predicted class)."""
    from attnkern.experiments.interpret.importance import PAPER_TABLE2, RELEASED_TABLE2, _fmt, _paper_cells

    paths, results = _importance_results()
    if not results:
        return "No full-scale `importance` result is committed yet (`results/experiments/`)."

    def cell(c, prefix):
        return _fmt(c.get(f"{prefix}_tau_mean"), c.get(f"{prefix}_tau_std"), c.get(f"{prefix}_sig_frac"),
                    c.get(f"{prefix}_tau_ci"))

    header = ("| data | encoder | embeddings | pred. class | n | τ_g ours | τ_g paper | τ_g authors' files | "
              "τ_loo ours | τ_loo paper | τ_loo authors' files |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for d in results:
        for r in d["rows"]:
            if r["normalizer"] != "softmax":
                continue
            for cls, c in sorted(r["by_class"].items()):
                pg, pl = _paper_cells(r["dataset"], r["encoder"], int(cls), PAPER_TABLE2)
                rg, rl = _paper_cells(r["dataset"], r["encoder"], int(cls), RELEASED_TABLE2)
                lines.append(f"| {r['dataset']} | {r['encoder']} | {d.get('embeddings', 'scratch')} | {cls} | "
                             f"{c['instances']} | {cell(c, 'gradient')} | {pg} | {rg} | {cell(c, 'loo')} | {pl} | "
                             f"{rl} |")
    return ("Softmax attention per predicted class, as the paper's Table 2 gives it: mean ± std over the "
            "instances [95% interval of the mean] (fraction with p ≤ 0.05).\n\n" + "\n".join(lines) + "\n\n"
            + _provenance_line(results, paths))


def committed_experiments() -> str:
    """A list of every committed experiment result (results/experiments/*/*.json with its markdown): experiment,
    scale, seeds, embeddings where they apply, machine, commit and dates."""
    found = sorted(EXPERIMENTS.glob("*/*.json")) if EXPERIMENTS.is_dir() else []
    items = []
    for path in found:
        data = load(path)
        if "experiment" not in data or "sweep" not in data or not path.with_suffix(".md").exists():
            continue
        prov = data["sweep"]["provenance"]
        # (the interpretability experiments keep their scale at the top level, the dynamics ones in "config")
        config = data.get("config", {})
        scale = "--quick" if data.get("quick", config.get("quick")) else "full configuration"
        seeds = data.get("seeds") or config.get("seeds")
        parts = [scale] + ([f"{seeds} seed{'s' if seeds != 1 else ''}"] if seeds else [])
        if data.get("embeddings"):
            parts.append(f"embeddings {data['embeddings']}")
        parts += [", ".join(prov["processors"]), "commit " + ", ".join(c[:7] for c in prov["commits"])]
        dates = sorted({t[:10] for t in prov.get("started", [])})
        if dates:
            parts.append(" to ".join(dict.fromkeys([dates[0], dates[-1]])))
        md = path.with_suffix(".md").relative_to(ROOT).as_posix()
        items.append(f"- `{data['experiment']}`: [{md}](../{md}) ({'; '.join(parts)})")
    if not items:
        return "No experiment result is committed yet (`results/experiments/`)."
    return "\n".join(items) + "\n\nGenerated by `make docs` from the JSON beside each markdown file."


def copy_alignment() -> str:
    """docs/experiments.md's table of the copy task's attention alignment: for every committed copy result, per
    distribution and normalizer, the seeds whose attention accuracy at their last evaluation reached
    copy_task.ALIGNED (computed from the per-seed curves, so results written before the count existed have it)."""
    from attnkern.experiments.dynamics import copy_task

    found = sorted(EXPERIMENTS.glob("*/copy.json")) if EXPERIMENTS.is_dir() else []
    rows = []
    for path in found:
        data = load(path)
        scale = data["config"]["scale"]
        where = (f"[{path.parent.name}]({link(path.with_suffix('.md'))}) (hidden {scale['hidden_dim']}, budget "
                 f"{scale['steps']}, output {scale.get('output', 'combined')})")
        for dist, cells in copy_task.aligned_seeds(data["summary"]["curves"]).items():
            for norm, (aligned, seeds) in cells.items():
                token = data["summary"]["success_rate"][dist][norm]
                rows.append(f"| {where} | {dist} | {norm} | {aligned} of {seeds} | {token:.2f} |")
    if not rows:
        return "No copy result is committed yet (`results/experiments/`)."
    head = ["| result | distribution | normalizer | attention aligned (seeds) | token-accuracy success rate |",
            "|---|---|---|---|---|"]
    return "\n".join(head + rows) + (f"\n\nAttention aligned: attention accuracy >= {copy_task.ALIGNED} at the "
                                     "seed's last evaluation. Generated by `make docs` from the committed copy.json "
                                     "files.")


def experiments_headline() -> str:
    """The README's experiments table, from the committed results (results/experiments/*/): the full-scale
    `importance` table when one is committed, else the newest `relevance` run."""
    if _importance_results()[1]:
        return importance_table()
    found = sorted(EXPERIMENTS.glob("*/relevance.json")) if EXPERIMENTS.is_dir() else []
    if not found:
        return ("No experiment result files are committed yet (`results/experiments/`); "
                "[docs/experiments.md](docs/experiments.md) keeps the tables of earlier runs.")
    return _relevance_table(found[-1])


EXPERIMENTS_PAGE = ROOT / "docs" / "experiments.md"
TRANSFORMERS_RESULTS = ROOT / "results" / "transformers"
TRANSFORMERS_PAGE = ROOT / "docs" / "transformers.md"


def transformers_training() -> str:
    """docs/transformers.md's training table and curves, from results/transformers/*.json (rendered by the
    script that wrote them, examples/transformers_train_rotten.py)."""
    found = sorted(TRANSFORMERS_RESULTS.glob("*.json")) if TRANSFORMERS_RESULTS.is_dir() else []
    if not found:
        return "No training result is committed yet (`results/transformers/`)."
    spec = importlib.util.spec_from_file_location("transformers_train_rotten",
                                                  ROOT / "examples" / "transformers_train_rotten.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = []
    for path in found:
        out.append(script.render(load(path)).rstrip())
        if path.with_suffix(".png").exists():
            out.append(f"\n![training curves]({link(path.with_suffix('.png'))})")
        out.append(f"\nGenerated by `make docs` from `{path.relative_to(ROOT).as_posix()}`.\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = ap.parse_args(argv)
    stale = []
    pages = {BENCH_PAGE: {"tables": tables()},
             README: {"headline-speed": headline(not args.check), "headline-experiments": experiments_headline()},
             TRANSFORMERS_PAGE: {"training": transformers_training()},
             EXPERIMENTS_PAGE: {"committed": committed_experiments(), "copy-alignment": copy_alignment(),
                                "importance": importance_table(),
                                "importance-by-class": importance_by_class(),
                                "importance-cross-machine": importance_cross_machine()}}
    for page, regions in pages.items():
        text = new = page.read_text()
        for name, body in regions.items():
            new = region(new, name, body, page)
        if new != text:
            stale.append(page.relative_to(ROOT).as_posix())
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("out of date with results/: " + ", ".join(stale) + " (run `make docs`)")
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
