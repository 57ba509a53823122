"""Helpers shared by the experiment modules: normalizer names, output files, summaries."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from attnkern.experiments import runner

DEFAULT_NORMALIZERS = ("softmax", "sparsemax", "entmax15")
_ENTMAX = re.compile(r"^entmax(?P<alpha>[0-9]*\.?[0-9]+|-learnable)$")


def parse_normalizer(spec: str) -> tuple[str, float | str | None]:
    """"softmax", "sparsemax", "entmax15", "entmax<α>" (e.g. entmax1.25) or
    "entmax-learnable" -> (normalizer, alpha) as the attention modules take them."""
    if spec in DEFAULT_NORMALIZERS:
        return spec, None
    m = _ENTMAX.match(spec or "")
    if m:
        a = m.group("alpha")
        if a == "-learnable":
            return "entmax", "learnable"
        alpha = float(a)
        if alpha > 0 and math.isfinite(alpha):
            return "entmax", alpha
    raise ValueError(f"unknown normalizer {spec!r}: use softmax, sparsemax, entmax15, entmax<alpha> "
                     "(e.g. entmax1.25) or entmax-learnable")


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
    return {"runs_total": len(sweep.results) + len(sweep.failures), "runs_cached": sweep.cached,
            "failures": sweep.failures}


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
