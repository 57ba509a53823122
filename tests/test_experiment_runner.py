"""attnkern.experiments.runner and cli: cache, resume, failures, joblib and dask, argument errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnkern.experiments import cli, runner

TESTS = str(Path(__file__).parent)


@pytest.fixture
def importable(monkeypatch):
    """Worker processes import the job functions from this folder."""
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import _experiment_jobs

    return _experiment_jobs.square_job


def jobs(xs, fail=()):
    return [runner.Job(f"x{x}", {"x": x, "fail": x in fail}, seed=x) for x in xs]


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_joblib_cache_resume_and_failures(tmp_path, importable, n_jobs):
    sweep = runner.run_jobs(importable, jobs(range(4), fail=(2,)), tmp_path, experiment="toy", n_jobs=n_jobs,
                            progress=False)
    assert set(sweep.results) == {"x0", "x1", "x3"} and list(sweep.failures) == ["x2"]
    assert "told to fail" in sweep.failures["x2"]
    rec = sweep.results["x3"]
    assert rec["result"]["y"] == 9 and rec["result"]["threads"] == 1
    meta = rec["meta"]
    assert meta["seed"] == 3 and meta["config"] == {"x": 3, "fail": False}
    assert meta["torch"] and meta["processor"] and meta["attnkern_commit"]
    assert len(list(tmp_path.glob("*.json"))) == 3
    # resume: cached runs are not run again; the failed one runs again (now fixed)
    again = runner.run_jobs(importable, jobs(range(5)), tmp_path, experiment="toy", n_jobs=n_jobs, progress=False)
    assert again.cached == 3 and not again.failures and again.results["x2"]["result"]["y"] == 4
    assert again.results["x3"]["result"]["draw"] == rec["result"]["draw"]  # same seed, same draw


def test_cache_key_depends_on_every_option():
    base = runner.config_hash("copy", {"a": 1, "b": [1, 2]}, 0)
    assert base == runner.config_hash("copy", {"b": [1, 2], "a": 1}, 0)
    assert base != runner.config_hash("copy", {"a": 1, "b": [1, 3]}, 0)
    assert base != runner.config_hash("copy", {"a": 1, "b": [1, 2]}, 1)
    assert base != runner.config_hash("ktiw", {"a": 1, "b": [1, 2]}, 0)


def test_seeded_results_repeat(tmp_path, importable):
    a = runner.run_jobs(importable, jobs([7]), tmp_path / "a", experiment="toy", progress=False)
    b = runner.run_jobs(importable, jobs([7]), tmp_path / "b", experiment="toy", progress=False)
    assert a.results["x7"]["result"]["draw"] == b.results["x7"]["result"]["draw"]


def test_dask_local_cluster(tmp_path, importable):
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        sweep = runner.run_jobs(importable, jobs(range(3), fail=(1,)), tmp_path, experiment="toy",
                                executor="dask", scheduler=cluster.scheduler_address, progress=False)
    assert set(sweep.results) == {"x0", "x2"} and "x1" in sweep.failures
    assert sweep.results["x2"]["result"]["y"] == 4
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["ok"]


def test_runner_bad_arguments(tmp_path, importable):
    with pytest.raises(ValueError, match="executor"):
        runner.run_jobs(importable, [], tmp_path, experiment="toy", executor="ray")
    with pytest.raises(ValueError, match="n_jobs"):
        runner.run_jobs(importable, [], tmp_path, experiment="toy", n_jobs=0)
    with pytest.raises(ValueError, match="unique"):
        runner.run_jobs(importable, jobs([1]) * 2, tmp_path, experiment="toy")


def one_line_error(capsys, argv, code=2):
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkern-exp: error:") and "\n" not in err
    return err


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert "unknown experiment 'nope'" in one_line_error(capsys, ["nope", "--out", str(tmp_path)])
    assert "unknown dataset" in one_line_error(capsys, ["data", "fetch", "imdb"])
    assert cli.main(["--help"]) == 0 and "data fetch" in capsys.readouterr().out


def test_cli_list(capsys):
    assert cli.main(["list"]) == 0
    assert cli.main(["data", "list"]) == 0
    assert "vaderSentiment==3.3.2" in capsys.readouterr().out


def test_parse_normalizer():
    from attnkern.experiments.common import parse_normalizer

    assert parse_normalizer("softmax") == ("softmax", {})
    assert parse_normalizer("entmax1.25") == ("entmax", {"alpha": 1.25})
    assert parse_normalizer("entmax-learnable") == ("entmax", {"alpha": "learnable"})
    assert parse_normalizer("fusedmax") == ("fusedmax", {"lam": 1.0})
    assert parse_normalizer("oscarmax0.05") == ("oscarmax", {"lam": 0.05})
    assert parse_normalizer("crf") == ("crf", {}) and parse_normalizer("sparsemap") == ("sparsemap", {})
    for bad in ("relu", "entmax", "entmax0", "entmaxx", "fusedmax-1", "crf0.1", "oscarmaxx"):
        with pytest.raises(ValueError, match="normalizer"):
            parse_normalizer(bad)


def test_validate_common_options(tmp_path):

    p = cli._Parser()
    cli.add_common_arguments(p)
    ok = p.parse_args(["--out", str(tmp_path / "new")])
    cli.validate(ok)
    assert ok.out.is_dir() and ok.normalizers == ["softmax", "sparsemax", "entmax15"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv, match in [(["--out", str(blocker / "sub")], "--out"),
                        (["--out", str(tmp_path), "--normalizers", "relu"], "--normalizers"),
                        (["--out", str(tmp_path), "--scheduler", "tcp://x:1"], "--scheduler"),
                        (["--out", str(tmp_path), "--seeds", "0"], "--seeds"),
                        (["--out", str(tmp_path), "--jobs", "two"], "--jobs"),
                        (["--out", str(tmp_path), "--backend", "cuda"], "--backend")]:
        with pytest.raises(cli.UsageError, match=match):
            cli.validate(p.parse_args(argv))
    # validate() resolved --out to the directory it created, as a Path.
    assert ok.out == tmp_path / "new"


# --- what a cached run depends on: its data and its code ------------------------------------------------------

_READER = '''
from attnkern.experiments.data.sources import cache_path
from attnkern.experiments.interpret import metrics  # (in the code fingerprint)

VERSION = {version}


def read_job(config, seed):
    return {{"text": (cache_path("vader") / "x.txt").read_text(), "version": VERSION}}
'''


@pytest.fixture
def reader(tmp_path, monkeypatch):
    """A job module (written to tmp_path) that reads dataset "vader" from a data
    cache of its own; returns (load(version) -> job function, the data file)."""
    import importlib
    import sys

    data = tmp_path / "data" / "vader"
    data.mkdir(parents=True)
    (data / ".complete").write_text("")
    (data / "x.txt").write_text("first")
    monkeypatch.setenv("ATTNKERN_DATA", str(tmp_path / "data"))
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(version):
        (tmp_path / "reader_jobs.py").write_text(_READER.format(version=version))
        sys.modules.pop("reader_jobs", None)
        importlib.invalidate_caches()
        return importlib.import_module("reader_jobs").read_job

    yield load, data / "x.txt"
    sys.modules.pop("reader_jobs", None)


def _sweep(fn, cache):
    return runner.run_jobs(fn, [runner.Job("one", {"x": 1}, seed=0)], cache, experiment="reader", progress=False)


def test_unchanged_code_and_data_reuse_the_cache(tmp_path, reader):
    load, _ = reader
    first = _sweep(load(1), tmp_path / "cache")
    again = _sweep(load(1), tmp_path / "cache")
    assert first.cached == 0 and again.cached == 1 and again.results["one"]["result"]["text"] == "first"
    rec = again.results["one"]
    assert rec["data"] == {"vader": rec["data"]["vader"]} and rec["data"]["vader"]
    meta = rec["meta"]
    assert meta["code_fingerprint"] and meta["backend"] in ("cpu", "reference") and meta["backend_requested"] == "auto"
    assert "isa_level" in meta and meta["started"]


def test_changed_data_is_never_served_from_the_cache(tmp_path, reader):
    load, file = reader
    fn = load(1)
    assert _sweep(fn, tmp_path / "cache").results["one"]["result"]["text"] == "first"
    file.write_text("second, longer")
    sweep = _sweep(fn, tmp_path / "cache")
    assert sweep.cached == 0 and sweep.stale == 1 and sweep.results["one"]["result"]["text"] == "second, longer"


def test_changed_code_is_never_served_from_the_cache(tmp_path, reader, monkeypatch):
    load, _ = reader
    assert _sweep(load(1), tmp_path / "cache").cached == 0
    # the job's own module changed
    changed = _sweep(load(22), tmp_path / "cache")
    assert changed.cached == 0 and changed.results["one"]["result"]["version"] == 22
    assert _sweep(load(22), tmp_path / "cache").cached == 1
    # an attnkern module it imports (the metrics) changed
    from attnkern.experiments import provenance

    real = provenance._file_digest
    monkeypatch.setattr(provenance, "_file_digest",
                        lambda path: "edited" if path.name == "metrics.py" else real(path))
    assert _sweep(load(22), tmp_path / "cache").cached == 0


def test_the_import_closure_follows_attnkern_imports():
    from attnkern.experiments import provenance

    closure = provenance.import_closure("attnkern.experiments.interpret.importance")
    for name in ("attnkern", "attnkern.experiments.interpret.metrics", "attnkern.experiments.interpret.shared",
                 "attnkern.experiments.models", "attnkern.nn.rnn_attention", "attnkern.experiments.runner"):
        assert name in closure, name
    assert not any(n.startswith("attnkern.experiments.dynamics") for n in closure)


def test_nested_readings_record_their_own_reads():
    """A reading inside another whose set of names is equal to it (both read the same dataset) still closes as
    itself, and the outer one keeps collecting."""
    from attnkern.experiments import provenance

    with provenance.reading() as outer:
        provenance.note_read("vader")
        with provenance.reading() as inner:
            provenance.note_read("vader")
        provenance.note_read("bbc")
    assert outer == {"vader", "bbc"} and inner == {"vader"}
    assert not provenance._reading


def test_backend_kernels_refuses_without_the_compiled_kernels(tmp_path, monkeypatch):
    from attnkern import _extension

    p = cli._Parser()
    cli.add_common_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "o"), "--backend", "kernels"])
    monkeypatch.setattr(_extension, "LOADED", False)
    with pytest.raises(cli.UsageError, match="--backend: kernels"):
        cli.validate(args)
    monkeypatch.setattr(_extension, "LOADED", True)
    cli.validate(args)
    assert args.backend == "auto"
