"""Run (config, seed) jobs in parallel with an on-disk cache.

Each job calls `fn(config, seed) -> dict` (a module-level function, so it
pickles to worker processes). Results are cached as JSON under `cache_dir`,
one file per job named by a hash of the experiment, the full configuration,
the seed and the code fingerprint of fn's module (provenance.code_fingerprint:
its attnkern sources and the compiled extension): an interrupted sweep
resumes where it stopped, and runs with different options or code never mix.
Each record keeps the fingerprints of the datasets the run read; a cached
record whose datasets have changed since is run again. A job that raises is
reported by name (with its traceback) and not cached; the other jobs' results
are kept. Every record carries the provenance of the run that computed it
(metadata()), which a result served from the cache keeps.

Executors: "joblib" (local processes, `jobs` of them; in-process when jobs=1)
and "dask" (a dask.distributed cluster at `scheduler`, or a LocalCluster of
`jobs` single-threaded workers when no address is given).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnkern.experiments import provenance

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
    stale: int = 0                                # cached jobs run again: their data changed


def config_hash(experiment: str, config: dict, seed: int, code: str = "") -> str:
    """The cache key of a job: experiment, configuration, seed and code fingerprint."""
    blob = json.dumps({"experiment": experiment, "config": config, "seed": seed, "code": code}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def attnkern_commit() -> str:
    """The git commit of the attnkern checkout (with "+dirty" for local changes,
    untracked files included), or "unknown"."""
    git = provenance.git_commit()
    if not git.get("commit"):
        return "unknown"
    return git["commit"] + ("+dirty" if git.get("dirty") else "")


def processor(device: str = "cpu") -> str:
    return provenance.processor(device)


def metadata(config: dict | None = None, seed: int | None = None) -> dict:
    """What a result needs to be reproduced: configuration, seed, code, machine,
    the instruction-set level and the backend the normalizers actually ran on."""
    config = config or {}
    device = config.get("device", "cpu")
    requested = config.get("backend", "auto")
    try:
        used = provenance.backend_used(requested, device)
    except (RuntimeError, ValueError) as exc:
        used = f"unavailable: {exc}"
    return {"config": config, "seed": seed, "attnkern_commit": attnkern_commit(), **provenance.machine(device),
            "backend_requested": requested, "backend": used}


def _execute(fn, experiment: str, config: dict, seed: int, code: str) -> dict:
    """Runs one job in a worker: one thread (jobs are the parallelism), fixed seed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.time()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    try:
        torch.manual_seed(seed)
        with provenance.reading() as datasets:
            result = fn(config, seed)
        meta = dict(metadata(config, seed), code_fingerprint=code, started=started)
        return {"ok": True, "result": result, "seconds": time.time() - start, "meta": meta,
                "data": provenance.data_fingerprint(datasets)}
    except Exception as exc:  # reported by name in the parent, never cached
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finally:
        torch.set_num_threads(threads)


def data_changed(record: dict, digests: dict) -> bool:
    """Whether a dataset the cached run read differs now (or is gone). digests: the datasets' current
    fingerprints, filled as needed (one walk of each dataset's folder per sweep, not per cached run)."""
    data = record.get("data")
    if data is None:
        return True
    for name in data:
        if name not in digests:
            digests[name] = provenance.dataset_digest(name)
    return any(digests[name] != digest for name, digest in data.items())


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
    code = provenance.code_fingerprint(fn.__module__)
    digests: dict = {}
    for job in jobs:
        path = cache_dir / f"{config_hash(experiment, job.config, job.seed, code)}.json"
        if path.exists():
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                record = None  # a damaged cache file: run the job again
            if record is not None and not data_changed(record, digests):
                sweep.results[job.name] = record
                sweep.cached += 1
                continue
            sweep.stale += record is not None
        todo.append((job, path))

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), initial=sweep.cached, desc=desc or experiment, disable=not progress, leave=False)

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
                    collect(job, path, _execute(fn, experiment, job.config, job.seed, code))
            else:
                from joblib import Parallel, delayed

                par = Parallel(n_jobs=min(n_jobs, len(todo)), return_as="generator_unordered")
                outs = par(delayed(_indexed)(i, fn, experiment, job.config, job.seed, code)
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
                futures = {client.submit(_execute, fn, experiment, job.config, job.seed, code, pure=False): i
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


def _indexed(i, fn, experiment, config, seed, code):
    return i, _execute(fn, experiment, config, seed, code)
