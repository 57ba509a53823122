"""IBM Model 1 (Brown et al., 1993) trained by EM: word translation probabilities
t(o | i) learned from sentence-pair co-occurrence alone, with uniform alignments
as the starting point — the classical counterpart of "knowledge to translate
individual words" in attention models.

Sentences are padded int arrays: src (N, T) and tgt (N, L) with masks; ids index
dense (V_out, V_in) tables, so keep vocabularies to a few thousand words.
"""

from __future__ import annotations

import numpy as np


def train_ibm1(src: np.ndarray, src_mask: np.ndarray, tgt: np.ndarray, tgt_mask: np.ndarray, n_src: int,
               n_tgt: int, iterations: int = 10) -> tuple[np.ndarray, list[float]]:
    """EM for t(o | i), starting uniform. Returns (t of shape (n_tgt, n_src), the
    average log-likelihood per target word after each iteration).

    Only word pairs that co-occur in some sentence pair can get probability, so EM
    runs on the vector of those pairs (a few hundred thousand for thousands of
    words) rather than on the dense table."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if src.shape[0] != tgt.shape[0]:
        raise ValueError(f"src and tgt must have the same number of sentences, got {src.shape[0]} and {tgt.shape[0]}")
    sm, om = src_mask.astype(bool), tgt_mask.astype(bool)
    valid = om[:, :, None] & sm[:, None, :]                               # (N, L, T)
    pair = tgt.astype(np.int64)[:, :, None] * n_src + src.astype(np.int64)[:, None, :]
    uniq, inverse = np.unique(np.where(valid, pair, -1), return_inverse=True)
    inverse = inverse.reshape(pair.shape)
    if uniq.size and uniq[0] == -1:  # the padding slot
        keep = slice(1, None)
    else:
        keep = slice(0, None)
    src_of = np.where(uniq >= 0, uniq % n_src, 0)
    t_vec = np.where(uniq >= 0, 1.0 / n_tgt, 0.0)
    n_src_words = np.maximum(sm.sum(1), 1)[:, None]
    history = []
    for _ in range(iterations):
        p = t_vec[inverse] * valid
        z = p.sum(-1, keepdims=True)
        post = np.where(z > 0, p / np.where(z > 0, z, 1), 0)
        counts = np.bincount(inverse.ravel(), weights=post.ravel(), minlength=uniq.size)
        counts[uniq < 0] = 0
        total = np.bincount(src_of, weights=counts, minlength=n_src)
        t_vec = np.where(total[src_of] > 0, counts / np.where(total[src_of] > 0, total[src_of], 1), 0)
        t_vec[uniq < 0] = 0
        ll = (np.log(np.maximum(z[..., 0] / n_src_words, 1e-300)) * om).sum()
        history.append(float(ll / max(int(om.sum()), 1)))
    t = np.zeros((n_tgt, n_src))
    t.flat[uniq[keep]] = t_vec[keep]
    return t, history


def ibm1_posteriors(t: np.ndarray, src: np.ndarray, src_mask: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Alignment posteriors p(a_l = j | pair) ∝ t(o_l | i_j), (N, L, T), zero at padding."""
    p = t[tgt[:, :, None], src[:, None, :]] * src_mask[:, None, :]
    z = p.sum(-1, keepdims=True)
    return np.where(z > 0, p / np.where(z > 0, z, 1), 0)
