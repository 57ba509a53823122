"""Rotten Tomatoes movie-review snippets with mean sentiment ratings (Hutto &
Gilbert, ICWSM 2014), from the vaderSentiment sdist (`attnkern-exp data fetch vader`)."""

from __future__ import annotations

from dataclasses import dataclass

from attnkern.experiments.data.sources import cache_path

FILE = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"


@dataclass(frozen=True)
class RatedText:
    id: str
    rating: float  # mean human rating in -4..4
    text: str


def read_rated(path) -> list[RatedText]:
    """Lines `id <tab> rating <tab> text` (the format of the Hutto ground-truth files)."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\r\n").split("\t", 2)
            if len(parts) != 3 or not parts[2].strip():
                continue
            try:
                rating = float(parts[1])
            except ValueError:
                continue
            out.append(RatedText(parts[0], rating, parts[2].strip()))
    return out


def load_rotten_tomatoes() -> list[RatedText]:
    """All snippets (10,604 lines in the archive)."""
    return read_rated(cache_path("vader") / FILE)


def binary_sentiment(items: list[RatedText], margin: float = 0.0) -> tuple[list[str], list[int]]:
    """(texts, labels): 1 for rating > margin, 0 for rating < -margin; the rest dropped."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    texts, labels = [], []
    for it in items:
        if it.rating > margin:
            texts.append(it.text)
            labels.append(1)
        elif it.rating < -margin:
            texts.append(it.text)
            labels.append(0)
    return texts, labels
