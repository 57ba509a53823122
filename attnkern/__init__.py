"""attnkern: fused softmax, sparsemax and α-entmax kernels for PyTorch.

Row-wise normalizers (drop-in for the `entmax` package):
    softmax, sparsemax, entmax15, entmax, entmax_bisect
Fused attention (SDPA-compatible, softmax / sparsemax / entmax15 / α-entmax):
    attention
Modules: attnkern.nn
"""

from attnkern import _extension, _library  # noqa: F401  (load ops, register fakes)
from attnkern.attention import attention
from attnkern.ops import entmax, entmax15, entmax_bisect, softmax, sparsemax

__version__ = "0.1.0"

__all__ = ["softmax", "sparsemax", "entmax15", "entmax", "entmax_bisect", "attention", "nn", "__version__"]


def __getattr__(name):
    if name == "nn":
        import importlib

        return importlib.import_module("attnkern.nn")
    raise AttributeError(f"module 'attnkern' has no attribute {name!r}")
