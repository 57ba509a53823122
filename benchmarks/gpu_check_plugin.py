"""pytest plugin of benchmarks/gpu_check.py: writes every collected test id and
every outcome, as it happens, to the JSON-lines file $ATTNKERN_GPU_CHECK_TESTS,
so that a run stopped at its time limit still tells what passed, what failed
and what never ran. Works with and without pytest-xdist (outcomes are written
by the controlling process, the collection by one worker); under xdist a worker
whose CUDA context broke is replaced, so one bad kernel fails one test."""

from __future__ import annotations

import json
import os


def _write(entry: dict) -> None:
    path = os.environ.get("ATTNKERN_GPU_CHECK_TESTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


# This process's xdist worker id ("gw0", ...), None in the controller or without xdist.
_WORKER: str | None = None


def pytest_configure(config):
    global _WORKER
    _WORKER = getattr(config, "workerinput", {}).get("workerid")


def pytest_collection_finish(session):
    if _WORKER in (None, "gw0"):
        _write({"collected": [item.nodeid for item in session.items]})


# Set in a worker once a test failed with a CUDA error (an illegal address, say),
# which leaves the process's CUDA context unusable: every later test there
# would fail with it too.
_CUDA_BROKEN = False


def pytest_runtest_logfinish(nodeid, location):
    # Ending the worker after its test's reports went out makes xdist report the
    # test as crashed and start a fresh worker for the tests still to run.
    if _WORKER is not None and _CUDA_BROKEN:
        os._exit(3)


def pytest_runtest_logreport(report):
    global _CUDA_BROKEN
    if _WORKER is not None:
        if report.failed and "CUDA error" in str(report.longrepr):
            _CUDA_BROKEN = True
        return
    outcome = None
    if report.when == "call":
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when == "setup" and not report.passed:
        outcome = "error" if report.failed else "skipped"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    if outcome is None:
        return
    entry = {"test": report.nodeid, "outcome": outcome, "when": report.when,
             "seconds": round(getattr(report, "duration", 0.0), 2)}
    if report.failed:
        entry["message"] = str(report.longrepr)[-1500:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        entry["message"] = str(report.longrepr[2])[:300]
    _write(entry)
