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


def failures_md(sweep: runner.Sweep) -> str:
    if not sweep.failures:
        return ""
    lines = ["", "## Failed runs", ""]
    for name, err in sorted(sweep.failures.items()):
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
