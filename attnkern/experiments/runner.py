"""Run (config, seed) jobs in parallel with an on-disk cache.

Each job calls `fn(config, seed) -> dict` (a module-level function, so it
pickles to worker processes). Results are cached as JSON under `cache_dir`,
one file per job named by a hash of the experiment, the full configuration
and the seed: an interrupted sweep resumes where it stopped, and runs with
different options never mix. A job that raises is reported by name (with its
traceback) and not cached; the other jobs' results are kept.

Executors: "joblib" (local processes, `jobs` of them; in-process when jobs=1)
and "dask" (a dask.distributed cluster at `scheduler`, or a LocalCluster of
`jobs` single-threaded workers when no address is given).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

EXECUTORS = ("joblib", "dask")


@dataclass
class Job:
    name: str          # human-readable, e.g. "copy/permutation/softmax/seed3"
    config: dict       # everything that determines the result (JSON-serializable)
    seed: int


@dataclass
class Sweep:
    results: dict = field(default_factory=dict)   # job name -> record
    failures: dict = field(default_factory=dict)  # job name -> error text
    cached: int = 0                               # jobs read from the cache


def config_hash(experiment: str, config: dict, seed: int) -> str:
    blob = json.dumps({"experiment": experiment, "config": config, "seed": seed}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


_COMMIT = None


def attnkern_commit() -> str:
    """The git commit of the attnkern checkout (with "+dirty" for local changes), or "unknown"."""
    global _COMMIT
    if _COMMIT is None:
        root = Path(__file__).resolve().parents[2]
        try:
            head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            _COMMIT = (head + ("+dirty" if dirty else "")) if head else "unknown"
        except (OSError, subprocess.SubprocessError):
            _COMMIT = "unknown"
    return _COMMIT


def processor(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def metadata(config: dict | None = None, seed: int | None = None) -> dict:
    """What a result needs to be reproduced: configuration, seed, code and machine."""
    device = (config or {}).get("device", "cpu")
    return {"config": config, "seed": seed, "attnkern_commit": attnkern_commit(), "torch": torch.__version__,
            "python": platform.python_version(), "processor": processor(device), "device": device,
            "host_cpus": os.cpu_count()}


def _execute(fn, experiment: str, config: dict, seed: int, commit: str) -> dict:
    """Runs one job in a worker: one thread (jobs are the parallelism), fixed seed."""
    global _COMMIT
    _COMMIT = _COMMIT or commit
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.time()
    try:
        torch.manual_seed(seed)
        result = fn(config, seed)
        return {"ok": True, "result": result, "seconds": time.time() - start, "meta": metadata(config, seed)}
    except Exception as exc:  # reported by name in the parent, never cached
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finally:
        torch.set_num_threads(threads)


def _write_atomic(path: Path, record: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, default=float))
    os.replace(tmp, path)


def run_jobs(fn, jobs: list[Job], cache_dir, *, experiment: str, n_jobs: int = 1, executor: str = "joblib",
             scheduler: str | None = None, progress: bool = True, desc: str | None = None) -> Sweep:
    """Runs every job not already in the cache; returns all results and failures."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 1:
        raise ValueError(f"n_jobs must be a positive int, got {n_jobs!r}")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError("job names must be unique")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    sweep = Sweep()
    todo = []
    for job in jobs:
        path = cache_dir / f"{config_hash(experiment, job.config, job.seed)}.json"
        if path.exists():
            try:
                sweep.results[job.name] = json.loads(path.read_text())
                sweep.cached += 1
                continue
            except (OSError, json.JSONDecodeError):
                pass  # a damaged cache file: run the job again
        todo.append((job, path))

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), initial=sweep.cached, desc=desc or experiment, disable=not progress, leave=False)
    commit = attnkern_commit()

    def collect(job: Job, path: Path, out: dict) -> None:
        if out["ok"]:
            record = {"name": job.name, **out}
            _write_atomic(path, record)
            sweep.results[job.name] = record
        else:
            sweep.failures[job.name] = out["error"]
        bar.update(1)

    try:
        if not todo:
            pass
        elif executor == "joblib":
            if n_jobs == 1:
                for job, path in todo:
                    collect(job, path, _execute(fn, experiment, job.config, job.seed, commit))
            else:
                from joblib import Parallel, delayed

                par = Parallel(n_jobs=min(n_jobs, len(todo)), return_as="generator_unordered")
                outs = par(delayed(_indexed)(i, fn, experiment, job.config, job.seed, commit)
                           for i, (job, _) in enumerate(todo))
                for i, out in outs:
                    collect(*todo[i], out)
        else:
            from dask.distributed import Client, LocalCluster, as_completed

            cluster = None
            if scheduler is None:
                cluster = LocalCluster(n_workers=n_jobs, threads_per_worker=1, processes=True,
                                       dashboard_address=None)
            client = Client(scheduler if scheduler is not None else cluster)
            try:
                futures = {client.submit(_execute, fn, experiment, job.config, job.seed, commit, pure=False): i
                           for i, (job, _) in enumerate(todo)}
                for fut in as_completed(futures):
                    i = futures[fut]
                    try:
                        out = fut.result()
                    except Exception as exc:  # a lost worker
                        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    collect(*todo[i], out)
            finally:
                client.close()
                if cluster is not None:
                    cluster.close()
    finally:
        bar.close()
    return sweep


def _indexed(i, fn, experiment, config, seed, commit):
    return i, _execute(fn, experiment, config, seed, commit)
