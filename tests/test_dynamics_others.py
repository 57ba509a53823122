"""relevance, ktiw, ibm1 and multihead end to end at a tiny scale; the shared measures."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_experiment
from scipy.stats import kendalltau

from attnkern.experiments import cli
from attnkern.experiments.common import kendall_tau_rows, shuffle_rows
from attnkern.experiments.dynamics.ibm1_model import ibm1_posteriors, train_ibm1

TINY = ["--quick", "--seeds", "1", "--normalizers", "softmax", "sparsemax", "--no-progress"]


def run_cli(tmp_path, name, *extra):
    res, md = run_experiment(name, tmp_path, *TINY, *extra)
    assert res["meta"]["attnkern_commit"]
    for p in res["plots"]:  # (a real plot, not an empty canvas)
        assert (tmp_path / p).stat().st_size > 1000
    return res, md


def test_relevance_keyword_tiny(tmp_path):
    res, md = run_cli(tmp_path, "relevance", "--datasets", "keyword", "--steps", "30")
    cell = res["summary"]["keyword"]["softmax"]
    for k in ("tau_a_r_standard", "tau_runiform_a_standard", "keyword_r_uniform", "other_r_uniform"):
        assert np.isfinite(cell[k][0])
    curve = cell["curves"]["seed0"]
    assert curve["step"][0] == 0 and curve["step"][-1] == 30
    assert "attracted to larger r" in md and "sparsemax" in md


def test_relevance_rotten_needs_fetched_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNKERN_DATA", str(tmp_path / "empty-cache"))
    assert cli.main(["relevance", "--out", str(tmp_path), "--datasets", "rotten", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert "attnkern-exp data fetch vader" in err and "\n" not in err


def test_ktiw_then_ibm1_tiny_share_runs(tmp_path):
    from attnkern.experiments.data.translation import DEFAULT_DIR

    datasets = ["copy-iid", "copy-permutation"] + (["en-de"] if list(DEFAULT_DIR.glob("*.mo")) else [])
    opts = ["--datasets", *datasets, "--steps", "8", "--hidden", "16", "--probe", "40"]
    res, md = run_cli(tmp_path, "ktiw", *opts)
    for ds in datasets:
        cell = res["summary"][ds]["sparsemax"]
        assert 0 <= cell["beta_uniform_vs_attention_top1"][0] <= 1
        assert np.isfinite(cell["beta_uniform_vs_attention_tau_shuffled"][0])
    assert "top-1 β(uniform) = a(standard)" in md
    res, md = run_cli(tmp_path, "ibm1", *opts)
    assert res["sweep"]["runs_cached"] == res["sweep"]["runs_total"] == 2 * len(datasets)
    s = res["summary"]
    # co-occurrence identifies the copy alignment under iid sampling, and says nothing under permutations
    assert s["copy-iid"]["softmax"]["ibm1_alignment_token_accuracy"] > 0.9
    assert s["copy-permutation"]["softmax"]["ibm1_alignment_token_accuracy"] < 0.3
    assert np.isfinite(s["copy-iid"]["softmax"]["ibm1_vs_attention_top1"][0])
    assert "IBM1 alignment token accuracy" in md


def test_multihead_tiny(tmp_path):
    res, md = run_cli(tmp_path, "multihead", "--heads", "2", "--single-seeds", "3", "--steps", "6")
    cell = res["summary"]["softmax"]
    assert len(cell["single_final_acc"]) == 3 and "2 random" in cell["multi"]
    assert all(m["success_rate"] is not None for m in cell["multi"].values())
    assert "single head" in md


def test_kendall_tau_rows_matches_scipy():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 4, 9)), rng.integers(0, 3, size=(30, 4, 9)).astype(float)  # ties in y
    mask = np.arange(9) < rng.integers(2, 10, (30, 1, 1))
    t = kendall_tau_rows(x, y, mask)
    for i in range(30):
        n = int(mask[i, 0].sum())
        for j in range(4):
            ref = kendalltau(x[i, j, :n], y[i, j, :n]).statistic
            assert (np.isnan(ref) and np.isnan(t[i, j])) or abs(ref - t[i, j]) < 1e-12
    sh = shuffle_rows(x, mask, rng)
    for i in range(30):
        n = int(mask[i, 0].sum())
        assert np.allclose(np.sort(sh[i, 0, :n]), np.sort(x[i, 0, :n])) and np.all(sh[i, 0, n:] == x[i, 0, n:])


def test_ibm1_learns_a_dictionary():
    """Two-word sentences where 'a'->'A' always co-occur: EM finds t(A | a) > t(A | other)."""
    rng = np.random.default_rng(0)
    src = np.stack([np.ones(200, int), rng.integers(2, 6, 200)], 1)  # word 1 in every sentence
    tgt = np.stack([np.ones(200, int), src[:, 1]], 1)               # output k for input k
    m = np.ones_like(src, dtype=bool)
    t, ll = train_ibm1(src, m, tgt, m, 6, 6, iterations=15)
    assert ll[-1] > ll[0]
    for k in range(2, 6):
        assert t[k, k] > 0.9
    post = ibm1_posteriors(t, src, m, tgt)
    assert (post[:, 1].argmax(-1) == 1).all()
    with pytest.raises(ValueError, match="iterations"):
        train_ibm1(src, m, tgt, m, 6, 6, iterations=0)


def test_relevance_tau_on_the_support_ignores_the_ties_of_zero_attention():
    """Over all tokens the zeros of sparse attention, all below the support, agree with
    any relevance that is low there; on the support the order is the reverse."""
    from attnkern.experiments.dynamics.relevance import _support_taus, _taus

    a = np.array([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [0.7, 0.3, 0.0, 0.0, 0.0, 0.0]])
    r = np.array([[1.0, 2.0, 3.0, -1.0, -2.0, -3.0], [1.0, 2.0, 0.0, -1.0, -2.0, -3.0]])
    mask = np.ones_like(a, dtype=bool)
    assert _taus(a, r, mask) > 0.3
    tau, coverage = _support_taus(a, r, mask)
    assert tau == pytest.approx(-1.0) and coverage == 0.5  # (the second sentence has 2 support tokens)
