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
               n_tgt: int, iterations: int = 10, chunk: int = 512) -> tuple[np.ndarray, list[float]]:
    """EM for t(o | i), starting uniform. Returns (t of shape (n_tgt, n_src), the
    average log-likelihood per target word after each iteration)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if src.shape[0] != tgt.shape[0]:
        raise ValueError(f"src and tgt must have the same number of sentences, got {src.shape[0]} and {tgt.shape[0]}")
    t = np.full((n_tgt, n_src), 1.0 / n_tgt)
    history = []
    for _ in range(iterations):
        counts = np.zeros_like(t)
        ll, words = 0.0, 0
        for i in range(0, src.shape[0], chunk):
            s, sm = src[i:i + chunk], src_mask[i:i + chunk]
            o, om = tgt[i:i + chunk], tgt_mask[i:i + chunk]
            p = t[o[:, :, None], s[:, None, :]] * sm[:, None, :]  # (n, L, T)
            z = p.sum(-1, keepdims=True)
            post = np.where(z > 0, p / np.where(z > 0, z, 1), 0) * om[:, :, None]
            flat = (np.broadcast_to(o[:, :, None], post.shape) * n_src + np.broadcast_to(s[:, None, :], post.shape))
            counts += np.bincount(flat.ravel(), weights=post.ravel(), minlength=counts.size).reshape(counts.shape)
            n_src_words = np.maximum(sm.sum(1), 1)[:, None]
            ll += float((np.log(np.maximum(z[..., 0] / n_src_words, 1e-300)) * om).sum())
            words += int(om.sum())
        total = counts.sum(0, keepdims=True)
        t = np.where(total > 0, counts / np.where(total > 0, total, 1), 1.0 / n_tgt)
        history.append(ll / max(words, 1))
    return t, history


def ibm1_posteriors(t: np.ndarray, src: np.ndarray, src_mask: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Alignment posteriors p(a_l = j | pair) ∝ t(o_l | i_j), (N, L, T), zero at padding."""
    p = t[tgt[:, :, None], src[:, None, :]] * src_mask[:, None, :]
    z = p.sum(-1, keepdims=True)
    return np.where(z > 0, p / np.where(z > 0, z, 1), 0)
