"""The GPU check: on a bare GPU machine, one command that builds attnkern, runs
every test of a GPU path, checks the kernels against the float64 reference and
times them against PyTorch and AdaSplash.

    make gpu-wheels                                  # here: peers' wheels + commit into .gpu-wheels/
    python benchmarks/gpu_check.py --out DIR         # there: report.json, report.md, logs in DIR
    python benchmarks/gpu_check.py --out DIR --rerun OLD/report.json   # only what failed or did not finish
    python benchmarks/gpu_check.py --out DIR --dry-run                 # here, under the Triton interpreter
    python benchmarks/gpu_check.py --render results/gpu/NAME/report.json  # report.md from a committed report

Phases, in order: env, peers, build, tests, correctness, rows, memory, passes
and timing, last, as it takes whatever time the others leave. Each runs in its
own process, with a time limit cut from the overall --budget, and adds its
results to report.json (and report.md) as it goes, so a phase stopped at its
limit, or a command killed from outside, still leaves what finished. A phase
that fails (or times out) does not stop the next ones; the phases that need the
compiled extension report that they were skipped when the build failed.

--dry-run exercises the same logic on this machine, on tiny sizes and the CPU
(the Triton kernels in the interpreter, TRITON_INTERPRET=1), and installs and
builds nothing: tests/test_gpu_check.py runs it, so the script never rots.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
# What `make gpu-wheels` leaves for the device call: the peers' wheels and COMMIT.
WHEELS = ROOT / ".gpu-wheels"
PEERS = ("adasplash", "entmax")
# The timings come last: they take whatever time the others leave.
PHASES = ("env", "peers", "build", "tests", "correctness", "timing", "rows", "memory", "passes")
NEEDS_BUILD = ("tests", "correctness", "rows")
# Each phase's limit in seconds on a GPU (the overall budget cuts them further):
# about 9 minutes in all, the build and the Triton compilations most of it.
PHASE_LIMITS = {"env": 60, "peers": 60, "build": 240, "tests": 130, "correctness": 75, "timing": 170,
                "rows": 25, "memory": 25, "passes": 30}
DRY_LIMITS = {name: 120 for name in PHASES}
# A phase process's exit status when it did part of its work (a build without the CUDA kernels).
PARTIAL = 3


# --- the report --------------------------------------------------------------------------------------

class Report:
    """report.json in the output folder, rewritten (atomically) on every change,
    with report.md rendered from it. Phases run one at a time, so the phase
    process and the driver never write at once."""

    def __init__(self, out: Path):
        self.path = out / "report.json"

    def load(self) -> dict:
        if self.path.exists():
            return json.loads(self.path.read_text())
        return {"meta": {}, "phases": {}}

    def save(self, data: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.path)
        (self.path.parent / "report.md").write_text(render_markdown(data))

    def phase(self, data: dict, name: str) -> dict:
        return data["phases"].setdefault(name, {"status": "not run", "items": []})

    def add(self, name: str, table: str, row: dict) -> None:
        """One result row of a phase, under a table title."""
        data = self.load()
        self.phase(data, name)["items"].append({"table": table, "row": row})
        self.save(data)

    def set(self, name: str, **fields) -> None:
        data = self.load()
        self.phase(data, name).update(fields)
        self.save(data)


def _cell(v) -> str:
    if isinstance(v, float):
        if v == 0 or math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.3g}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{v:.4g}"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    text = str(v).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 300 else text[:150] + " … " + text[-140:]


def render_markdown(data: dict) -> str:
    meta = data.get("meta", {})
    lines = ["# attnkern GPU check", ""]
    env = meta.get("env", {})
    if env:
        lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in env.items()] + [""]
    for k in ("budget_s", "dry_run", "rerun_of", "started", "finished", "note"):
        if k in meta:
            lines.append(f"- {k}: {meta[k]}")
    lines.append("")
    lines += ["| phase | status | wall s | note |", "|---|---|---|---|"]
    for name in PHASES:
        ph = data["phases"].get(name, {"status": "not run"})
        lines.append(f"| {name} | {ph['status']} | {_cell(ph.get('wall_s', ''))} | {_cell(ph.get('note', ''))} |")
    for name in PHASES:
        ph = data["phases"].get(name)
        if not ph or not ph.get("items"):
            continue
        lines += ["", f"## {name}"]
        tables: dict[str, list[dict]] = {}
        for item in ph["items"]:
            tables.setdefault(item["table"], []).append(item["row"])
        for title, rows in tables.items():
            cols = list(dict.fromkeys(c for r in rows for c in r))
            lines += ["", f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# --- the driver --------------------------------------------------------------------------------------

def _peer_site(out: Path, dry: bool) -> Path:
    return out / "peers-site" if dry else Path("/tmp/attnkern-gpu-check-site")


def _phase_env(dry: bool, site: Path, phase: str = "") -> dict:
    env = dict(os.environ)
    paths = [str(ROOT), str(BENCH_DIR), str(site)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    # Tests and correctness checks run one launch configuration; the timings tune a few.
    env["ATTNKERN_TRITON_AUTOTUNE"] = "small" if phase == "timing" else "one"
    if dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _passed(phase: str, status: str | None) -> bool:
    """Whether a phase needs no rerun: ok, or a build that loaded without the CUDA kernels
    (its next phases ran on it)."""
    return status == "ok" or (phase == "build" and status == "partial")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def drive(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    if args.rerun:
        data = json.loads(Path(args.rerun).read_text())
        data["meta"]["rerun_of"] = data["meta"].get("started", "?")
    else:
        data = {"meta": {}, "phases": {}}
    data["meta"].update(budget_s=args.budget, dry_run=args.dry_run, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    report.save(data)
    site = _peer_site(out, args.dry_run)
    limits = dict(DRY_LIMITS if args.dry_run else PHASE_LIMITS)
    for item in args.limits:
        name, _, seconds = item.partition("=")
        if name not in limits:
            raise SystemExit(f"--limits: no phase {name!r}")
        limits[name] = float(seconds)
    end = time.monotonic() + args.budget
    phases = args.phases or PHASES
    for name in phases:
        data = report.load()
        ph = report.phase(data, name)
        if args.rerun and _passed(name, ph["status"]):
            continue
        built = _passed("build", data["phases"].get("build", {}).get("status"))
        if name in NEEDS_BUILD and not built and not args.dry_run:
            report.set(name, status="skipped", note="the build did not succeed", wall_s=0.0)
            continue
        left = end - time.monotonic()
        if left < 10:
            report.set(name, status="not run", note="the overall budget was spent")
            continue
        limit = min(limits[name], left)
        previous = ph.get("data")  # the tests phase reruns only what did not pass
        keep = {"data": previous} if name == "tests" and args.rerun and previous else {}
        data["phases"][name] = {"status": "running", "items": [], **keep}
        report.save(data)
        t0 = time.monotonic()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--out", str(out),
               "--deadline", str(time.time() + limit - 3)] + (["--dry-run"] if args.dry_run else [])
        proc = subprocess.Popen(cmd, env=_phase_env(args.dry_run, site, name), cwd=ROOT, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=limit)
            status = {0: "ok", PARTIAL: "partial"}.get(proc.returncode, "failed")
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            log, _ = proc.communicate()
            status = "timeout"
        wall = round(time.monotonic() - t0, 1)
        fields = {"status": status, "wall_s": wall}
        if status != "ok":
            fields["log_tail"] = (log or "")[-3000:]
            note = report.load()["phases"][name].get("note")
            fields["note"] = note or ((log or "").strip().splitlines() or ["(no output)"])[-1][:200]
        report.set(name, **fields)
        print(f"[gpu-check] {name}: {status} in {wall} s", flush=True)
    data = report.load()
    data["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report.save(data)
    bad = [n for n in phases if data["phases"].get(n, {}).get("status") != "ok"]
    print(f"[gpu-check] report: {out / 'report.md'}; not ok: {', '.join(bad) or 'none'}", flush=True)
    return 0


# --- the phases (each in its own process) ------------------------------------------------------------

class Ctx:
    def __init__(self, name: str, out: Path, dry: bool, deadline: float):
        self.name, self.out, self.dry, self.deadline = name, out, dry, deadline
        self.report = Report(out)

    def add(self, table: str, **row) -> None:
        self.report.add(self.name, table, row)

    def note(self, text: str) -> None:
        self.report.set(self.name, note=text)

    def left(self) -> float:
        return self.deadline - time.time()


def _commit() -> dict:
    """The commit the checked tree is: `make gpu-wheels` stamps it (the device
    machine's copy of the tree may carry another repository state), else git."""
    stamp = WHEELS / "COMMIT"
    if stamp.exists():
        return json.loads(stamp.read_text())
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
        return {"commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown (no .gpu-wheels/COMMIT, no git repository)"}


def run_env(ctx: Ctx) -> None:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch CUDA": torch.version.cuda,
           "CPU cores": os.cpu_count(), **_commit()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "absent"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update({"device": props.name, "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                    "memory GiB": round(props.total_memory / 2**30, 1)})
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        env["driver"] = smi.stdout.strip() or smi.stderr.strip()[:100]
    else:
        env["device"] = f"none (CPU: {platform.processor() or platform.machine()})"
    env["TF32 (torch.backends.cuda.matmul.allow_tf32)"] = bool(torch.backends.cuda.matmul.allow_tf32)
    data = ctx.report.load()
    data["meta"]["env"] = env
    ctx.report.save(data)


def run_peers(ctx: Ctx) -> None:
    site = _peer_site(ctx.out, ctx.dry)
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels and not ctx.dry:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site)] + [str(w) for w in wheels],
                       check=True)
    for peer in PEERS:
        res = subprocess.run([sys.executable, "-c", f"import importlib.metadata as m, {peer}; "
                              f"print(m.version('{peer}'))"], capture_output=True, text=True,
                             env=_phase_env(ctx.dry, site))
        if res.returncode == 0:
            ctx.add("peers", peer=peer, status="present", version=res.stdout.strip())
        else:
            ctx.add("peers", peer=peer, status="absent",
                    why=(res.stderr.strip().splitlines() or ["?"])[-1][:160])


