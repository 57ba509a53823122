"""`attnkern-exp`: run an attention experiment, or fetch its data.

    attnkern-exp list
    attnkern-exp data fetch [NAME|all] [--force]
    attnkern-exp data list
    attnkern-exp <experiment> --out DIR [--quick] [--seeds N] [--normalizers ...]
        [--backend auto|reference] [--jobs N] [--executor joblib|dask] [--scheduler ADDRESS]
        [--device cpu|cuda] [experiment options]

Bad arguments give a one-line error naming the argument (exit status 2); a
run-time failure (e.g. missing data) a one-line error (exit status 1).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

from attnkern.experiments.common import DEFAULT_NORMALIZERS, NORMALIZER_HELP, gives_marginals, parse_normalizer
from attnkern.experiments.registry import EXPERIMENTS

PROG = "attnkern-exp"


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def _positive(name):
    def conv(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {text!r}")
        return v
    return conv


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (results, plots, run cache)")
    p.add_argument("--quick", action="store_true", help="the reduced configuration (minutes on 2 cores)")
    p.add_argument("--seeds", type=_positive("--seeds"), default=None, help="seeds per configuration")
    p.add_argument("--normalizers", nargs="+", default=list(DEFAULT_NORMALIZERS),
                   help=NORMALIZER_HELP + " (crf and sparsemap, chain marginals rather than distributions, "
                        "only where the experiment's metrics allow them: importance, permutation, copy)")
    p.add_argument("--backend", default="auto", choices=("auto", "kernels", "reference"),
                   help="auto: attnkern's compiled kernels, or the reference where they did not load (said in the "
                        "summary and the JSON); kernels: the compiled kernels or an error; reference: the float64 "
                        "reference")
    p.add_argument("--jobs", type=_positive("--jobs"), default=1, help="parallel runs")
    p.add_argument("--executor", default="joblib", choices=("joblib", "dask"))
    p.add_argument("--scheduler", default=None, help="dask scheduler address (with --executor dask)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def validate(args) -> None:
    """Checks the common options; raises UsageError naming the argument."""
    for spec in args.normalizers:
        try:
            parse_normalizer(spec)
        except ValueError as exc:
            raise UsageError(f"argument --normalizers: {exc}") from None
    if len(set(args.normalizers)) != len(args.normalizers):
        raise UsageError("argument --normalizers: a normalizer is listed twice")
    if args.scheduler is not None and args.executor != "dask":
        raise UsageError("argument --scheduler: only used with --executor dask")
    if args.executor == "dask":
        try:
            import dask.distributed  # noqa: F401
        except ImportError:
            raise UsageError("argument --executor: dask is not installed (pip install 'dask[distributed]')") from None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("argument --device: cuda is not available on this machine")
    if args.backend == "kernels":
        from attnkern import _extension

        if not _extension.LOADED:
            raise UsageError(f"argument --backend: kernels: attnkern's compiled kernels did not load "
                             f"({_extension.LOAD_ERROR or 'no extension'})")
        args.backend = "auto"  # (which resolves to the kernels now; the runs record the backend they used)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test"):
            pass
    except OSError as exc:
        raise UsageError(f"argument --out: cannot write to {out} ({exc.strerror or exc})") from None
    args.out = out


def _data_command(argv) -> int:
    from attnkern.experiments.data import sources as data

    p = _Parser(prog=f"{PROG} data")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, verify and extract into the cache")
    f.add_argument("name", nargs="?", default="all", help=f"one of {', '.join(data.SOURCES)}, or all")
    f.add_argument("--force", action="store_true", help="fetch again even if cached")
    sub.add_parser("list", help="the sources and whether they are cached")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for name, src in data.SOURCES.items():
            cached = (data.cache_root() / name / data._DONE).exists()
            print(f"{name:8s} {src.requirement:24s} {'cached' if cached else 'not fetched':12s} {src.description}")
        return 0
    if args.name != "all" and args.name not in data.SOURCES:
        raise UsageError(f"argument name: unknown dataset {args.name!r} (known: {', '.join(data.SOURCES)}, all)")
    for name, path in data.fetch_all(args.name, force=args.force).items():
        print(f"{name}: {path}")
    return 0


def build_parser(name: str):
    module = importlib.import_module(EXPERIMENTS[name])
    p = _Parser(prog=f"{PROG} {name}", description=(module.__doc__ or "").strip().splitlines()[0])
    add_common_arguments(p)
    module.add_arguments(p)
    return p, module


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__.strip())
            print("\nexperiments: " + ", ".join(EXPERIMENTS))
            return 0
        cmd = argv[0]
        if cmd == "list":
            for name, mod in EXPERIMENTS.items():
                doc = (importlib.import_module(mod).__doc__ or "").strip().splitlines()
                print(f"{name:12s} {doc[0] if doc else ''}")
            return 0
        if cmd == "data":
            return _data_command(argv[1:])
        if cmd not in EXPERIMENTS:
            raise UsageError(f"argument experiment: unknown experiment {cmd!r} "
                             f"(known: {', '.join(EXPERIMENTS) or 'none'}, data, list)")
        parser, module = build_parser(cmd)
        args = parser.parse_args(argv[1:])
        # The experiment's own options, before validate() creates the output directory.
        marginals = [s for s in args.normalizers if gives_marginals(s)]
        if marginals and not getattr(module, "ACCEPTS_MARGINALS", False):
            takes = [n for n, mod in EXPERIMENTS.items()
                     if getattr(importlib.import_module(mod), "ACCEPTS_MARGINALS", False)]
            raise UsageError(f"argument --normalizers: {', '.join(marginals)} give chain marginals, not "
                             f"distributions, which {cmd}'s metrics need; they run in {', '.join(takes)}")
        check = getattr(module, "check_arguments", None)
        if check is not None:
            try:
                check(args)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        validate(args)
        args.experiment = cmd
        result = module.run(args)
        sweep = (result or {}).get("sweep", {})
        failures = sweep.get("failures", {})
        failed = sorted(failures)
        first = f"{failed[0]}: {failures[failed[0]].strip().splitlines()[0]}" if failed else ""
        if failed and len(failed) >= sweep.get("runs_total", len(failed)):
            # Nothing to report (e.g. missing data): one line with the first reason.
            print(f"{PROG}: error: all {len(failed)} run(s) failed; {first}", file=sys.stderr)
            return 1
        print(f"{cmd}: results (JSON, markdown, PNG) in {args.out}")
        backends = sweep.get("provenance", {}).get("backends", [])
        if args.backend == "auto" and "reference" in backends:
            print(f"{PROG}: note: runs used the float64 reference backend, not compiled kernels "
                  f"(backends: {', '.join(backends)})", file=sys.stderr)
        if failed:
            print(f"{PROG}: {len(failed)} run(s) failed (the others are kept; rerun to retry): "
                  + ", ".join(failed) + f"; {first}", file=sys.stderr)
            return 1
        return 0
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (finished runs are cached; run the same command to resume)", file=sys.stderr)
        return 130
    except Exception as exc:
        from attnkern.experiments.data.sources import DataUnavailable

        if isinstance(exc, (DataUnavailable, FileNotFoundError, ValueError)) and not os.environ.get("ATTNKERN_DEBUG"):
            print(f"{PROG}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
