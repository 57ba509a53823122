"""The copy experiment: end to end at a tiny scale, the kernels-vs-reference dynamics, and
(slow) the --quick run in the paper's direction."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attnkern.experiments import cli
from attnkern.experiments.seq2seq_train import train_copy


def test_copy_end_to_end_tiny(tmp_path, capsys):
    argv = ["copy", "--out", str(tmp_path), "--quick", "--seeds", "2", "--steps", "20", "--hidden", "16",
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
    assert cfg["scale"]["steps"] == 20 and cfg["scale"]["hidden_dim"] == 16 and cfg["seeds"] == 2
    assert res["meta"]["torch"] == torch.__version__ and res["meta"]["attnkern_commit"]
    md = (tmp_path / "copy.md").read_text()
    assert "paper (softmax)" in md and "about half fail" in md
    for png in ("copy_token_acc.png", "copy_attn_acc.png", "copy_success.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # a second run reads every run from the cache
    t = time.time()
    assert cli.main(argv) == 0
    assert json.loads((tmp_path / "copy.json").read_text())["sweep"]["runs_cached"] == 8
    assert time.time() - t < 10


def test_copy_bad_arguments(tmp_path, capsys):
    assert cli.main(["copy", "--out", str(tmp_path), "--distributions", "zipf"]) == 2
    assert "--distributions" in capsys.readouterr().err
    assert cli.main(["copy", "--out", str(tmp_path), "--normalizers", "relu"]) == 2
    assert "--normalizers" in capsys.readouterr().err


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
