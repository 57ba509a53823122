"""The benchmark reporting chain: pytest-benchmark's JSON -> a result file
(benchmarks/report.py) -> the generated tables of docs/benchmarks.md and the
README's figure (benchmarks/docs.py), and ratios.py's rendering of its result
files. The scripts run as `make bench` runs them, in a subprocess.

tests/data/pytest-benchmark-sample.json holds records of every suite that
`make bench` runs (cut from a real run: a few records per group)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnkern import _extension

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
SAMPLE = Path(__file__).resolve().parent / "data" / "pytest-benchmark-sample.json"
GROUPS = ("normalizers", "losses", "attention", "attention-memory", "mha-dropout", "triton-passes")

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")


def _script(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_sample_holds_every_suite():
    groups = {b["extra_info"]["group"] for b in json.loads(SAMPLE.read_text())["benchmarks"]}
    assert groups == set(GROUPS)


def test_report_writes_a_result_file_with_every_suite(tmp_path):
    res = _script(str(BENCH / "report.py"), str(SAMPLE), "--out", str(tmp_path / "suites"))
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "suites.json").read_text())
    assert {r["group"] for r in data["records"]} == set(GROUPS)
    assert data["machine"]["cpu"] and data["machine"]["commit"] and data["machine"]["attnkern_level"]["active"]
    md = (tmp_path / "suites.md").read_text()
    for text in ("| normalizers |", "| losses |", "| attention |", "| mha-dropout |", "## Peak memory",
                 "## Triton forward passes", "CPU: "):
        assert text in md, text
    # The baseline of each group divides the others: torch's softmax is 1.00 of itself.
    assert "| softmax | torch |" in md and "| 1.00 |" in md
    # Rendering again from the result file alone gives the same page.
    first = md
    res = _script(str(BENCH / "report.py"), "--render", str(tmp_path / "suites.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "suites.md").read_text() == first


def test_report_names_a_record_without_its_keys(tmp_path):
    data = json.loads(SAMPLE.read_text())
    victim = next(b for b in data["benchmarks"] if b["extra_info"]["group"] == "mha-dropout")
    del victim["extra_info"]["shape"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    res = _script(str(BENCH / "report.py"), str(broken), "--out", str(tmp_path / "suites"))
    assert res.returncode != 0
    assert victim["fullname"] in res.stderr and "shape" in res.stderr and "conftest.record" in res.stderr


def test_docs_match_the_committed_results():
    """docs/benchmarks.md's tables and the README's figure are what the committed
    result files give (`make docs` rewrites them)."""
    res = _script(str(BENCH / "docs.py"), "--check")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


_RENDER = """
import json, sys
import ratios
row = dict(dtype="bfloat16", threads=2, case="attention N=2048", normalizer="softmax", mode="fwd", ratio=0.9,
           target=0.8, ours_s=0.009, torch_s=0.01, rounds=5, ours_faults=0, torch_faults=100)
meta = dict(cpu="Some CPU (family 1, model 2)", isa_flags=["avx2"], attnkern_level=dict(active="AVX2", machine="AVX2"),
            torch="2.x", torch_capability="AVX2", commit="abc1234", command="benchmarks/ratios.py")
one = ratios.render(dict(machine=meta, results=[row]))
merged = dict(row, ratio_min=0.7, ratio_max=0.95, processes=3, ratio=0.75)
three = ratios.render(dict(machine=meta, processes=3, results=[merged]))
print(json.dumps([one, three]))
"""


def test_ratios_render_their_result_files():
    res = _script("-c", _RENDER, cwd=BENCH)
    assert res.returncode == 0, res.stderr[-3000:]
    one, three = json.loads(res.stdout)
    assert "### bfloat16, 2 threads" in one and "| 0.90 ✗ | ≤ 0.8 | 9.0 | 10.0 | 5 |" in one
    assert "Page faults a timed call (median; attnkern / PyTorch): attention N=2048 softmax fwd 0 / 100." in one
    assert "| 0.75 | 0.70–0.95 | ≤ 0.8 | 9.0 | 10.0 | 3 × 5 |" in three and "commit abc1234" in three


_CROSS_MACHINE = """
import json, sys
from pathlib import Path
import docs
root = Path(sys.argv[1])
docs.ROOT, docs.EXPERIMENTS = root, root / "results" / "experiments"
row = dict(dataset="rt", encoder="bilstm", normalizer="softmax", gradient_tau_mean=0.30, gradient_tau_ci=[0.28, 0.32],
           loo_tau_mean=0.25, loo_tau_ci=[0.23, 0.27])
other = dict(row, normalizer="sparsemax")
def result(cpu, day, grad, loo, commit="abc1234", rows=(row, other)):
    prov = dict(commits=[commit], processors=[cpu], isa_levels=["AVX512"], backends=["cpu"],
                started=[f"2026-{day} 10:00:00 UTC"] * 2)
    return dict(experiment="importance", quick=False, embeddings="scratch", seeds=5, sweep=dict(provenance=prov),
                rows=[dict(r, gradient_tau_mean=grad, loo_tau_mean=loo) for r in rows])
out = []
runs = (("a-amd", result("AMD EPYC", "11-29", 0.30, 0.25)), ("b-intel", result("Intel Xeon", "11-30", 0.31, 0.29)),
        ("c-intel-fixed", result("Intel Xeon", "12-01", 0.31, 0.26, commit="def5678", rows=(row,))))
for name, data in runs:
    folder = docs.EXPERIMENTS / name
    folder.mkdir(parents=True)
    (folder / "importance.json").write_text(json.dumps(data))
    out.append(docs.importance_cross_machine())
