"""English→German sentence pairs from the gettext catalogs on the machine
(/usr/share/locale/de/LC_MESSAGES/*.mo): the msgid is the English source, the
msgstr its German translation. Noisy (format strings, menu labels) but real
human translation; filtered to short, plain sentences."""

from __future__ import annotations

import gettext
import re
from pathlib import Path

from attnkern.experiments.data.text import tokenize

DEFAULT_DIR = Path("/usr/share/locale/de/LC_MESSAGES")
_FORMAT = re.compile(r"%|\{|\}|\\|<|>|_|\$|@|=|/")


def read_catalog(path) -> dict[str, str]:
    """msgid -> msgstr of one .mo file (singular messages only)."""
    with open(path, "rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog  # the parsed .mo table
    return {k: v for k, v in catalog.items() if isinstance(k, str) and k and isinstance(v, str) and v}


def load_en_de_pairs(directory=DEFAULT_DIR, min_len: int = 3, max_len: int = 12) -> list[tuple[list[str], list[str]]]:
    """Tokenized (english, german) pairs, deduplicated and sorted (deterministic),
    keeping messages without format directives or markup whose both sides
    have min_len..max_len tokens."""
    directory = Path(directory)
    files = sorted(directory.glob("*.mo")) if directory.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no gettext catalogs (*.mo) in {directory}: the English→German pairs need the "
                                "German translations of the system's programs (Debian/Ubuntu: the packages' "
                                "/usr/share/locale/de files; install e.g. `apt-get install coreutils` with "
                                "locales not excluded)")
    pairs = set()
    for f in files:
        try:
            catalog = read_catalog(f)
        except (OSError, UnicodeDecodeError):  # an unreadable catalog or one in a legacy encoding
            continue
        for en, de in catalog.items():
            if "\n" in en or "\n" in de or _FORMAT.search(en) or _FORMAT.search(de):
                continue
            te, td = tokenize(en), tokenize(de)
            if min_len <= len(te) <= max_len and min_len <= len(td) <= max_len:
                pairs.add((tuple(te), tuple(td)))
    return [(list(e), list(d)) for e, d in sorted(pairs)]
