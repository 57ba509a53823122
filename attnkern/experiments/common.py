"""Helpers shared by the experiment modules: normalizer names, output files, summaries, the dynamics
experiments' scale, jobs and side-by-side training."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from attnkern.experiments import runner
from attnkern.family import CHAIN_NORMALIZERS

DEFAULT_NORMALIZERS = ("softmax", "sparsemax", "entmax15")
_ENTMAX = re.compile(r"^entmax(?P<alpha>[0-9]*\.?[0-9]+|-learnable)$")
_STRUCTURED = re.compile(r"^(?P<name>fusedmax|oscarmax)(?P<lam>[0-9]*\.?[0-9]+)?$")
NORMALIZER_HELP = ("softmax, sparsemax, entmax15, entmax<alpha> (e.g. entmax1.25), entmax-learnable, "
                   "fusedmax[<lam>], oscarmax[<lam>] (e.g. fusedmax0.1; lam 1 if not given), crf, sparsemap")


def parse_normalizer(spec: str) -> tuple[str, dict]:
    """A --normalizers entry -> (normalizer, its parameters) as the attention
    modules take them: "softmax", "sparsemax", "entmax15" -> {}; "entmax<α>"
    (e.g. entmax1.25) or "entmax-learnable" -> {"alpha": ...};
    "fusedmax[<λ>]", "oscarmax[<λ>]" -> {"lam": λ (1.0 if not given)};
    "crf", "sparsemap" -> {} (chain marginals, attnkern.family.CHAIN_NORMALIZERS)."""
    if spec in DEFAULT_NORMALIZERS or spec in CHAIN_NORMALIZERS:
        return spec, {}
    m = _ENTMAX.match(spec or "")
    if m:
        a = m.group("alpha")
        if a == "-learnable":
            return "entmax", {"alpha": "learnable"}
        alpha = float(a)
        if alpha > 0 and math.isfinite(alpha):
            return "entmax", {"alpha": alpha}
    m = _STRUCTURED.match(spec or "")
    if m:
        lam = 1.0 if m.group("lam") is None else float(m.group("lam"))
        if math.isfinite(lam):
            return m.group("name"), {"lam": lam}
    raise ValueError(f"unknown normalizer {spec!r}: use {NORMALIZER_HELP}")


def gives_marginals(spec: str) -> bool:
    """Whether a --normalizers entry gives chain marginals, not distributions."""
    return spec in CHAIN_NORMALIZERS


def to_jsonable(x):
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_outputs(out: Path, name: str, result: dict, markdown: str) -> None:
    """OUT/<name>.json (every number) and OUT/<name>.md, written whole (temp file, then rename)."""
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(to_jsonable(result), indent=1)), (".md", markdown)):
        path = out / f"{name}{suffix}"
        tmp = path.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def sweep_block(sweep: runner.Sweep) -> dict:
    """The sweep's counts, failures, and the provenance of the runs behind the
    results (each run's own, also when it was served from the cache): the
    distinct commits, machines, instruction-set levels, backends, code and data
    fingerprints, the first and last start time, and the total compute time."""
    metas = [r.get("meta", {}) for r in sweep.results.values()]

    def distinct(key):
        return sorted({str(m.get(key)) for m in metas})

    starts = sorted(m["started"] for m in metas if m.get("started"))
    data: dict[str, list] = {}
    for r in sweep.results.values():
        for name, digest in (r.get("data") or {}).items():
            data.setdefault(name, [])
            if digest not in data[name]:
                data[name].append(digest)
    return {"runs_total": len(sweep.results) + len(sweep.failures), "runs_cached": sweep.cached,
            "runs_stale": sweep.stale, "failures": sweep.failures,
            "provenance": {"commits": distinct("attnkern_commit"), "processors": distinct("processor"),
                           "isa_levels": distinct("isa_level"), "backends": distinct("backend"),
                           "torch": distinct("torch"), "code_fingerprints": distinct("code_fingerprint"),
                           "data": data, "run_seconds": sum(r.get("seconds", 0.0) for r in sweep.results.values()),
                           "started": [min(starts), max(starts)] if starts else []}}


def failures_md(failures: dict) -> str:
    """A markdown list of the failed runs (name: first line of the error), or ""."""
    if not failures:
        return ""
    lines = ["", "## Failed runs", ""]
    for name, err in sorted(failures.items()):
        lines.append(f"- `{name}`: {err.splitlines()[0]}")
    return "\n".join(lines) + "\n"


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def mean_std(xs) -> tuple[float, float]:
    a = np.asarray([x for x in xs if x is not None], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std())


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out: Path, name: str, dpi: int = 110) -> str:
    """Lays the figure out, writes it as OUT/<name> and closes it; returns the name."""
    fig.tight_layout()
    fig.savefig(Path(out) / name, dpi=dpi)
    pyplot().close(fig)
    return name


def run_sweep(args, fn, jobs: list[runner.Job], desc: str | None = None, namespace: str | None = None) -> runner.Sweep:
    """Runs jobs with the CLI's executor options, caching under OUT/cache/<namespace>/ (the
    experiment's name by default; experiments that run the same jobs share a namespace)."""
    namespace = namespace or args.experiment
    return runner.run_jobs(fn, jobs, Path(args.out) / "cache" / namespace, experiment=namespace,
                           n_jobs=args.jobs, executor=args.executor, scheduler=args.scheduler,
                           progress=getattr(args, "progress", True), desc=desc or args.experiment)


def common_config(args) -> dict:
    """The CLI options every experiment records."""
    return {"quick": bool(args.quick), "backend": args.backend, "device": args.device,
            "normalizers": list(args.normalizers), "jobs": args.jobs, "executor": args.executor}


# --- the dynamics experiments (copy, multihead, ktiw, ibm1, relevance): scale, jobs, twin training, summaries ---


def override_scale(scale: dict, args, options: dict, cap_eval_every: bool = True) -> dict:
    """``scale`` with the positive-int CLI options the user gave: ``options`` maps an argument's attribute name
    to the scale keys it sets (e.g. {"hidden": ("hidden_dim", "embed_dim")}). With ``cap_eval_every``, a --steps
    override also caps eval_every at a quarter of the steps, so a short run still has a curve.
    ValueError naming the option for a value < 1."""
    for opt, keys in options.items():
        v = getattr(args, opt, None)
        if v is None:
            continue
        if v < 1:
            raise ValueError(f"--{opt.replace('_', '-')} must be a positive int, got {v}")
        for key in keys:
            scale[key] = v
        if opt == "steps" and cap_eval_every:
            scale["eval_every"] = max(1, min(scale["eval_every"], v // 4 or 1))
    return scale


def scale_and_seeds(args, quick: dict, full: dict, options: dict, cap_eval_every: bool = True) -> tuple[dict, int]:
    """The --quick or full scale (without its "seeds") with :func:`override_scale` applied, and the number of
    seeds per cell: --seeds when given, else the scale's."""
    scale = dict(quick if args.quick else full)
    seeds = args.seeds or scale.pop("seeds")
    scale.pop("seeds", None)
    return override_scale(scale, args, options, cap_eval_every), seeds


def cell_jobs(cells, normalizers, seeds: int, config_for) -> list[runner.Job]:
    """One job per (cell, normalizer, seed) named "<cell>/<normalizer>/seed<s>" (the names :func:`cell_results`
    reads back), with the config ``config_for(cell, normalizer)``."""
    jobs = []
    for cell in cells:
        for norm in normalizers:
            cfg = config_for(cell, norm)
            jobs += [runner.Job(f"{cell}/{norm}/seed{s}", cfg, s) for s in range(seeds)]
    return jobs


def cell_results(sweep: runner.Sweep, cell: str, normalizer: str, seeds: int) -> dict:
    """{"seed<s>": result} of the completed runs of one (cell, normalizer) of :func:`cell_jobs`, in seed order."""
    out = {}
    for s in range(seeds):
        rec = sweep.results.get(f"{cell}/{normalizer}/seed{s}")
        if rec is not None:
            out[f"seed{s}"] = rec["result"]
    return out


def collect_cells(sweep: runner.Sweep, cells, normalizers, seeds: int, keys, per_seed=()) -> dict:
    """{cell: {normalizer: summary}} over the completed runs whose results hold a curve and its "final" values:
    "runs", (mean, std) over seeds of each of ``keys`` found in "final", "curves" {"seed<s>": curve}, and each
    result entry named in ``per_seed`` as {"seed<s>": entry}. A (cell, normalizer) without runs is left out."""
    out = {}
    for cell in cells:
        out[cell] = {}
        for norm in normalizers:
            res = cell_results(sweep, cell, norm, seeds)
            if not res:
                continue
            first = next(iter(res.values()))
            summary = {"runs": len(res)}
            for k in keys:
                if k in first["final"]:
                    summary[k] = mean_std([r["final"][k] for r in res.values()])
            summary["curves"] = {s: r["curve"] for s, r in res.items()}
            for name in per_seed:
                if name in first:
                    summary[name] = {s: r[name] for s, r in res.items()}
            out[cell][norm] = summary
    return out


def write_dynamics_result(args, experiment: str, config: dict, markdown, **fields) -> dict:
    """A dynamics experiment's result: its name, ``config``, the run's metadata (:func:`runner.metadata`) and
    ``fields`` (paper, summary, sweep, reading, plots, ...), written as OUT/<experiment>.json and .md
    (``markdown(result)``)."""
    result = {"experiment": experiment, "config": config, "meta": invocation_meta(config), **fields}
    write_outputs(args.out, experiment, result, markdown(result))
    return result


def invocation_meta(config: dict | None = None) -> dict:
    """The provenance of this invocation (:func:`runner.metadata`), labelled as such: the runs behind the numbers
    may come from the cache, other commits or machines, and are described by the sweep's "provenance"."""
    return {**runner.metadata(config), "of": "this invocation; the runs behind the numbers: sweep.provenance"}


def markdown_end(lines: list[str], result: dict, paper: str | None = None, notes=(), plots_label: str = "Plots") -> str:
    """A dynamics experiment's markdown: its ``lines``, then what the paper says (when given), the reading, the
    ``notes`` (one paragraph each), the list of plots and the failed runs, as one text."""
    if paper is not None:
        lines = lines + ["## The paper", "", paper, ""]
    lines = lines + ["## Reading", "", result["reading"], ""]
    for note in notes:
        lines += [note, ""]
    lines += [f"{plots_label}: " + ", ".join(f"`{p}`" for p in result["plots"]), ""]
    return "\n".join(lines) + failures_md(result["sweep"]["failures"])


def fmt_mean_std(ms) -> str:
    """A (mean, std) pair as "0.123 ± 0.045" ("n/a" for None)."""
    return "n/a" if ms is None else f"{ms[0]:.3f} ± {ms[1]:.3f}"


def forward_eval(models, *inputs) -> list:
    """Each model's output for ``inputs``, computed in eval mode; the models are left in training mode."""
    for m in models:
        m.eval()
    outs = [m(*inputs) for m in models]
    for m in models:
        m.train()
    return outs


def train_side_by_side(std, uni, config: dict, measure, next_batch, loss_fn) -> dict:
    """Trains a standard model ``std`` and its uniform-attention twin ``uni`` (which starts from std's parameters)
    on the same batches, one Adam (lr config["lr"]) each, for config["steps"] steps: ``next_batch()`` draws a
    batch, ``loss_fn(model, batch)`` is a model's loss on it. ``measure(std, uni)`` (a dict of numbers) at step 0,
    every config["eval_every"] steps and after the last step makes the curve.
    Returns {"curve": {"step": [...], name: [...]}, "final": {name: value after the last step}}."""
    uni.load_state_dict(std.state_dict())  # the same starting point
    models = (std, uni)
    opts = [torch.optim.Adam(m.parameters(), lr=config["lr"]) for m in models]
    curve = {"step": []}
    for step in range(config["steps"] + 1):
        if step % config["eval_every"] == 0 or step == config["steps"]:
            rec = measure(std, uni)
            curve["step"].append(step)
            for k, v in rec.items():
                curve.setdefault(k, []).append(v)
        if step == config["steps"]:
            break
        batch = next_batch()
        for model, opt in zip(models, opts, strict=True):
            loss = loss_fn(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return {"curve": curve, "final": {k: v[-1] for k, v in curve.items() if k != "step"}}


def kendall_tau_rows(x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Kendall's τ-b between x[..., :] and y[..., :] row by row over the positions where
    mask is True (vectorized; equals scipy.stats.kendalltau per row). Rows with fewer
    than 2 positions, or where x or y is constant, give NaN.

    x, y: (..., T) floats; mask: (..., T) bool (broadcast to x's shape)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    mask = np.broadcast_to(np.asarray(mask, dtype=bool), x.shape)
    dx = np.sign(x[..., :, None] - x[..., None, :])
    dy = np.sign(y[..., :, None] - y[..., None, :])
    pair = mask[..., :, None] & mask[..., None, :]
    pair = np.triu(pair, k=1) if pair.ndim == 2 else pair & np.triu(np.ones(pair.shape[-2:], dtype=bool), 1)
    s = (dx * dy * pair).sum((-1, -2))
    nx = ((dx != 0) & pair).sum((-1, -2))
    ny = ((dy != 0) & pair).sum((-1, -2))
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = s / np.sqrt(nx.astype(float) * ny)
    return np.where((nx > 0) & (ny > 0), tau, np.nan)


def shuffle_rows(x: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """x with the real positions (mask True, a prefix of each row) permuted within each row."""
    x = np.array(x, dtype=float, copy=True)
    flat, m = x.reshape(-1, x.shape[-1]), np.broadcast_to(mask, x.shape).reshape(-1, x.shape[-1])
    for i in range(flat.shape[0]):
        n = int(m[i].sum())
        flat[i, :n] = flat[i, :n][rng.permutation(n)]
    return flat.reshape(x.shape)