def _extension_state() -> dict:
    res = subprocess.run([sys.executable, "-c", "import json, attnkern._extension as e; print(json.dumps("
                          "{'loaded': e.LOADED, 'cuda kernels': e.has_cuda_kernels(), 'error': e.LOAD_ERROR}))"],
                         capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        return {"loaded": False, "error": res.stderr[-500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_build(ctx: Ctx) -> None:
    if ctx.dry:
        ctx.note("dry run: nothing built; the extension already here is used")
    else:
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        env = dict(os.environ, ATTNKERN_CPU_ISA="none", TORCH_CUDA_ARCH_LIST=f"{major}.{minor}",
                   MAX_JOBS=str(os.cpu_count() or 4))
        log = ctx.out / "build.log"
        t0 = time.time()
        with open(log, "w") as f:
            res = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                                 stdout=f, stderr=subprocess.STDOUT)
        ctx.add("build", command="setup.py build_ext --inplace", cpu_isa="none (portable copy only)",
                arch=f"{major}.{minor}", seconds=round(time.time() - t0, 1), rc=res.returncode)
        if res.returncode != 0:
            tail = log.read_text()[-2500:]
            ctx.note("the build failed; the compiler's last lines are in log_tail")
            print(tail)
            raise SystemExit(1)
    state = _extension_state()
    ctx.add("extension", **state)
    if not state.get("loaded"):
        ctx.note("attnkern._C did not load")
        raise SystemExit(1)
    if not ctx.dry and not state.get("cuda kernels"):
        # The Triton kernels and the CPU side still run: the next phases go on.
        ctx.note("attnkern._C loaded without the CUDA kernels (see build.log)")
        raise SystemExit(PARTIAL)


def _read_jsonl(path: Path) -> tuple[list[str], dict[str, dict]]:
    collected: list[str] = []
    outcomes: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                e = json.loads(line)
                if "collected" in e:
                    collected = e["collected"]
                else:
                    outcomes[e["test"]] = e
    return collected, outcomes


def run_tests(ctx: Ctx) -> None:
    import importlib.util

    prev = ctx.report.load()["phases"]["tests"].get("data") or {}
    done = {t for t, o in prev.get("outcomes", {}).items() if o in ("passed", "skipped", "xfailed")}
    if prev.get("collected"):
        selection = [t for t in prev["collected"] if t not in done]
    elif ctx.dry:
        selection = ["tests/test_triton.py::test_half_types_forward", "tests/test_gpu_host.py"]
    else:
        # The files that hold gpu-marked tests: collecting the others would import
        # what the GPU machine may lack (the experiments' packages).
        selection = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                           if "pytest.mark.gpu" in f.read_text())
    jsonl = ctx.out / "tests.jsonl"
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "gpu_check_plugin",
           "--continue-on-collection-errors", "-m", "gpu and not slow"]
    if importlib.util.find_spec("xdist") and not ctx.dry:
        cmd += ["-n", str(max(2, min(14, (os.cpu_count() or 2) - 2)))]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += ["--timeout", "150"]
    env = dict(os.environ, ATTNKERN_GPU_CHECK_TESTS=str(jsonl))
    with open(ctx.out / "tests.log", "w") as log:
        proc = subprocess.Popen(cmd + selection, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=max(5.0, ctx.left() - 4))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
    collected, outcomes = _read_jsonl(jsonl)
    collected = prev.get("collected") or collected  # a rerun collects only what it repeats
    merged = dict(prev.get("outcomes", {}))
    merged.update({t: e["outcome"] for t, e in outcomes.items()})
    counts: dict[str, int] = {}
    for t in collected:
        counts[merged.get(t, "not run")] = counts.get(merged.get(t, "not run"), 0) + 1
    ctx.report.set("tests", data={"collected": collected, "outcomes": merged})
    ctx.add("summary", pytest_rc=proc.returncode, collected=len(collected), **counts)
    for t, e in outcomes.items():
        if e["outcome"] in ("failed", "error", "xpassed"):
            ctx.add("failures", test=t, outcome=e["outcome"], message=e.get("message", "")[-600:])
    slowest = sorted(outcomes.values(), key=lambda e: -e["seconds"])[:8]
    for e in slowest:
        ctx.add("slowest", test=e["test"], seconds=e["seconds"], outcome=e["outcome"])
    if not collected or counts.get("failed") or counts.get("error") or counts.get("not run"):
        raise SystemExit(1)


