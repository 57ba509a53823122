"""The interpretability metrics against cases worked out by hand."""

import math

import numpy as np
import pytest
import torch

from attnkern.experiments.interpret.metrics import (
    KendallResult,
    jsd,
    kendall_tau,
    kl_divergence,
    summarize_kendall,
    topk_agreement,
    tvd,
)

LN2 = math.log(2.0)


# Kendall τ-b = (C − D) / sqrt((n0 − n1)(n0 − n2)), n0 = n(n−1)/2, n1 / n2 = pairs tied in x / y.


def test_kendall_identical_ranking_exact_pvalue():
    r = kendall_tau([1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
    assert r.tau == pytest.approx(1.0)
    # exact null distribution for n = 3: 1 of 6 permutations reaches τ = 1, two-sided p = 2/6
    assert r.pvalue == pytest.approx(1.0 / 3.0)


def test_kendall_one_discordant_pair():
    # pairs of (1,2,3,4) vs (1,3,2,4): only (2nd, 3rd) is discordant: C = 5, D = 1, τ = 4/6
    r = kendall_tau([1, 2, 3, 4], [1, 3, 2, 4])
    assert r.tau == pytest.approx(4.0 / 6.0)


def test_kendall_tie_in_one_vector():
    # x ties its first two items: n1 = 1; the 5 other pairs are concordant: τ_b = 5 / sqrt(5 · 6)
    r = kendall_tau([1, 1, 2, 3], [1, 2, 3, 4])
    assert r.tau == pytest.approx(5.0 / math.sqrt(30.0))


def test_kendall_sparse_attention_ties_at_zero():
    # sparse attention: two tokens at 0.5 and two outside the support; n1 = 2 tied pairs, C = 4, D = 0
    r = kendall_tau([0.5, 0.5, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1])
    assert r.tau == pytest.approx(4.0 / math.sqrt(24.0))
    r = kendall_tau([0.0, 0.0, 0.5, 0.5], [0.4, 0.3, 0.2, 0.1])
    assert r.tau == pytest.approx(-4.0 / math.sqrt(24.0))


def test_kendall_two_items_never_significant():
    r = kendall_tau([1.0, 2.0], [2.0, 1.0])
    assert r.tau == pytest.approx(-1.0)
    assert r.pvalue == pytest.approx(1.0)


@pytest.mark.parametrize(
    "x, y",
    [([0.7], [0.3]), ([], []), ([0.5, 0.5], [1.0, 2.0]), ([1.0, 0.0, 0.0], [2.0, 2.0, 2.0])],
    ids=["one-item", "empty", "uniform-attention", "constant-importance"],
)
def test_kendall_undefined_cases_are_nan(x, y):
    r = kendall_tau(x, y)
    assert not r.defined
    assert math.isnan(r.tau) and math.isnan(r.pvalue)


def test_kendall_accepts_tensors_and_rejects_bad_input():
    r = kendall_tau(torch.tensor([0.1, 0.2, 0.7]), torch.tensor([3.0, 2.0, 1.0]))
    assert r.tau == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="same length"):
        kendall_tau([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="one-dimensional"):
        kendall_tau([[1, 2]], [[1, 2]])
    with pytest.raises(ValueError, match="finite"):
        kendall_tau([1.0, float("nan")], [1.0, 2.0])


def test_summarize_kendall_leaves_undefined_out():
    s = summarize_kendall([KendallResult(0.5, 0.01), KendallResult(0.1, 0.5), KendallResult(math.nan, math.nan)])
    assert s.mean == pytest.approx(0.3)
    assert s.std == pytest.approx(0.2)
    assert s.sig_frac == pytest.approx(0.5)
    assert (s.n, s.n_undefined) == (2, 1)
    d = s.as_dict("gradient")
    assert d["gradient_tau_mean"] == pytest.approx(0.3) and d["gradient_undefined"] == 1
    empty = summarize_kendall([KendallResult(math.nan, math.nan)])
    assert math.isnan(empty.mean) and empty.n == 0 and empty.n_undefined == 1
    with pytest.raises(TypeError, match="KendallResult"):
        summarize_kendall([0.3])
    with pytest.raises(ValueError, match="alpha"):
        summarize_kendall([], alpha=1.5)


def test_tvd_hand_values():
    assert float(tvd([0.5, 0.5, 0.0], [0.0, 0.5, 0.5])) == pytest.approx(0.5)
    assert float(tvd([1.0, 0.0], [0.0, 1.0])) == pytest.approx(1.0)
    batch = tvd(torch.tensor([[0.2, 0.8], [0.5, 0.5]]), torch.tensor([[0.2, 0.8], [0.0, 1.0]]))
    assert torch.allclose(batch, torch.tensor([0.0, 0.5]))


def test_kl_with_zeros():
    # zeros in p cost nothing: KL([.5,.5,0] || [.25,.25,.5]) = ln 2
    assert float(kl_divergence([0.5, 0.5, 0.0], [0.25, 0.25, 0.5])) == pytest.approx(LN2)
    # q misses part of p's support: infinite
    assert math.isinf(float(kl_divergence([0.25, 0.25, 0.5], [0.5, 0.5, 0.0])))
    assert float(kl_divergence([0.0, 1.0], [0.0, 1.0])) == 0.0
    batch = kl_divergence(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
    assert math.isinf(float(batch[0])) and float(batch[1]) == 0.0


def test_jsd_hand_values():
    # disjoint supports: the maximum, ln 2
    assert float(jsd([1.0, 0.0], [0.0, 1.0])) == pytest.approx(LN2)
    # overlapping sparse supports: m = [.25,.5,.25], each KL is ½ ln 2
    assert float(jsd([0.5, 0.5, 0.0], [0.0, 0.5, 0.5])) == pytest.approx(0.5 * LN2)
    assert float(jsd([0.2, 0.3, 0.5], [0.2, 0.3, 0.5])) == pytest.approx(0.0, abs=1e-15)
    p, q = [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]
    assert float(jsd(p, q)) == pytest.approx(float(jsd(q, p)))


def test_jsd_gradient_finite_at_exact_zeros():
    p = torch.tensor([0.0, 0.3, 0.7], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    jsd(p, q).backward()
    assert torch.isfinite(p.grad).all()
    # against central differences on the support coordinates (the zero one is at a kink of the domain)
    eps = 1e-6
    for i in (1, 2):
        e = torch.zeros(3, dtype=torch.float64)
        e[i] = eps
        fd = (jsd(p.detach() + e, q) - jsd(p.detach() - e, q)) / (2 * eps)
        assert float(p.grad[i]) == pytest.approx(float(fd), rel=1e-5)


def test_divergences_reject_mismatched_shapes_and_bad_types():
    with pytest.raises(ValueError, match="last dimension"):
        tvd([0.5, 0.5], [1.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="p must be"):
        jsd(["a", "b"], [0.5, 0.5])
    with pytest.raises(ValueError, match="at least one dimension"):
        jsd(0.5, 0.5)


def test_topk_agreement_hand_values():
    att = [0.6, 0.4, 0.0, 0.0, 0.0]
    imp = [0.1, 0.5, 0.3, 0.05, 0.05]
    assert topk_agreement(att, imp, 1) == 0.0
    assert topk_agreement(att, imp, 2) == 0.5
    # ties at zero are broken by position: attention's top 3 is {0, 1, 2}, importance's is {1, 2, 0}
    assert topk_agreement(att, imp, 3) == 1.0
    # k larger than the sentence compares every position
    assert topk_agreement(att, imp, 10) == 1.0
    assert topk_agreement(np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0]), 1) == 0.0
    assert math.isnan(topk_agreement([], [], 3))


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_topk_agreement_rejects_bad_k(k):
    with pytest.raises(ValueError, match="k must be"):
        topk_agreement([1.0, 2.0], [2.0, 1.0], k)


def test_topk_counts_only_instances_with_a_support_above_k():
    """An instance whose attention has k or fewer non-zero tokens agrees on top-k by
    construction (its zeros tie, broken by position as the gradient's zeros are):
    the table's top-k leaves it out and reports the fraction it kept."""
    from attnkern.experiments.interpret.importance import TOPK, summarize

    tied = [1.0] * len(TOPK)            # support of 2 tokens: agrees everywhere
    real = [0.0, 0.5, 1 / 3, 0.25, 0.2]  # support of 6 tokens
    per = {"pred": [0, 1], "label": [0, 1], "length": [8, 8], "support": [2, 6],
           "grad": [[0.1, 0.5], [0.2, 0.5]], "loo": [[0.1, 0.5], [0.2, 0.5]],
           "grad_supp": [[0.1, 0.5], [0.2, 0.5]], "loo_supp": [[0.1, 0.5], [0.2, 0.5]],
           "topk_grad": [tied, real], "topk_loo": [tied, real]}
    out = summarize(per)
    for j, k in enumerate(TOPK):
        want = (tied[j] + real[j]) / 2 if k < 2 else real[j]
        assert out["gradient_topk"][str(k)] == pytest.approx(want), k
        assert out["gradient_topk_coverage"][str(k)] == (1.0 if k < 2 else 0.5), k


def test_erasure_compares_the_orders_on_the_instances_every_order_flips():
    from attnkern.experiments.interpret.erasure import ORDERS, summarize

    # instance 0 flips under every order; instance 1 only when erased by attention (after 4 of 10 items)
    per = {"length": [10, 10], "support": [10, 10]}
    for i, name in enumerate(ORDERS):
        per[f"{name}_items"] = [i + 1, 4 if name == "attention" else 0]
        per[f"{name}_mass"] = [0.1 * (i + 1), 0.9 if name == "attention" else 0.0]
    out = summarize(per)
    assert out["common_frac"] == 0.5
    assert out["attention"]["flip_frac"] == 1.0 and out["random"]["flip_frac"] == 0.5
    assert out["attention"]["items_frac_mean"] == pytest.approx((0.1 + 0.4) / 2)
    for i, name in enumerate(ORDERS):
        assert out[name]["items_frac_common"] == pytest.approx((i + 1) / 10), name
        assert out[name]["mass_common"] == pytest.approx(0.1 * (i + 1)), name


def test_nested_bootstrap_interval_covers_the_seed_spread():
    """Two seeds whose instances sit at 0.2 and 0.6: the interval of the mean spans the
    seeds' spread (resampling the seeds), not just the instances' (none within a seed)."""
    from attnkern.experiments.interpret.metrics import nested_bootstrap_interval

    lo, hi = nested_bootstrap_interval([[0.2] * 50, [0.6] * 50])
    assert lo == pytest.approx(0.2) and hi == pytest.approx(0.6)
    # one seed: the instances' spread only, around their mean
    g = np.random.default_rng(0).normal(0.3, 0.1, 400)
    lo, hi = nested_bootstrap_interval([g])
    assert lo < g.mean() < hi and hi - lo == pytest.approx(2 * 1.96 * 0.1 / 20, rel=0.25)
    assert np.isnan(nested_bootstrap_interval([[np.nan], []])[0])
    with pytest.raises(ValueError, match="level"):
        nested_bootstrap_interval([[1.0]], level=1.5)


def test_macro_f1_by_hand():
    from attnkern.experiments.interpret.metrics import macro_f1

    # class 0: tp 1, predicted 2, true 2 -> F1 0.5; class 1 likewise 0.5; class 2: always right -> 1
    assert macro_f1([0, 1, 1, 0, 2], [0, 0, 1, 1, 2]) == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert macro_f1([1, 1], [0, 0]) == 0.0
