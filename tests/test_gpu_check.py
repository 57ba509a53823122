"""benchmarks/gpu_check.py, the one command a lent GPU machine runs, in its dry
run here (tiny sizes, the CPU, Triton interpreted): every phase runs and reports,
an absent peer is reported as absent, and a rerun repeats only the phases and
tests that did not pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnkern import _extension

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

pytest.importorskip("triton", reason="triton is not installed")
pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--budget", "400", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check")
    res = _run("--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_every_phase_runs_and_reports(first_run):
    data = _report(first_run)
    status = {name: ph["status"] for name, ph in data["phases"].items()}
    assert status == {name: "ok" for name in ("env", "peers", "build", "tests", "correctness", "timing", "rows",
                                              "memory", "passes")}, status
    assert data["meta"]["dry_run"] is True and data["meta"]["env"]["torch"]
    md = (first_run / "report.md").read_text()
    for title in ("## tests", "## correctness", "## timing", "## passes", "× sdpa fwd+bwd", "× own causal fwd+bwd"):
        assert title in md
    windows = [r["row"] for r in data["phases"]["timing"]["items"] if "window" in r["row"]]
    assert windows and all("error" not in r and r["× own causal fwd+bwd"] > 0 for r in windows), windows
    structured = {r["row"]["op"]: r["row"] for r in data["phases"]["rows"]["items"] if "op" in r["row"]}
    assert set(structured) == {"fusedmax λ=0.1", "crf_marginals"}, structured
    assert all(r["fwd_bwd"] > 0 for r in structured.values())
    tests = data["phases"]["tests"]["data"]
    assert tests["collected"] and all(o in ("passed", "skipped") for o in tests["outcomes"].values())
    assert any(o == "passed" for o in tests["outcomes"].values())


def test_an_absent_peer_is_reported_not_failed(first_run):
    peers = {r["row"]["peer"]: r["row"] for r in _report(first_run)["phases"]["peers"]["items"]}
    assert set(peers) == {"adasplash", "entmax"}
    for row in peers.values():
        assert row["status"] in ("present", "absent")
        assert row["status"] == "present" or row["why"]


def test_rerun_repeats_only_what_did_not_pass(first_run, tmp_path):
    data = _report(first_run)
    data["phases"]["passes"]["status"] = "timeout"
    tests = data["phases"]["tests"]
    passed = sorted(t for t, o in tests["data"]["outcomes"].items() if o == "passed")
    tests["status"] = "failed"
    tests["data"]["outcomes"][passed[0]] = "failed"
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps(data))
    out = tmp_path / "again"
    res = _run("--out", str(out), "--rerun", str(previous))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = [line.split()[1].rstrip(":") for line in res.stdout.splitlines()
           if line.startswith("[gpu-check] ") and " in " in line]
    assert ran == ["tests", "passes"], res.stdout
    again = _report(out)
    assert all(ph["status"] == "ok" for ph in again["phases"].values())
    rerun_ids = [json.loads(line)["test"] for line in (out / "tests.jsonl").read_text().splitlines()
                 if "test" in json.loads(line)]
    assert rerun_ids == [passed[0]]
    assert again["phases"]["timing"]["items"] == data["phases"]["timing"]["items"]