# --- measurements ------------------------------------------------------------------------------------

def _device(ctx: Ctx) -> str:
    return "cpu" if ctx.dry else "cuda"


def bench_ms(fn, ctx: Ctx) -> float:
    """Median milliseconds of fn(): triton.testing.do_bench (CUDA events) on a
    GPU; a few wall-clock runs in the dry run."""
    if ctx.dry:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _rel_err(actual, exact) -> float:
    import torch

    actual, exact = actual.detach(), exact.detach()
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    diff = (actual.double() - exact.double()).abs()
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max()) / max(scale, 1e-30) if diff.numel() else 0.0


# Bounds of the relative errors (max |error| / max |exact|) of outputs and gradients.
ERR_BOUNDS = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 5e-2), "float16": (4e-3, 1e-2)}


def _alpha_for(normalizer: str, H: int, device, values=(1.3, 1.7, 3.0, 1.0)):
    import torch

    if normalizer != "entmax":
        return None
    return torch.tensor([values[h % len(values)] for h in range(H)], dtype=torch.float32, device=device)


def run_correctness(ctx: Ctx) -> None:
    import torch

    from attnkern.backends import reference
    from attnkern.backends import triton as tb

    dev = _device(ctx)
    B, H, Hk = (1, 2, 1) if ctx.dry else (2, 4, 2)
    N, E, Ev = (33, 19, 12) if ctx.dry else (1025, 59, 40)
    g = torch.Generator().manual_seed(0)
    failures = 0
    # Each case compiles its kernels (seconds each; α-entmax with heads at α = 3
    # the p-space ones, the slowest): the limit may stop the list, so the float32
    # ones and α-entmax, whose paths differ most from what the tests cover, first.
    cases = [("float32", "softmax"), ("float32", "entmax"), ("bfloat16", "entmax15"), ("bfloat16", "entmax"),
             ("float32", "sparsemax"), ("bfloat16", "softmax"), ("bfloat16", "sparsemax"), ("float32", "entmax15")]
    if ctx.dry:
        cases = cases[:2]
    allowed = torch.rand(B, 1, N, N, generator=g) > 0.2
    allowed[:, :, 3] = False  # a fully masked row
    mask = torch.zeros(B, 1, N, N).masked_fill(~allowed, -math.inf).to(dev)
    for dtype_name, normalizer in cases:
        if ctx.left() < 15:
            ctx.note("stopped at the phase's time limit")
            break
        dtype = getattr(torch, dtype_name)
        q = torch.randn(B, H, N, E, generator=g).to(dev, dtype)
        k = torch.randn(B, Hk, N, E, generator=g).to(dev, dtype)
        v = torch.randn(B, Hk, N, Ev, generator=g).to(dev, dtype)
        do = torch.randn(B, H, N, Ev, generator=g).to(dev, dtype)
        alpha = _alpha_for(normalizer, H, dev)
        scale = 1 / math.sqrt(E)
        out, shift = tb.attention_fwd(q, k, v, mask, True, scale, normalizer, alpha)
        dq, dk, dv, _ = tb.attention_bwd(do, q, k, v, mask, True, scale, normalizer, alpha, out, shift, False)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference.attention(q64, k64, v64, mask.double(), True, scale, normalizer=normalizer,
                                  alpha=None if alpha is None else alpha.double().view(-1, 1, 1))
        rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        bound_out, bound_grad = ERR_BOUNDS[dtype_name]
        errs = {"out": _rel_err(out, ref), "dq": _rel_err(dq, rq), "dk": _rel_err(dk, rk), "dv": _rel_err(dv, rv)}
        ok = errs["out"] <= bound_out and max(errs["dq"], errs["dk"], errs["dv"]) <= bound_grad
        failures += not ok
        ctx.add(f"Triton vs float64 reference: B={B} H={H} Hk={Hk} L=S={N} E={E} Ev={Ev}, causal + mask "
                "with a fully masked row; relative max error", dtype=dtype_name, normalizer=normalizer,
                **{k_: v_ for k_, v_ in errs.items()}, bound_out=bound_out, bound_grad=bound_grad, ok=ok)
    failures += _check_dropout_mask(ctx, dev)
    failures += _check_softmax_vs_sdpa(ctx, dev)
    failures += _check_band(ctx, dev)
    failures += _check_row_bounds(ctx, dev)
    if failures:
        raise SystemExit(1)


