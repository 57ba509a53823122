"""Tokenization, vocabularies, padded batches and fixed splits."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import torch

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
_TOKEN = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?|\d+|[^\w\s]", re.UNICODE)


def tokenize(text: str, lower: bool = True) -> list[str]:
    """Words (with an inner apostrophe), numbers and single punctuation marks."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return _TOKEN.findall(text.lower() if lower else text)


class Vocab:
    """Token <-> id map. Ids 0..3 are <pad>, <unk>, <bos>, <eos>; then the tokens
    seen at least `min_count` times, by decreasing count (ties alphabetical),
    at most `max_size` of them."""

    specials = (PAD, UNK, BOS, EOS)

    def __init__(self, sentences: Iterable[Sequence[str]], min_count: int = 1, max_size: int | None = None):
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be a positive int, got {min_count!r}")
        if max_size is not None and (not isinstance(max_size, int) or max_size < 1):
            raise ValueError(f"max_size must be None or a positive int, got {max_size!r}")
        counts = Counter(tok for s in sentences for tok in s)
        kept = sorted((t for t, c in counts.items() if c >= min_count and t not in self.specials),
                      key=lambda t: (-counts[t], t))
        if max_size is not None:
            kept = kept[:max_size]
        self.itos = list(self.specials) + kept
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.counts = counts

    pad_idx, unk_idx, bos_idx, eos_idx = 0, 1, 2, 3

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: str) -> bool:
        return token in self.stoi

    def encode(self, tokens: Sequence[str]) -> list[int]:
        return [self.stoi.get(t, self.unk_idx) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.itos[i] for i in ids]


def encode(vocab: Vocab, sentences: Iterable[Sequence[str]]) -> list[list[int]]:
    return [vocab.encode(s) for s in sentences]


def pad_batch(seqs: Sequence[Sequence[int]], pad_idx: int = 0, max_len: int | None = None):
    """(tokens (B, T) int64, mask (B, T) bool, True at real tokens), padded at the
    end to the longest sequence (or truncated to max_len)."""
    if len(seqs) == 0:
        raise ValueError("seqs must not be empty")
    lengths = [len(s) if max_len is None else min(len(s), max_len) for s in seqs]
    T = max(max(lengths), 1)
    arr = np.full((len(seqs), T), pad_idx, dtype=np.int64)
    for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        if n:
            arr[i, :n] = list(s)[:n]
    tokens = torch.from_numpy(arr)
    mask = torch.arange(T).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)
    return tokens, mask


def split_indices(n: int, seed: int = 0, fractions=(0.8, 0.1, 0.1)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fixed (train, dev, test) split of range(n): a permutation drawn from `seed`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 3:
        raise ValueError(f"n must be an int >= 3, got {n!r}")
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions!r}")
    perm = np.random.default_rng(seed).permutation(n)
    n_train = int(round(fractions[0] * n))
    n_dev = int(round(fractions[1] * n))
    return perm[:n_train], perm[n_train:n_train + n_dev], perm[n_train + n_dev:]


def batches(n: int, batch_size: int, rng: np.random.Generator, shuffle: bool = True):
    """Index arrays of consecutive batches over range(n) (shuffled by rng)."""
    order = rng.permutation(n) if shuffle else np.arange(n)
    for i in range(0, n, batch_size):
        yield order[i:i + batch_size]
