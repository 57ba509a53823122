"""The 4,200 rated tweets of Hutto & Gilbert (ICWSM 2014), from the same vaderSentiment sdist archive as the Rotten
Tomatoes snippets (`attnkern-exp data fetch vader`).

Each tweet carries the mean of about 20 human ratings in −4…4; as for the snippets, a tweet is positive when the
mean exceeds 0.5, negative when it is below −0.5, and dropped otherwise.
"""

from __future__ import annotations

from pathlib import Path

from attnkern.experiments.data.rotten import RatedText, binary_sentiment, read_rated
from attnkern.experiments.data.sources import cache_path

FILE = "hutto_ICWSM_2014/tweets_GroundTruth.txt"
MARGIN = 0.5


def load_tweets(path: str | Path | None = None) -> list[RatedText]:
    """Every rated tweet (4,200 in the archive); ``path`` overrides the cached ground-truth file."""
    path = cache_path("vader") / FILE if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"path {str(path)!r} is not a file")
    return read_rated(path)


def tweet_sentiment(path: str | Path | None = None) -> tuple[list[str], list[int]]:
    """(texts, labels) with label 1 for a mean rating > 0.5 and 0 for < −0.5; the rest dropped."""
    return binary_sentiment(load_tweets(path), margin=MARGIN)