def _check_against_dense(ctx: Ctx, title: str, q, k, v, do, allowed, band_args, normalizers) -> int:
    """The Triton launchers, forward and backward, with the key band arguments
    band_args (window_left, window_right, key_lengths[, row_bounds]) against
    the float64 reference given `allowed`, the dense mask they stand for
    (float32 inputs); one row of `title`'s table per normalizer."""
    import torch

    from attnkern.backends import reference
    from attnkern.backends import triton as tb

    failures = 0
    scale = 1 / math.sqrt(q.shape[-1])
    for normalizer in normalizers:
        if ctx.left() < 10:
            ctx.note("stopped at the phase's time limit")
            break
        out, shift = tb.attention_fwd(q, k, v, None, False, scale, normalizer, None, 0.0, None, *band_args)
        dq, dk, dv, _ = tb.attention_bwd(do, q, k, v, None, False, scale, normalizer, None, out, shift, False,
                                         0.0, None, *band_args)
        q64, k64, v64 = (t.cpu().double().requires_grad_() for t in (q, k, v))
        ref = reference.attention(q64, k64, v64, allowed, False, scale, normalizer=normalizer)
        rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), do.cpu().double())
        errs = {"out": _rel_err(out.cpu(), ref), "dq": _rel_err(dq.cpu(), rq), "dk": _rel_err(dk.cpu(), rk),
                "dv": _rel_err(dv.cpu(), rv)}
        bound_out, bound_grad = ERR_BOUNDS["float32"]
        ok = errs["out"] <= bound_out and max(errs["dq"], errs["dk"], errs["dv"]) <= bound_grad
        failures += not ok
        ctx.add(title, normalizer=normalizer, **errs, bound_out=bound_out, bound_grad=bound_grad, ok=ok)
    return failures


