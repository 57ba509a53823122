"""Agreement and divergence measures for the interpretability experiments.

Every divergence works on probability vectors along the last dimension of a tensor (numpy arrays and lists are
converted to float64 tensors), so one function serves the analysis code and the adversarial search, which needs
gradients. Logarithms are natural, so the Jensen-Shannon divergence lies in [0, ln 2].

Sparse attention (sparsemax, entmax) puts exact zeros in the distributions. The conventions used here:

- ``0 · log(0 / q) = 0`` for any q, so zeros in the first argument of KL cost nothing;
- ``p · log(p / 0) = +inf`` for p > 0: KL between sparse distributions with different supports is infinite, which
  is why the experiments fall back to JSD for sparse normalizers;
- JSD is always finite, and its gradient is finite at exact zeros (no ``0 · inf`` products in backward).

Kendall τ-b comes from :func:`scipy.stats.kendalltau`, which corrects for ties (sparse attention ties every token
outside the support at zero). A ranking of fewer than two items, or one where either sequence is constant, has no
defined τ: :func:`kendall_tau` returns NaN for both τ and p then, and :func:`summarize_kendall` counts such cases
apart instead of folding them into the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

__all__ = [
    "KendallResult",
    "KendallSummary",
    "jsd",
    "kendall_tau",
    "kl_divergence",
    "macro_f1",
    "summarize_kendall",
    "topk_agreement",
    "tvd",
]

_TINY = 1e-30


def _as_prob_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be a tensor or an array of numbers, got {type(x).__name__}") from exc
    if not t.is_floating_point():
        t = t.to(torch.float64)
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (a distribution along the last one)")
    return t


def _pair(p, q) -> tuple[torch.Tensor, torch.Tensor]:
    p = _as_prob_tensor(p, "p")
    q = _as_prob_tensor(q, "q")
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(f"p and q must have the same last dimension, got {tuple(p.shape)} and {tuple(q.shape)}")
    if p.dtype != q.dtype:
        dtype = torch.promote_types(p.dtype, q.dtype)
        p, q = p.to(dtype), q.to(dtype)
    return p, q


def tvd(p, q) -> torch.Tensor:
    """Total variation distance ``½ Σ_i |p_i − q_i|`` along the last dimension; shapes broadcast."""
    p, q = _pair(p, q)
    return 0.5 * (p - q).abs().sum(dim=-1)


def _kl_terms(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # p·(log p − log q) where p > 0 and 0 elsewhere; the clamps keep both where-branches finite so the gradient
    # at exact zeros is 0 rather than NaN.
    pos = p > 0
    terms = p * (torch.log(p.clamp_min(_TINY)) - torch.log(q.clamp_min(_TINY)))
    return torch.where(pos, terms, torch.zeros_like(terms))


def kl_divergence(p, q) -> torch.Tensor:
    """KL(p ‖ q) = Σ_i p_i log(p_i / q_i) along the last dimension, in nats.

    Terms with p_i = 0 are 0; a term with p_i > 0 and q_i = 0 makes the result +inf (q does not cover p's support).
    """
    p, q = _pair(p, q)
    kl = _kl_terms(p, q).sum(dim=-1)
    uncovered = ((p > 0) & (q <= 0)).any(dim=-1)
    return torch.where(uncovered, torch.full_like(kl, math.inf), kl)


def jsd(p, q) -> torch.Tensor:
    """Jensen-Shannon divergence ``½ KL(p ‖ m) + ½ KL(q ‖ m)`` with ``m = (p + q) / 2``, in nats (≤ ln 2).

    Finite for any pair of distributions, including sparse ones with disjoint supports, and differentiable there.
    """
    p, q = _pair(p, q)
    m = 0.5 * (p + q)
    return 0.5 * _kl_terms(p, m).sum(dim=-1) + 0.5 * _kl_terms(q, m).sum(dim=-1)


@dataclass(frozen=True)
class KendallResult:
    """Kendall τ-b between two rankings and its two-sided p-value (both NaN when τ is undefined)."""

    tau: float
    pvalue: float

    @property
    def defined(self) -> bool:
        return not math.isnan(self.tau)


def macro_f1(pred, labels) -> float:
    """The mean over the classes present in ``labels`` of each class's F1 (0 for a class never predicted
    correctly)."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    f1s = []
    for c in np.unique(labels):
        tp = np.sum((pred == c) & (labels == c))
        precision, recall = tp / max(np.sum(pred == c), 1), tp / max(np.sum(labels == c), 1)
        f1s.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return float(np.mean(f1s))