print(json.dumps(out))
"""


def test_cross_machine_check_compares_a_rerun_with_the_first_runs_intervals(tmp_path):
    """The rerun on another CPU is checked against the earlier run's 95% intervals: τ_g 0.31 lies in
    [0.28, 0.32], τ_loo 0.29 outside [0.23, 0.27]. A later rerun of some rows (after a fix) replaces those rows
    and names its commit; the other rows stay the first rerun's."""
    res = _script("-c", _CROSS_MACHINE, str(tmp_path), cwd=BENCH)
    assert res.returncode == 0, res.stderr[-3000:]
    alone, both, fixed = json.loads(res.stdout)
    assert alone.startswith("Not yet rerun on another machine")
    assert "2 of 4 means within" in both
    assert "| rt | bilstm | softmax | τ_g | 0.300 [0.280, 0.320] | 0.310 | Intel Xeon, abc1234 | yes |" in both
    assert "| rt | bilstm | softmax | τ_loo | 0.250 [0.230, 0.270] | 0.290 | Intel Xeon, abc1234 | no |" in both
    assert "3 of 4 means within" in fixed
    assert "| rt | bilstm | softmax | τ_loo | 0.250 [0.230, 0.270] | 0.260 | Intel Xeon, def5678 | yes |" in fixed
    assert "| rt | bilstm | sparsemax | τ_loo | 0.250 [0.230, 0.270] | 0.290 | Intel Xeon, abc1234 | no |" in fixed


_TABLE2_RUNS = """
import json, sys
from pathlib import Path
import docs
root = Path(sys.argv[1])
docs.ROOT, docs.EXPERIMENTS = root, root / "results" / "experiments"
def result(day, embeddings, normalizers):
    prov = dict(commits=["abc1234"], processors=["AMD EPYC"], isa_levels=["AVX512"], backends=["cpu"],
                started=[f"2026-11-{day} 10:00:00 UTC"])
    return dict(experiment="importance", quick=False, embeddings=embeddings, seeds=5, sweep=dict(provenance=prov),
                rows=[dict(dataset="rt", encoder="bilstm", normalizer=n) for n in normalizers])
runs = (("table2", result("27", "scratch", ["softmax"])), ("table2-word2vec", result("28", "word2vec", ["softmax"])),
        ("structured", result("29", "scratch", ["softmax", "crf"])))
for name, data in runs:
    folder = docs.EXPERIMENTS / name
    folder.mkdir(parents=True)
    (folder / "importance.json").write_text(json.dumps(data))
print(json.dumps([p.parent.name for p in docs._importance_results()[0]]))
"""


_ROW_RERUNS = """
import json, sys
from pathlib import Path
import docs
root = Path(sys.argv[1])
docs.ROOT, docs.EXPERIMENTS = root, root / "results" / "experiments"
def result(day, normalizers, loo, commit, cpu="AMD EPYC"):
    prov = dict(commits=[commit], processors=[cpu], isa_levels=["AVX512"], backends=["cpu"],
                started=[f"2026-11-{day} 10:00:00 UTC"])
    rows = [dict(dataset="rt", encoder="average", normalizer=n, gradient_tau_mean=0.9, gradient_tau_ci=[0.8, 1.0],
                 loo_tau_mean=loo, loo_tau_ci=[loo - 0.01, loo + 0.01]) for n in normalizers]
    return dict(experiment="importance", quick=False, embeddings="scratch", seeds=5, sweep=dict(provenance=prov),
                rows=rows)
runs = (("table2", result("26", ["softmax", "sparsemax"], 0.90, "aaa1111")),
        ("structured", result("27", ["softmax", "crf"], 0.70, "bbb2222")),
        ("average-rerun", result("28", ["sparsemax"], 0.95, "ccc3333")),
        ("other-cpu", result("29", ["softmax", "sparsemax"], 0.955, "ddd4444", cpu="Intel Xeon")))
for name, data in runs:
    folder = docs.EXPERIMENTS / name
    folder.mkdir(parents=True)
    (folder / "importance.json").write_text(json.dumps(data))
paths, results = docs._importance_results()
print(json.dumps([[p.parent.name for p in paths], [(r["normalizer"], r["loo_tau_mean"]) for r in results[0]["rows"]],
                  results[0]["sweep"]["provenance"]["commits"], docs.importance_cross_machine()]))
"""


def test_a_later_rerun_of_some_rows_replaces_them_in_the_reference(tmp_path):
    """A later run on the reference machine whose rows are all rows of the reference (a rerun after a fix)
    replaces them in Table 2 and in the reference of the cross-machine check; a later run with rows of its own
    (another study) does not."""
    res = _script("-c", _ROW_RERUNS, str(tmp_path), cwd=BENCH)
    assert res.returncode == 0, res.stderr[-3000:]
    paths, rows, commits, check = json.loads(res.stdout)
    assert paths == ["table2", "average-rerun"]
    assert rows == [["softmax", 0.90], ["sparsemax", 0.95]]
    assert commits == ["aaa1111", "ccc3333"]
    assert "| rt | average | sparsemax | τ_loo | 0.950 [0.940, 0.960] | 0.955 | Intel Xeon, ddd4444 | yes |" in check
    assert "| rt | average | softmax | τ_loo | 0.900 [0.890, 0.910] | 0.955 | Intel Xeon, ddd4444 | no |" in check


def test_table2_takes_the_first_full_run_of_each_kind_of_embeddings(tmp_path):
    """A later full-scale run with the same embeddings (another study: its softmax rows would repeat Table 2's)
    stays out of the README's Table 2."""
    res = _script("-c", _TABLE2_RUNS, str(tmp_path), cwd=BENCH)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout) == ["table2", "table2-word2vec"]