def _check_band(ctx: Ctx, dev: str) -> int:
    """A sliding window with per-batch cache lengths (the kernels' key band)
    against the float64 reference given the band as a mask, float32."""
    import torch

    from attnkern.backends import reference

    B, H, N, E, window = (2, 2, 70, 16, (9, 2)) if ctx.dry else (2, 4, 1025, 64, (128, 0))
    lengths = torch.tensor([N, N // 2 + 3])
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(B, H, N, E, generator=g).to(dev) for _ in range(4))
    band = reference.band_mask(N, N, window=window, cache_seqlens=lengths)
    title = (f"Triton key band vs float64 reference: B={B} H={H} L=S={N} E={E}, window {window}, cache lengths "
             f"{lengths.tolist()}, float32; relative max error")
    return _check_against_dense(ctx, title, q, k, v, do, band, (*window, lengths.to(dev)), ("softmax", "entmax15"))


def _check_row_bounds(ctx: Ctx, dev: str) -> int:
    """Causal documents given as one run of keys per row (row_bounds, what a
    FlexAttention BlockMask becomes) against the reference given the dense
    mask, float32."""
    import torch

    H, E, lengths = (2, 16, [20, 1, 49]) if ctx.dry else (4, 64, [300, 1, 500, 224])
    N = sum(lengths)
    starts = torch.repeat_interleave(torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()]),
                                     torch.tensor(lengths))
    bounds = torch.stack([starts, torch.arange(N) + 1], -1)[None]  # (1, N, 2)
    dense = (torch.arange(N) >= bounds[..., :1]) & (torch.arange(N) < bounds[..., 1:])
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, H, N, E, generator=g).to(dev) for _ in range(4))
    title = (f"Triton row bounds (a BlockMask's runs: causal documents {lengths}) vs float64 reference: H={H} "
             f"E={E}, float32; relative max error")
    return _check_against_dense(ctx, title, q, k, v, do, dense[:, None], (-1, -1, None, bounds.to(dev)),
                                ("softmax", "sparsemax"))


def _check_dropout_mask(ctx: Ctx, dev: str) -> int:
    """The keep mask the Triton kernels draw on this device equals the one of
    the CPU kernels for the same seed (softmax weights are all positive, so
    with v = I a weight of exactly 0 is a dropped one)."""
    import torch

    from attnkern.backends import triton as tb
    from attnkern.testing import attention_dropout_mask

    B, H, L, S, p = 1, 2, 37, 45, 0.3
    seed = torch.tensor(1234567, dtype=torch.int64)
    q = torch.randn(B, H, L, 16, dtype=torch.float32) * 0.1
    k = torch.randn(B, H, S, 16, dtype=torch.float32) * 0.1
    v = torch.eye(S).expand(B, H, S, S).contiguous()
    out, _ = tb.attention_fwd(q.to(dev), k.to(dev), v.to(dev), None, False, 0.25, "softmax", None, p, seed)
    kept_here = out.cpu() != 0
    kept_cpu = attention_dropout_mask(B, H, L, S, p, seed)
    mismatches = int((kept_here != kept_cpu).sum())
    ctx.add("dropout mask: Triton on this device vs the CPU kernels, same seed", entries=kept_cpu.numel(),
            kept=int(kept_cpu.sum()), mismatches=mismatches, ok=mismatches == 0)
    return int(mismatches != 0)


def _check_softmax_vs_sdpa(ctx: Ctx, dev: str) -> int:
    """Softmax attention in bfloat16 within 2x the error of SDPA's own (its
    flash backend), both against float64. The bound holds on a GPU only: on the
    CPU, SDPA's math backend keeps the weights in float32 where flash attention
    (and attnkern) round them to bfloat16 for P·V."""
    import torch
    import torch.nn.functional as F

    from attnkern.backends import triton as tb

    B, H, N, E = (1, 2, 64, 32) if ctx.dry else (2, 8, 1024, 64)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, E, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    ours, _ = tb.attention_fwd(q, k, v, None, False, 1 / math.sqrt(E), "softmax", None)
    with _flash(ctx):
        sdpa = F.scaled_dot_product_attention(q, k, v)
    e_ours, e_sdpa = _rel_err(ours, exact), _rel_err(sdpa, exact)
    ok = e_ours <= 2 * e_sdpa or ctx.dry
    ctx.add("softmax bfloat16 error against float64: attnkern vs SDPA", B=B, H=H, N=N, E=E, attnkern=e_ours,
            sdpa=e_sdpa, ratio=e_ours / max(e_sdpa, 1e-30), bound=2.0, ok=ok)
    return int(not ok)


