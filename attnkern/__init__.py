"""attnkern: fused softmax, sparsemax and α-entmax kernels for PyTorch.

Row-wise normalizers (drop-in for the `entmax` package):
    softmax, sparsemax, entmax15, entmax, entmax_bisect
Fused attention (SDPA-compatible, softmax / sparsemax / entmax15 / α-entmax):
    attention, attention_varlen (packed documents)
Modules: attnkern.nn

`import attnkern as entmax` also gives every other name the `entmax` package
exports at its top level (ENTMAX_COMPAT), with the same signatures.
"""

from attnkern import _extension, _library, isa  # noqa: F401  (load ops, register fakes)
from attnkern.attention import attention
from attnkern.compat import budget_bisect, normmax_bisect, sparsemax_bisect
from attnkern.losses import (
    entmax15_loss,
    entmax_bisect_loss,
    normmax_bisect_loss,
    sparsemax_bisect_loss,
    sparsemax_loss,
)
from attnkern.nn.bisect import BudgetBisect, NormmaxBisect, SparsemaxBisect
from attnkern.nn.losses import Entmax15Loss, EntmaxBisectLoss, NormmaxBisectLoss, SparsemaxBisectLoss, SparsemaxLoss
from attnkern.nn.normalizers import Entmax15, EntmaxBisect, Sparsemax
from attnkern.ops import (
    crf_marginals,
    entmax,
    entmax15,
    entmax_bisect,
    fusedmax,
    oscarmax,
    softmax,
    sparsemap_chain,
    sparsemax,
)
from attnkern.varlen import attention_varlen

__version__ = "0.1.0"

# The `entmax` package's (1.3) top-level names.
ENTMAX_COMPAT = (
    "sparsemax", "entmax15", "Sparsemax", "Entmax15",
    "sparsemax_bisect", "entmax_bisect", "normmax_bisect", "budget_bisect",
    "SparsemaxBisect", "EntmaxBisect", "NormmaxBisect", "BudgetBisect",
    "sparsemax_loss", "entmax15_loss", "sparsemax_bisect_loss", "entmax_bisect_loss", "normmax_bisect_loss",
    "SparsemaxLoss", "SparsemaxBisectLoss", "Entmax15Loss", "EntmaxBisectLoss", "NormmaxBisectLoss",
)

__all__ = [
    "softmax", "sparsemax", "entmax15", "entmax", "entmax_bisect", "fusedmax", "oscarmax", "crf_marginals",
    "sparsemap_chain", "attention", "attention_varlen", "nn",
    "__version__",
    # entmax-package compatibility
    "sparsemax_bisect", "normmax_bisect", "budget_bisect",
    "sparsemax_loss", "entmax15_loss", "sparsemax_bisect_loss", "entmax_bisect_loss", "normmax_bisect_loss",
    "Sparsemax", "Entmax15", "SparsemaxBisect", "EntmaxBisect", "NormmaxBisect", "BudgetBisect",
    "SparsemaxLoss", "SparsemaxBisectLoss", "Entmax15Loss", "EntmaxBisectLoss", "NormmaxBisectLoss",
    "ENTMAX_COMPAT",
]


def __getattr__(name):
    if name == "nn":
        import importlib

        return importlib.import_module("attnkern.nn")
    raise AttributeError(f"module 'attnkern' has no attribute {name!r}")
