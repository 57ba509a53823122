"""Loaders (tweets, BBC News) and the cached classifiers of the interpretability experiments, on fixtures."""

import numpy as np
import pytest
from _interpret_data import BBC_CLASSES, make_cache

from attnkern.experiments.data.bbc import load_bbc
from attnkern.experiments.data.sources import DataUnavailable
from attnkern.experiments.data.tweets import load_tweets, tweet_sentiment
from attnkern.experiments.interpret import classifiers


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "data")
    monkeypatch.setenv("ATTNKERN_DATA", str(root))
    return root


def test_tweets_threshold_and_crlf(tmp_path):
    path = tmp_path / "tweets.txt"
    path.write_bytes(b"1\t2.5\tSo lucky today!\r\n2\t-0.51\tworst day\r\n3\t0.5\texactly on the edge\r\n"
                     b"4\t-3.1\tugh\r\n5\tnot-a-number\tskipped\r\n")
    items = load_tweets(path)
    assert [it.id for it in items] == ["1", "2", "3", "4"]
    assert items[0].text == "So lucky today!"  # no trailing carriage return
    texts, labels = tweet_sentiment(path)
    # 0.5 is neither > 0.5 nor < -0.5: dropped
    assert texts == ["So lucky today!", "worst day", "ugh"]
    assert labels == [1, 0, 0]


def test_tweets_from_cache(cache):
    texts, labels = tweet_sentiment()
    assert len(texts) == 80  # 100 lines, one in five neutral
    assert set(labels) == {0, 1}


def test_tweets_missing_file(tmp_path):
    with pytest.raises(ValueError, match="path"):
        load_tweets(tmp_path / "nope.txt")


def test_bbc_classes_sorted_and_latin1(cache):
    texts, labels, names = load_bbc()
    assert names == sorted(BBC_CLASSES)
    assert len(texts) == 5 * 14 + 1
    business = names.index("business")
    latin = [t for t, y in zip(texts, labels, strict=True) if "\xa35m" in t]
    assert latin == ["Profit up Shares rose by \xa35m at the bank."]
    assert labels.count(business) == 15
    # whitespace (the headline's blank line) collapsed
    assert all("\n" not in t for t in texts)


def test_bbc_bad_root(tmp_path):
    with pytest.raises(ValueError, match="root"):
        load_bbc(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class folders"):
        load_bbc(tmp_path / "empty")


def test_missing_cache_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKERN_DATA", str(tmp_path / "none"))
    with pytest.raises(DataUnavailable, match="attnkern-exp data fetch bbc"):
        load_bbc()


def test_text_data_splits_and_vocab(cache):
    data = classifiers.load_text_data("bbc", seed=0, max_len=10)
    sizes = [len(data.train[0]), len(data.dev[0]), len(data.test[0])]
    assert sum(sizes) == 71 and sizes[0] == 57
    assert data.num_classes == 5
    assert max(len(s) for s in data.train[0] + data.test[0]) <= 10
    other = classifiers.load_text_data("bbc", seed=1, max_len=10)
    assert other.test[0] != data.test[0]
    # the vocabulary comes from the training split (minimum count 2): a word only in test is unknown
    assert "<unk>" in data.vocab.itos and len(data.vocab) > 4


def test_classifier_trained_once_then_loaded(cache, tmp_path):
    cfg = classifiers.train_config("tweets", "average", "sparsemax", 0, quick=True, epochs=3)
    first = classifiers.get_classifier(cfg, tmp_path / "out")
    path = first.path
    assert path.parent == tmp_path / "out" / "models"
    assert path.exists()
    assert first.info["best_epoch"] in (1, 2, 3)
    assert first.info["dev_accuracy"] > 0.7  # the cue words are learnable
    mtime = path.stat().st_mtime_ns
    again = classifiers.get_classifier(cfg, tmp_path / "out")
    assert path.stat().st_mtime_ns == mtime
    assert again.info == first.info
    seqs = first.data.test[0]
    assert np.array_equal(classifiers.predict(first.model, seqs), classifiers.predict(again.model, seqs))


def test_random_mode_freezes_attention(cache, tmp_path):
    cfg = classifiers.train_config("tweets", "average", "softmax", 0, quick=True, mode="random", epochs=1)
    trained = classifiers.get_classifier(cfg, tmp_path / "out")
    import torch

    torch.manual_seed(cfg.seed)
    fresh = classifiers.build_model(cfg, len(trained.data.vocab), trained.data.num_classes)
    assert torch.equal(fresh.query, trained.model.query)
    for a, b in zip(fresh.attention.parameters(), trained.model.attention.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_choices_name_the_argument(cache, tmp_path):
    with pytest.raises(ValueError, match="dataset"):
        classifiers.get_classifier(classifiers.train_config("imdb", "average", "softmax", 0, True), tmp_path)
    with pytest.raises(ValueError, match="encoder"):
        classifiers.get_classifier(classifiers.train_config("rt", "gru", "softmax", 0, True), tmp_path)
    with pytest.raises(ValueError, match="twice"):
        classifiers.check_choices(["rt", "rt"], classifiers.DATASETS, "--dataset")
