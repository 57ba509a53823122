"""The copy experiment: end to end at a tiny scale, the kernels-vs-reference dynamics, and
(slow) the --quick run in the paper's direction."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attnkern.experiments import cli
from attnkern.experiments.dynamics.seq2seq_train import train_copy


def test_copy_end_to_end_tiny(tmp_path, capsys):
    argv = ["copy", "--out", str(tmp_path), "--quick", "--seeds", "1", "--steps", "20", "--hidden", "16",
            "--batch", "16", "--distributions", "iid", "permutation", "--normalizers", "softmax", "sparsemax",
            "--no-progress"]
    assert cli.main(argv) == 0
    res = json.loads((tmp_path / "copy.json").read_text())
    sr = res["summary"]["success_rate"]
    assert set(sr) == {"iid", "permutation"} and set(sr["iid"]) == {"softmax", "sparsemax"}
    assert all(0 <= v <= 1 for d in sr.values() for v in d.values())
    curve = res["summary"]["curves"]["iid"]["softmax"]["seed0"]
    assert curve["step"][-1] == 20 and len(curve["token_acc"]) == len(curve["attn_acc"]) == len(curve["step"])
    cfg = res["config"]
    assert cfg["scale"]["steps"] == 20 and cfg["scale"]["hidden_dim"] == 16 and cfg["seeds"] == 1
    assert res["meta"]["torch"] == torch.__version__ and res["meta"]["attnkern_commit"]
    md = (tmp_path / "copy.md").read_text()
    assert "paper (softmax)" in md and "about half fail" in md and "learned the alignment" in md
    aligned, seeds = res["summary"]["attention_aligned"]["permutation"]["sparsemax"]
    last = res["summary"]["curves"]["permutation"]["sparsemax"]["seed0"]["attn_acc"][-1]
    assert seeds == 1 and aligned == int(last >= 0.5)
    sv = res["summary"]["survival"]["iid"]["softmax"]
    assert sv["seeds"] == len(res["summary"]["curves"]["iid"]["softmax"]) and sv["step"][0] == 0
    assert sv["not_yet"][0] == 1.0 and all(a >= b for a, b in zip(sv["not_yet"][:-1], sv["not_yet"][1:], strict=True))
    for png in ("copy_token_acc.png", "copy_attn_acc.png", "copy_success.png", "copy_survival.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # a second run reads every run from the cache
    t = time.time()
    assert cli.main(argv) == 0
    assert json.loads((tmp_path / "copy.json").read_text())["sweep"]["runs_cached"] == 4
    assert time.time() - t < 10


def test_aligned_seeds_counts_the_last_evaluation():
    from attnkern.experiments.dynamics.copy_task import ALIGNED, aligned_seeds

    curves = {"permutation": {"softmax": {"seed0": {"attn_acc": [0.9, 0.0]}, "seed1": {"attn_acc": [0.1, 0.99]},
                                          "seed2": {"attn_acc": [ALIGNED]}}},
              "iid": {"softmax": {"seed0": {"attn_acc": [0.2, ALIGNED - 1e-9]}}}}
    assert aligned_seeds(curves) == {"permutation": {"softmax": [2, 3]}, "iid": {"softmax": [0, 1]}}


def test_copy_output_layer_option(tmp_path):
    argv = ["copy", "--out", str(tmp_path), "--quick", "--seeds", "1", "--steps", "10", "--hidden", "16",
            "--batch", "8", "--distributions", "iid", "--normalizers", "softmax", "--output", "context",
            "--no-progress"]
    assert cli.main(argv) == 0
    res = json.loads((tmp_path / "copy.json").read_text())
    assert res["config"]["scale"]["output"] == "context"
    assert "W_o c (the slides' simplified model" in (tmp_path / "copy.md").read_text()
    assert cli.main(argv[:-3] + ["--output", "linear"]) == 2


def test_copy_with_structured_normalizers(tmp_path):
    argv = ["copy", "--out", str(tmp_path), "--quick", "--seeds", "1", "--steps", "10", "--hidden", "16",
            "--batch", "8", "--distributions", "iid", "--normalizers", "oscarmax0.1", "sparsemap", "--no-progress"]
    assert cli.main(argv) == 0
    sr = json.loads((tmp_path / "copy.json").read_text())["summary"]["success_rate"]
    assert set(sr["iid"]) == {"oscarmax0.1", "sparsemap"}


def test_copy_bad_arguments(tmp_path, capsys):
    assert cli.main(["copy", "--out", str(tmp_path), "--distributions", "zipf"]) == 2
    assert "--distributions" in capsys.readouterr().err
    assert cli.main(["copy", "--out", str(tmp_path), "--normalizers", "relu"]) == 2
    assert "--normalizers" in capsys.readouterr().err
    assert cli.main(["copy", "--out", str(tmp_path / "never-made"), "--calibrate", "-5"]) == 2
    assert "argument --calibrate" in capsys.readouterr().err
    assert not (tmp_path / "never-made").exists()


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15"])
def test_kernels_reproduce_reference_dynamics(normalizer):
    """50 training steps from the same seed on the CPU kernels and on the float64
    reference: the losses agree within 1e-3 (relative) at every step."""
    cfg = dict(distribution="iid", normalizer=normalizer, hidden_dim=32, embed_dim=32, batch=32, steps=50,
               eval_every=50, final_samples=50)
    kern = train_copy({**cfg, "backend": "auto"}, seed=0)["train_loss"]
    ref = train_copy({**cfg, "backend": "reference"}, seed=0)["train_loss"]
    assert len(kern) == len(ref) == 50
    rel = [abs(a - b) / abs(b) for a, b in zip(kern, ref, strict=True)]
    assert max(rel) < 1e-3, f"max relative loss difference {max(rel):.2e} at step {rel.index(max(rel)) + 1}"
    assert kern[-1] < kern[0]  # and it trains


@pytest.mark.slow
def test_copy_quick_iid_beats_permutation(tmp_path):
    """`attnkern-exp copy --quick` for the paper's cell (softmax) on 2 processes: iid
    succeeds more often than permutation, as in the paper's slides."""
    start = time.time()
    argv = ["copy", "--out", str(tmp_path), "--quick", "--normalizers", "softmax", "--jobs", "2", "--no-progress"]
    assert cli.main(argv) == 0
    res = json.loads((tmp_path / "copy.json").read_text())
    sr = res["summary"]["success_rate"]
    assert res["config"]["seeds"] >= 6 and not res["sweep"]["failures"]
    assert sr["iid"]["softmax"] > sr["permutation"]["softmax"], sr
    assert time.time() - start < 600


