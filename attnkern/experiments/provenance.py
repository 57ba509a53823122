"""What an experiment's result depends on, as fingerprints a cache key can hold.

- The code: the content of every attnkern source file a run's module imports,
  directly or through others (its import closure, found by reading the
  sources, with the packages' __init__ files), plus the identity of the
  compiled extension. Content, not git: Dask workers and installed packages
  have no repository, and a changed file that git does not track counts too.
- The data: the datasets a run reads (every `data.sources.cache_path` call
  notes its dataset while `reading()` is active), each fingerprinted by the
  names, sizes and SHA-256 of the files in its cache folder.
- The machine and the kernels that ran: machine() for the result files.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

_PACKAGE = "attnkern"


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _imported_names(path: Path, module: str) -> set[str]:
    """The attnkern modules a source file imports (at any depth of its code)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # (a module, when it is one)
    return {n for n in names if n == _PACKAGE or n.startswith(_PACKAGE + ".")}


def import_closure(module: str) -> dict[str, Path]:
    """module name -> source file of every attnkern module `module` imports,
    directly or not, itself and the packages above each included."""
    found: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(name)
        if path is None:
            continue
        found[name] = path
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo.extend(parents)
        todo.extend(_imported_names(path, name))
    return found


def _file_digest(path: Path) -> str:
    stat = path.stat()
    return _digest_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _digest_cached(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extension_identity() -> str:
    """The SHA-256 of the compiled extension attnkern loaded, or why none is loaded."""
    from attnkern import _extension

    if not _extension.LOADED:
        return "no compiled extension"
    from attnkern import _C

    return _file_digest(Path(_C.__file__))


def code_fingerprint(module: str) -> str:
    """A digest of the import closure's sources of `module` and of the compiled extension."""
    h = hashlib.sha256()
    for name, path in sorted(import_closure(module).items()):
        h.update(f"{name}\0{_file_digest(path)}\n".encode())
    h.update(extension_identity().encode())
    return h.hexdigest()[:20]


# The datasets read since each active reading() began (a stack: readings nest).
_reading: list[set[str]] = []


def note_read(dataset: str) -> None:
    """Records that the running code read `dataset` (data.sources.cache_path calls it)."""
    for names in _reading:
        names.add(dataset)


@contextlib.contextmanager
def reading() -> Iterator[set[str]]:
    """Collects the names of the datasets read inside the block."""
    names: set[str] = set()
    _reading.append(names)
    try:
        yield names
    finally:
        # by identity: an enclosing reading may hold an equal set
        del _reading[next(i for i, other in enumerate(_reading) if other is names)]


def dataset_digest(dataset: str) -> str | None:
    """A digest of the files in a dataset's cache folder (relative names, sizes,
    SHA-256), or None when the dataset is not in the cache."""
    from attnkern.experiments.data.sources import cache_root

    folder = cache_root() / dataset
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f"{path.relative_to(folder).as_posix()}\0{path.stat().st_size}\0{_file_digest(path)}\n".encode())
    return h.hexdigest()[:20]


def data_fingerprint(datasets) -> dict[str, str | None]:
    """dataset -> dataset_digest for each name."""
    return {name: dataset_digest(name) for name in sorted(datasets)}


def digest(obj) -> str:
    """A short SHA-256 of a JSON-serializable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


@functools.lru_cache(maxsize=1)
def git_commit() -> dict:
    """{"commit", "dirty"} of the attnkern checkout this code runs from (dirty
    counts untracked files too), or {"commit": None} outside a repository."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": head or None, "dirty": bool(status)} if head else {"commit": None}


def processor(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def backend_used(backend: str, device: str) -> str:
    """The backend attnkern's normalizers run on for `backend` ("auto",
    "reference", ...) on `device`: never "auto"."""
    from attnkern.backends import registry

    return registry.choose(backend, torch.empty(1, 2, device=device))


def machine(device: str = "cpu") -> dict:
    """The machine and the kernels' instruction-set level for a result file."""
    from attnkern import _extension, isa

    level = isa.dispatch().get("active") if _extension.LOADED else None
    return {"processor": processor(device), "device": device, "host_cpus": os.cpu_count(),
            "isa_level": level, "torch": torch.__version__, "python": platform.python_version()}
