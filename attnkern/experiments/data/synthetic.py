"""Synthetic tasks generated in code from a seed: sequence copying and keyword classification."""

from __future__ import annotations

import torch

COPY_DISTRIBUTIONS = ("iid", "permutation", "subset")


class CopyTask:
    """Copy a length-`length` sequence (the paper's task: length 40).

    distribution:
      "permutation"  a random permutation of `length` tokens: every token once per sequence, so
                     word co-occurrence carries no information about which input maps to which output;
      "iid"          `length` tokens drawn i.i.d. uniformly from `length` tokens;
      "subset"       `length` distinct tokens out of `subset_vocab` (60 in the paper's variant).
    Source ids: 0 is padding, the n tokens are 1..n. Target ids: 0 padding, 1 BOS,
    source token i is output token i + 1 (its own output vocabulary).
    """

    pad_idx, bos_idx = 0, 1

    def __init__(self, distribution: str, length: int = 40, subset_vocab: int = 60):
        if distribution not in COPY_DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {COPY_DISTRIBUTIONS}, got {distribution!r}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            raise ValueError(f"length must be an int >= 2, got {length!r}")
        if distribution == "subset" and subset_vocab < length:
            raise ValueError(f"subset_vocab ({subset_vocab}) must be >= length ({length})")
        self.distribution, self.length = distribution, length
        self.n_tokens = subset_vocab if distribution == "subset" else length
        self.src_vocab = self.n_tokens + 1
        self.tgt_vocab = self.n_tokens + 2

    def sample(self, batch: int, generator: torch.Generator):
        """(src (B, L), src_mask (B, L) all True, tgt_in (B, L) BOS-shifted, tgt (B, L))."""
        L, n = self.length, self.n_tokens
        if self.distribution == "iid":
            src = torch.randint(1, n + 1, (batch, L), generator=generator)
        else:
            src = torch.rand(batch, n, generator=generator).argsort(-1)[:, :L] + 1
        tgt = src + 1
        tgt_in = torch.cat([torch.full((batch, 1), self.bos_idx, dtype=torch.long), tgt[:, :-1]], 1)
        return src, torch.ones_like(src, dtype=torch.bool), tgt_in, tgt


class KeywordTask:
    """Binary classification where one keyword decides the label.

    Each sentence has `min_len`..`max_len` filler tokens drawn uniformly from
    `n_filler` words, and one keyword inserted at a random position: a positive
    keyword (label 1) or a negative one (label 0), `n_keywords` of each.
    Ids: 0 padding, fillers 1..n_filler, then the positive and the negative keywords.
    """

    def __init__(self, n_filler: int = 200, n_keywords: int = 5, min_len: int = 8, max_len: int = 20):
        if n_filler < 1 or n_keywords < 1 or not 1 <= min_len <= max_len:
            raise ValueError(f"need n_filler >= 1, n_keywords >= 1 and 1 <= min_len <= max_len; got "
                             f"n_filler={n_filler}, n_keywords={n_keywords}, min_len={min_len}, max_len={max_len}")
        self.n_filler, self.n_keywords, self.min_len, self.max_len = n_filler, n_keywords, min_len, max_len
        self.vocab_size = 1 + n_filler + 2 * n_keywords

    def is_keyword(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens > self.n_filler

    def sample(self, n: int, generator: torch.Generator):
        """(tokens (n, T), mask (n, T), labels (n,), keyword position (n,))."""
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator)
        T = int(lengths.max()) + 1
        tokens = torch.randint(1, self.n_filler + 1, (n, T), generator=generator)
        labels = torch.randint(0, 2, (n,), generator=generator)
        kw = torch.randint(0, self.n_keywords, (n,), generator=generator)
        kw_id = 1 + self.n_filler + kw + (1 - labels) * self.n_keywords
        pos = (torch.rand(n, generator=generator) * (lengths + 1)).long().clamp_max(lengths)
        tokens[torch.arange(n), pos] = kw_id
        mask = torch.arange(T).unsqueeze(0) < (lengths + 1).unsqueeze(1)
        tokens = tokens.masked_fill(~mask, 0)
        return tokens, mask, labels, pos