def test_failed_runs_are_named_and_the_others_kept(tmp_path, monkeypatch, capsys):
    from attnkern.experiments.dynamics import copy_task

    real = copy_task.train_copy

    def flaky(config, seed):
        if config["distribution"] == "permutation" and seed == 1:
            raise RuntimeError("simulated crash")
        return real(config, seed)

    # (the cache key fingerprints the job function's module: the stand-in counts as the real one, so that the
    # rerun with the real function finds the runs that succeeded)
    flaky.__module__ = real.__module__
    monkeypatch.setattr(copy_task, "train_copy", flaky)
    argv = ["copy", "--out", str(tmp_path), "--quick", "--seeds", "2", "--steps", "4", "--hidden", "8", "--batch",
            "4", "--normalizers", "softmax", "--distributions", "iid", "permutation", "--no-progress"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "1 run(s) failed" in err and "permutation/softmax/seed1" in err
    res = json.loads((tmp_path / "copy.json").read_text())
    assert "simulated crash" in res["sweep"]["failures"]["permutation/softmax/seed1"]
    assert res["summary"]["success_rate"]["iid"]["softmax"] is not None
    assert "Failed runs" in (tmp_path / "copy.md").read_text()
    monkeypatch.setattr(copy_task, "train_copy", real)  # the rerun completes the missing run only
    assert cli.main(argv) == 0
    assert json.loads((tmp_path / "copy.json").read_text())["sweep"]["runs_cached"] == 3


def test_survival_counts_seeds_not_yet_successful_and_censors_the_rest():
    from attnkern.experiments.dynamics.copy_task import survival

    sv = survival([50, None, 25, 50, None], budget=100)
    assert sv["step"] == [0, 25, 50, 100]
    assert sv["not_yet"] == pytest.approx([1.0, 0.8, 0.4, 0.4])
    assert sv["censored"] == 2 and sv["seeds"] == 5
    assert survival([None, None], budget=10) == {"step": [0, 10], "not_yet": [1.0, 1.0], "censored": 2, "seeds": 2}