# The timed cases, most important first (the targets of the first GPU run: softmax
# and entmax15 at N = 4096 and 16384), then the rest of the grid: the phase times
# as many as its limit allows.
def timing_cases(dry: bool) -> list[dict]:
    if dry:
        return [dict(normalizer=nz, alpha=a, dtype="bfloat16", E=16, N=32, causal=False, tokens=64)
                for nz, a in (("softmax", None), ("entmax", 1.3))] + [
            dict(normalizer="sparsemax", alpha=2.0, dtype="bfloat16", E=16, N=32, causal=False, tokens=64,
                 window=(8, 0))]
    alphas = {"softmax": None, "entmax15": 1.5, "sparsemax": 2.0, "entmax": 1.3}

    def case(nz, E, N, causal, dtype="bfloat16"):
        return dict(normalizer=nz, alpha=alphas[nz], dtype=dtype, E=E, N=N, causal=causal, tokens=32768)

    first = [case(nz, 64, N, False) for N in (4096, 16384) for nz in ("softmax", "entmax15")]
    first += [case(nz, 64, 4096, False) for nz in ("sparsemax", "entmax")]
    first += [case(nz, 64, 16384, True) for nz in ("softmax", "entmax15")]
    # Sliding windows (the key band), against our own causal call at the same N.
    first += [dict(case(nz, 64, 16384, False), window=(256, 0)) for nz in ("softmax", "entmax15", "sparsemax")]
    grid = [case(nz, E, N, causal) for E in (64, 128) for N in (4096, 16384, 1024) for causal in (False, True)
            for nz in alphas]
    grid += [dict(c, dtype="float16") for c in grid if c["E"] == 64 and c["N"] != 1024]
    return first + [c for c in grid if c not in first]


def run_timing(ctx: Ctx) -> None:
    import torch

    try:
        import adasplash as ada
    except ImportError:
        ada = None
    H = 16 if not ctx.dry else 2
    table = (f"milliseconds (median), B·N = tokens, H = {H}, autotune {os.environ.get('ATTNKERN_TRITON_AUTOTUNE')}; "
             "ratio = attnkern / other, < 1 is faster; attnkern timed through its launchers (fwd, then bwd)")
    for case in timing_cases(ctx.dry):
        if ctx.left() < 25:
            ctx.note("stopped at the phase's time limit; the remaining cases were not timed")
            break
        ctx.add(table, **_time_case(ctx, case, H, ada))
        if not ctx.dry:
            torch.cuda.empty_cache()


