"""Word vectors for the interpretability classifiers: from scratch, or word2vec trained here on unlabelled text.

Jain & Wallace and Wiegreffe & Pinter started from pretrained 300-d word vectors, which no registry package ships;
``--embeddings word2vec`` is our stand-in. Skip-gram word2vec (gensim) is trained on every document the data
commands fetch (:mod:`attnkern.experiments.data.unlabelled`: about 64,000 snippets, tweets and articles) minus the
test split the classifier will be evaluated on (matched by tokens, so a copy of a test document in another corpus
is left out too), one set of vectors per (dataset, split seed, dimension). Training is single-threaded with a fixed
seed and a word hash that does not depend on PYTHONHASHSEED, so the vectors are the same on every run.

A classifier's embedding rows start at the vectors of its vocabulary's words; the other rows (the special tokens
and words too rare for word2vec) are drawn from a normal distribution with the vectors' own standard deviation, so
that every row starts at one scale. The embeddings are trained further with the rest of the model, as in the
papers' code. The vectors are cached under ``<out>/embeddings/`` with a fingerprint of this code and of the data.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnkern.experiments import provenance
from attnkern.experiments.data.sources import cache_path
from attnkern.experiments.data.text import tokenize
from attnkern.experiments.data.unlabelled import SOURCES, unlabelled_texts

EMBEDDINGS = ("scratch", "word2vec")

# gensim's skip-gram with its usual settings, 5 passes over the corpus.
WORD2VEC_SETTINGS = {"sg": 1, "window": 5, "min_count": 2, "negative": 5, "sample": 1e-3, "epochs": 5}


def stable_word_hash(text: str) -> int:
    """The hash gensim seeds each word's initial vector with; Python's own ``hash`` of a str changes from process
    to process unless PYTHONHASHSEED is fixed, this one does not."""
    return zlib.crc32(text.encode("utf-8"))


@dataclass
class WordVectors:
    words: list[str]
    vectors: np.ndarray  # (len(words), dim) float32
    fingerprint: str     # of the code, data and settings that made them
    info: dict           # corpus size, documents left out, training time

    def index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}


def training_corpus(excluded_documents) -> tuple[list[list[str]], dict]:
    """Every unlabelled document, tokenized, except those whose tokens equal one of ``excluded_documents`` (token
    lists). Returns (documents, {"documents": n, "tokens": n, "left_out": n, "by_source": {...}})."""
    excluded = {tuple(d) for d in excluded_documents}
    docs, left_out, by_source = [], 0, {}
    for source, texts in unlabelled_texts().items():
        kept = 0
        for text in texts:
            tokens = tokenize(text)
            if not tokens:
                continue
            if tuple(tokens) in excluded:
                left_out += 1
                continue
            docs.append(tokens)
            kept += 1
        by_source[source] = kept
    return docs, {"documents": len(docs), "tokens": sum(map(len, docs)), "left_out": left_out,
                  "by_source": by_source}


def train_word2vec(docs: list[list[str]], dim: int, seed: int) -> tuple[list[str], np.ndarray]:
    """(words, (len(words), dim) float32 vectors) of gensim's word2vec with WORD2VEC_SETTINGS on ``docs``,
    single-threaded: the same result in every process."""
    from gensim.models import Word2Vec

    model = Word2Vec(sentences=docs, vector_size=dim, workers=1, seed=seed, hashfxn=stable_word_hash,
                     **WORD2VEC_SETTINGS)
    return list(model.wv.index_to_key), np.asarray(model.wv.vectors, dtype=np.float32)


def _fingerprint(dataset: str, split_seed: int, dim: int) -> str:
    return provenance.digest({"code": provenance.code_fingerprint(__name__),
                              "data": provenance.data_fingerprint(SOURCES),  # (every dataset's source among them)
                              "settings": WORD2VEC_SETTINGS, "dataset": dataset, "split_seed": split_seed,
                              "dim": dim})


def word2vec_vectors(dataset: str, split_seed: int, dim: int, out: str | Path) -> WordVectors:
    """The word2vec vectors for classifiers of ``dataset`` split by ``split_seed``, loaded from
    ``<out>/embeddings/`` or trained (and saved there). Needs gensim (the experiments extra)."""
    for source in SOURCES:
        cache_path(source)  # DataUnavailable naming the fetch command; notes the read for the run's provenance
    fingerprint = _fingerprint(dataset, split_seed, dim)
    path = Path(out) / "embeddings" / f"word2vec-{dataset}-s{split_seed}-d{dim}-{fingerprint}.npz"
    if path.exists():
        saved = np.load(path, allow_pickle=False)
        return WordVectors(saved["words"].tolist(), saved["vectors"], fingerprint, json.loads(str(saved["info"])))
    from attnkern.experiments.interpret.classifiers import documents_of_test_split

    docs, info = training_corpus(documents_of_test_split(dataset, split_seed))
    start = time.time()
    words, vectors = train_word2vec(docs, dim, split_seed)
    info["train_seconds"] = time.time() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
    np.savez(tmp, words=np.asarray(words), vectors=vectors, info=np.asarray(json.dumps(info)))
    os.replace(tmp, path)
    return WordVectors(words, vectors, fingerprint, info)


def initialise_embedding(embedding: torch.nn.Embedding, itos: list[str], vectors: WordVectors,
                         generator: torch.Generator, padding_idx: int = 0) -> int:
    """Sets ``embedding``'s rows to the vectors of the words ``itos`` names; rows without a vector are drawn from
    N(0, σ²) with σ the vectors' standard deviation, the padding row stays zero. Returns the number of rows that
    got a word2vec vector."""
    if embedding.embedding_dim != vectors.vectors.shape[1]:
        raise ValueError(f"embedding dim {embedding.embedding_dim} != word vector dim {vectors.vectors.shape[1]}")
    table = torch.from_numpy(vectors.vectors)
    sigma = float(table.std())
    index = vectors.index()
    weight = torch.randn(len(itos), embedding.embedding_dim, generator=generator) * sigma
    found = 0
    for row, word in enumerate(itos):
        i = index.get(word)
        if i is not None:
            weight[row] = table[i]
            found += 1
    weight[padding_idx] = 0
    with torch.no_grad():
        embedding.weight.copy_(weight)
    return found