def _as_vector(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


def kendall_tau(x, y) -> KendallResult:
    """Kendall τ-b between two score vectors of one instance (scipy.stats.kendalltau, variant 'b').

    Undefined cases return ``KendallResult(nan, nan)``: fewer than two items, or a constant vector (no pair can be
    ordered, e.g. uniform attention, or a support of one token). With two items τ is ±1 and the exact p-value is 1:
    two items can never be significant.
    """
    a = _as_vector(x, "x")
    b = _as_vector(y, "y")
    if a.shape != b.shape:
        raise ValueError(f"x and y must have the same length, got {a.shape[0]} and {b.shape[0]}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("x and y must be finite")
    if a.shape[0] < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return KendallResult(math.nan, math.nan)
    res = stats.kendalltau(a, b, variant="b")
    return KendallResult(float(res.statistic), float(res.pvalue))


@dataclass(frozen=True)
class KendallSummary:
    """Mean ± std of τ over instances with a defined τ; ``sig_frac`` is over those same instances."""

    mean: float
    std: float
    sig_frac: float
    n: int
    n_undefined: int

    def as_dict(self, prefix: str) -> dict:
        return {
            f"{prefix}_tau_mean": self.mean,
            f"{prefix}_tau_std": self.std,
            f"{prefix}_sig_frac": self.sig_frac,
            f"{prefix}_n": self.n,
            f"{prefix}_undefined": self.n_undefined,
        }


def summarize_kendall(results, alpha: float = 0.05) -> KendallSummary:
    """Aggregate per-instance :class:`KendallResult` values as the paper's Table 2 does.

    Instances with an undefined τ are counted in ``n_undefined`` and left out of the mean, the (population) standard
    deviation and the significant fraction (p ≤ ``alpha``). With no defined instance every statistic is NaN.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    results = list(results)
    for r in results:
        if not isinstance(r, KendallResult):
            raise TypeError(f"results must hold KendallResult values, got {type(r).__name__}")
    defined = [r for r in results if r.defined]
    n_undefined = len(results) - len(defined)
    if not defined:
        return KendallSummary(math.nan, math.nan, math.nan, 0, n_undefined)
    taus = np.array([r.tau for r in defined])
    sig = np.array([r.pvalue <= alpha for r in defined])
    return KendallSummary(float(taus.mean()), float(taus.std()), float(sig.mean()), len(defined), n_undefined)


def _top_indices(x: np.ndarray, k: int) -> set[int]:
    # Stable sort on the negated scores: among tied scores the earlier position wins, so the set is deterministic.
    return set(np.argsort(-x, kind="stable")[:k].tolist())


def topk_agreement(x, y, k: int) -> float:
    """Fraction of the k highest-scored positions of ``x`` that are also among the k highest of ``y``.

    ``k`` is clipped to the sequence length (so a 3-token sentence at k = 5 compares all 3 positions and scores 1).
    Ties are broken by position, earliest first. Returns NaN for an empty sequence.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    a = _as_vector(x, "x")
    b = _as_vector(y, "y")
    if a.shape != b.shape:
        raise ValueError(f"x and y must have the same length, got {a.shape[0]} and {b.shape[0]}")
    n = a.shape[0]
    if n == 0:
        return math.nan
    kk = min(int(k), n)
    return len(_top_indices(a, kk) & _top_indices(b, kk)) / kk


def nested_bootstrap_interval(groups, level: float = 0.95, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile interval of the mean of per-instance values grouped by seed: each
    bootstrap draw resamples the seeds with replacement, then the instances within each
    drawn seed, and takes the mean of every value drawn. Seeds and instances are both
    sources of spread, so the interval covers a rerun with other seeds, not only other
    test instances. NaN values are left out; (nan, nan) without any value."""
    arrays = [np.asarray(g, dtype=float) for g in groups]
    arrays = [a[np.isfinite(a)] for a in arrays]
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return math.nan, math.nan
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for b in range(n_boot):
        picked = rng.integers(0, len(arrays), len(arrays))
        total, count = 0.0, 0
        for i in picked:
            a = arrays[i]
            draw = a[rng.integers(0, a.size, a.size)]
            total += float(draw.sum())
            count += a.size
        means[b] = total / count
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)