def _time_case(ctx: Ctx, case: dict, H: int, ada) -> dict:
    import torch
    import torch.nn.functional as F

    from attnkern.backends import triton as tb

    dev = _device(ctx)
    nz, alpha_v, E, N, causal = case["normalizer"], case["alpha"], case["E"], case["N"], case["causal"]
    dtype = getattr(torch, case["dtype"])
    B = max(1, case["tokens"] // N)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, E, device=dev, generator=g, dtype=dtype) for _ in range(4))
    alpha = None if nz != "entmax" else torch.full((H,), alpha_v, device=dev)
    scale = 1 / math.sqrt(E)
    row = dict(normalizer=nz if nz != "entmax" else f"entmax α={alpha_v}", dtype=case["dtype"], E=E, N=N, B=B,
               causal=causal)
    if "window" in case:
        return _time_window_case(ctx, row, case["window"], q, k, v, do, scale, nz, alpha)

    def ours_fwd():
        return tb.attention_fwd(q, k, v, None, causal, scale, nz, alpha)

    def ours_both():
        out, shift = tb.attention_fwd(q, k, v, None, causal, scale, nz, alpha)
        return tb.attention_bwd(do, q, k, v, None, causal, scale, nz, alpha, out, shift, False)

    try:
        row["attnkern fwd"] = bench_ms(ours_fwd, ctx)
        row["attnkern fwd+bwd"] = bench_ms(ours_both, ctx)
    except Exception as exc:  # one case's failure is a result, not the end of the phase
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def sdpa_fwd():
        with _flash(ctx):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa_both():
        with _flash(ctx):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    try:
        row["sdpa fwd"] = bench_ms(sdpa_fwd, ctx)
        row["sdpa fwd+bwd"] = bench_ms(sdpa_both, ctx)
        row["× sdpa fwd"] = row["attnkern fwd"] / row["sdpa fwd"]
        row["× sdpa fwd+bwd"] = row["attnkern fwd+bwd"] / row["sdpa fwd+bwd"]
    except Exception as exc:  # e.g. no flash kernel for this shape: said, not skipped silently
        row["sdpa error"] = f"{type(exc).__name__}: {exc}"[:300]
    if ada is not None and nz != "softmax" and not ctx.dry:
        _time_adasplash(ctx, ada, row, qg, kg, vg, do, float(alpha_v), causal, nz, alpha, scale)
    return row


def _time_window_case(ctx: Ctx, row: dict, window, q, k, v, do, scale, nz, alpha) -> dict:
    """A sliding window through the launchers' key band, and the same call
    causal instead (the band's cost against the square it cuts)."""
    from attnkern.backends import triton as tb

    row["window"] = str(tuple(window))

    def both(causal, win):
        out, shift = tb.attention_fwd(q, k, v, None, causal, scale, nz, alpha, 0.0, None, *win)
        return tb.attention_bwd(do, q, k, v, None, causal, scale, nz, alpha, out, shift, False, 0.0, None, *win)

    try:
        row["attnkern fwd+bwd"] = bench_ms(lambda: both(False, window), ctx)
        row["attnkern causal fwd+bwd"] = bench_ms(lambda: both(True, (-1, -1)), ctx)
        row["× own causal fwd+bwd"] = row["attnkern fwd+bwd"] / row["attnkern causal fwd+bwd"]
    except Exception as exc:  # one case's failure is a result, not the end of the phase
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _flash(ctx: Ctx):
    if ctx.dry:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _time_adasplash(ctx, ada, row, qg, kg, vg, do, alpha_v, causal, nz, alpha, scale):
    """AdaSplash at the same α (v2 for α = 1.5 causal, as its dispatcher), and
    the output error of both against float64 on one slice (AdaSplash stops
    after a fixed number of iterations). AdaSplash scales by 1/√E itself."""
    import torch

    from attnkern.backends import reference
    from attnkern.backends import triton as tb

    try:
        def fwd():
            return ada.adasplash(qg, kg, vg, alpha=alpha_v, is_causal=causal)

        def both():
            o = ada.adasplash(qg, kg, vg, alpha=alpha_v, is_causal=causal)
            return torch.autograd.grad(o, (qg, kg, vg), do)

        row["adasplash fwd"] = bench_ms(fwd, ctx)
        row["adasplash fwd+bwd"] = bench_ms(both, ctx)
        row["× adasplash fwd"] = row["attnkern fwd"] / row["adasplash fwd"]
        row["× adasplash fwd+bwd"] = row["attnkern fwd+bwd"] / row["adasplash fwd+bwd"]
        n = min(qg.shape[2], 2048)
        qs, ks, vs = (t.detach()[:1, :2, :n].contiguous() for t in (qg, kg, vg))
        ref = reference.attention(qs.double(), ks.double(), vs.double(), None, causal, scale, normalizer="entmax",
                                  alpha=alpha_v)
        ours, _ = tb.attention_fwd(qs, ks, vs, None, causal, scale, nz, None if alpha is None else alpha[:2])
        theirs = ada.adasplash(qs, ks, vs, alpha=alpha_v, is_causal=causal)
        row["err attnkern"] = _rel_err(ours, ref)
        row["err adasplash"] = _rel_err(theirs, ref)
    except Exception as exc:
        row["adasplash error"] = f"{type(exc).__name__}: {exc}"[:300]


def run_rows(ctx: Ctx) -> None:
    """The CUDA row normalizers against torch.softmax (and the entmax package when present), and the
    structured row kernels (fusedmax, crf_marginals) against torch.softmax."""
    import torch

    import attnkern

    dev = _device(ctx)
    try:
        import entmax as entmax_pkg
    except ImportError:
        entmax_pkg = None
    shapes = [(8, 64)] if ctx.dry else [(4096, 1024), (256, 32768)]
    fns = {"softmax": attnkern.softmax, "sparsemax": attnkern.sparsemax, "entmax15": attnkern.entmax15,
           "entmax α=1.3": lambda x: attnkern.entmax(x, 1.3)}
    peers = {"sparsemax": "sparsemax", "entmax15": "entmax15", "entmax α=1.3": "entmax_bisect"}
    table = "row normalizers, float32, milliseconds (median); ratio = attnkern / torch.softmax"
    for shape in shapes:
        x = torch.randn(*shape, device=dev)
        gy = torch.randn(*shape, device=dev)
        timed = functools.partial(_time_row_op, ctx, x, gy)
        base_f, base_b = timed(lambda t: torch.softmax(t, -1))
        for name, fn in fns.items():
            if ctx.left() < 10:
                ctx.note("stopped at the phase's time limit")
                return
            f, b = timed(fn)
            row = dict(normalizer=name, shape=str(shape), fwd=f, fwd_bwd=b, torch_softmax_fwd=base_f,
                       torch_softmax_fwd_bwd=base_b, **{"× softmax fwd": f / base_f, "× softmax fwd+bwd": b / base_b})
            if entmax_pkg is not None and name in peers:
                peer = getattr(entmax_pkg, peers[name])
                if name == "entmax α=1.3":
                    peer = functools.partial(peer, alpha=1.3)
                row["entmax pkg fwd+bwd"] = timed(peer)[1]
            ctx.add(table, **row)
    # The structured row kernels (one thread per row, sequential along it) on the first shape only.
    shape = shapes[0]
    x, gy = torch.randn(*shape, device=dev), torch.randn(*shape, device=dev)
    timed = functools.partial(_time_row_op, ctx, x, gy)
    pairwise = torch.tensor([[0.5, -1.0], [-0.5, 1.0]], device=dev)
    structured = {"fusedmax λ=0.1": lambda t: attnkern.fusedmax(t, lam=0.1),
                  "crf_marginals": lambda t: attnkern.crf_marginals(t, pairwise)}
    base_f, base_b = timed(lambda t: torch.softmax(t, -1))
    for name, fn in structured.items():
        if ctx.left() < 10:
            ctx.note("stopped at the phase's time limit")
            return
        f, b = timed(fn)
        ctx.add("structured row kernels (a thread per row), float32, milliseconds (median); ratio = attnkern / "
                "torch.softmax", op=name, shape=str(shape), fwd=f, fwd_bwd=b, **{"× softmax fwd": f / base_f,
                                                                                   "× softmax fwd+bwd": b / base_b})


def _time_row_op(ctx: Ctx, x, gy, fn) -> tuple[float, float]:
    """(fwd, fwd+bwd) milliseconds of a row-wise op on x, with output gradient gy."""
    import torch

    xg = x.clone().requires_grad_()
    return bench_ms(lambda: fn(x), ctx), bench_ms(lambda: torch.autograd.grad(fn(xg), xg, gy), ctx)


def run_memory(ctx: Ctx) -> None:
    """Peak memory of attention fwd+bwd at N = 16384 against SDPA's."""
    import torch
    import torch.nn.functional as F

    from attnkern.backends import triton as tb

    if ctx.dry:
        ctx.note("dry run: no CUDA memory to measure")
        return
    B, H, N, E = 2, 16, 16384, 64
    for nz in ("softmax", "entmax15"):
        q, k, v, do = (torch.randn(B, H, N, E, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, shift = tb.attention_fwd(q, k, v, None, False, E ** -0.5, nz, None)
        tb.attention_bwd(do, q, k, v, None, False, E ** -0.5, nz, None, out, shift, False)
        ours = torch.cuda.max_memory_allocated() - base
        qg, kg, vg = (t.requires_grad_() for t in (q, k, v))
        torch.cuda.reset_peak_memory_stats()
        with _flash(ctx):
            o = F.scaled_dot_product_attention(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), do)
        sdpa = torch.cuda.max_memory_allocated() - base
        ctx.add("peak memory of fwd+bwd beyond the inputs, bfloat16, B=2 H=16 N=16384 E=64", normalizer=nz,
                attnkern_MiB=ours / 2**20, sdpa_MiB=sdpa / 2**20, ratio=ours / max(sdpa, 1))
        del q, k, v, do, qg, kg, vg, o
        torch.cuda.empty_cache()


def run_passes(ctx: Ctx) -> None:
    """Passes over K per query block of the sparse forward (the interpreter counts ≤ 7-8)."""
    from attnkern.backends.triton import attention

    sizes = (64,) if ctx.dry else (4096,)
    for n in sizes:
        for nz in ("sparsemax", "entmax15", "entmax"):
            for kind in ("random", "local"):
                if ctx.left() < 10:
                    ctx.note("stopped at the phase's time limit")
                    return
                row = attention.pass_count_summary(nz, kind, n, n, 64, device=_device(ctx))
                ctx.add("passes over K per query block (float32, E = 64, one launch configuration)",
                        normalizer=nz, kind=kind, N=n, **{k: v for k, v in row.items()
                                                          if k not in ("normalizer", "kind")})


RUNNERS = {"env": run_env, "peers": run_peers, "build": run_build, "tests": run_tests,
           "correctness": run_correctness, "timing": run_timing, "rows": run_rows, "memory": run_memory,
           "passes": run_passes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "out/gpu-check", help="folder of the report")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for all phases together (the default leaves a lent machine's 15 minutes room "
                         "for its start and one rerun)")
    ap.add_argument("--rerun", help="an earlier report.json: run only its phases (and tests) that did not pass")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, Triton interpreted; "
                    "installs and builds nothing")
    ap.add_argument("--phases", nargs="+", choices=PHASES, help="only these phases")
    ap.add_argument("--limits", nargs="+", default=[], metavar="PHASE=SECONDS",
                    help="other time limits for these phases")
    ap.add_argument("--render", metavar="REPORT_JSON", help="only write report.md beside a report.json")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        path.with_name("report.md").write_text(render_markdown(json.loads(path.read_text())))
        return 0
    if args.phase:
        RUNNERS[args.phase](Ctx(args.phase, Path(args.out), args.dry_run, args.deadline or time.time() + 600))
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
