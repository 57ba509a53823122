"""Root-finding modules with the `entmax` package's signatures."""

from __future__ import annotations

import torch
from torch import nn

from attnkern import compat


class SparsemaxBisect(nn.Module):
    def __init__(self, dim: int = -1, n_iter: int | None = None):
        super().__init__()
        self.dim, self.n_iter = dim, n_iter

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return compat.sparsemax_bisect(X, dim=self.dim, n_iter=50 if self.n_iter is None else self.n_iter)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class NormmaxBisect(nn.Module):
    """α-normmax with a fixed α (a float > 1 or a tensor, as `attnkern.normmax_bisect`)."""

    def __init__(self, alpha=2, dim: int = -1, n_iter: int = 50):
        super().__init__()
        self.alpha, self.dim, self.n_iter = alpha, dim, n_iter

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return compat.normmax_bisect(X, alpha=self.alpha, dim=self.dim, n_iter=self.n_iter)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, dim={self.dim}"


class BudgetBisect(nn.Module):
    """budget-sparsemax with a fixed budget (a float or a tensor, as `attnkern.budget_bisect`)."""

    def __init__(self, budget=2, dim: int = -1, n_iter: int = 50):
        super().__init__()
        self.budget, self.dim, self.n_iter = budget, dim, n_iter

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return compat.budget_bisect(X, budget=self.budget, dim=self.dim, n_iter=self.n_iter)

    def extra_repr(self) -> str:
        return f"budget={self.budget}, dim={self.dim}"
