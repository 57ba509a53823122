"""Modules for the row-wise normalizers (signatures as the `entmax` package's)."""

from __future__ import annotations

import torch
from torch import nn

from attnkern import ops
from attnkern.family import acc_dtype
from attnkern.validation import learnable_alpha_theta


class Softmax(nn.Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return ops.softmax(X, dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Sparsemax(nn.Module):
    def __init__(self, dim: int = -1, k: int | None = None, return_support_size: bool = False):
        super().__init__()
        self.dim, self.k, self.return_support_size = dim, k, return_support_size

    def forward(self, X: torch.Tensor):
        return ops.sparsemax(X, dim=self.dim, k=self.k, return_support_size=self.return_support_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, k={self.k}, return_support_size={self.return_support_size}"


class Entmax15(nn.Module):
    def __init__(self, dim: int = -1, k: int | None = None, return_support_size: bool = False):
        super().__init__()
        self.dim, self.k, self.return_support_size = dim, k, return_support_size

    def forward(self, X: torch.Tensor):
        return ops.entmax15(X, dim=self.dim, k=self.k, return_support_size=self.return_support_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, k={self.k}, return_support_size={self.return_support_size}"


class EntmaxBisect(nn.Module):
    """α-entmax with a fixed α (a float or a tensor, as `attnkern.entmax_bisect`)."""

    def __init__(self, alpha=1.5, dim: int = -1, n_iter: int = 50):
        super().__init__()
        self.alpha, self.dim, self.n_iter = alpha, dim, n_iter

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return ops.entmax_bisect(X, alpha=self.alpha, dim=self.dim, n_iter=self.n_iter)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, dim={self.dim}, n_iter={self.n_iter}"


class EntmaxAlpha(nn.Module):
    """α-entmax with a learnable α per head, kept above 1 (adaptively sparse
    transformers, Correia et al., 2019): α = 1 + sigmoid(θ) ∈ (1, 2).

    Input: (batch, heads, ..., n) scores normalized along `dim` (default last);
    the head axis is dim 1 (or `head_dim`). device, dtype: as for torch's
    modules, except that θ is float32 for float16 and bfloat16 (see
    attnkern.validation.learnable_alpha_theta).
    """

    def __init__(self, heads: int, alpha_init: float = 1.5, dim: int = -1, head_dim: int = 1, device=None,
                 dtype=None):
        super().__init__()
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"heads must be a positive int, got {heads!r}")
        theta = learnable_alpha_theta(alpha_init, device=device, dtype=dtype)
        self.theta = nn.Parameter(theta.repeat(heads))
        self.heads, self.dim, self.head_dim = heads, dim, head_dim
        self.alpha_init = float(alpha_init)

    def reset_parameters(self) -> None:
        """θ back to alpha_init for every head (e.g. after to_empty() on a
        module built on the meta device)."""
        with torch.no_grad():
            self.theta.copy_(learnable_alpha_theta(self.alpha_init).expand_as(self.theta))

    @property
    def alpha(self) -> torch.Tensor:
        return 1.0 + torch.sigmoid(self.theta)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not isinstance(X, torch.Tensor):
            raise TypeError(f"X must be a torch.Tensor, got {type(X).__name__}")
        if not -X.dim() <= self.head_dim < X.dim():
            raise ValueError(f"head_dim={self.head_dim} is out of range for X with {X.dim()} dims")
        if X.dim() < 2 or X.shape[self.head_dim] != self.heads:
            raise ValueError(f"X must have {self.heads} heads along dim {self.head_dim}, "
                             f"got shape {tuple(X.shape)}")
        shape = [1] * X.dim()
        shape[self.head_dim] = self.heads
        alpha = self.alpha.to(acc_dtype(X.dtype)).view(shape)
        return ops.entmax(X, alpha, dim=self.dim)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim={self.dim}, head_dim={self.head_dim}, alpha_init={self.alpha_init}"


class _Structured(nn.Module):
    """A structured normalizer along `dim` with λ: a float, or a tensor with one
    λ per row (broadcastable); pass an nn.Parameter to learn it (it must stay
    >= 0)."""

    def __init__(self, dim: int = -1, lam=1.0):
        super().__init__()
        self.dim, self.lam = dim, lam

    def extra_repr(self) -> str:
        lam = self.lam if not isinstance(self.lam, torch.Tensor) else f"tensor of shape {tuple(self.lam.shape)}"
        return f"dim={self.dim}, lam={lam}"


class Fusedmax(_Structured):
    """fusedmax along `dim` (attnkern.fusedmax)."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return ops.fusedmax(X, dim=self.dim, lam=self.lam)


class Oscarmax(_Structured):
    """oscarmax along `dim` (attnkern.oscarmax)."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return ops.oscarmax(X, dim=self.dim, lam=self.lam)


class _Chain(nn.Module):
    """A binary linear-chain op along `dim` with its 2×2 transition scores a
    learnable parameter, `pairwise` (rows: z_i, columns: z_{i+1}; zeros at the
    start, so the labels begin independent). The output is a vector of
    marginals in [0, 1], not a distribution."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim
        self.pairwise = nn.Parameter(torch.zeros(2, 2))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class CrfMarginals(_Chain):
    """The marginals P(z_i = 1) of a binary linear-chain CRF along `dim`
    (attnkern.crf_marginals) with learnable transition scores."""

    def forward(self, unary: torch.Tensor) -> torch.Tensor:
        return ops.crf_marginals(unary, self.pairwise, dim=self.dim)


class SparsemapChain(_Chain):
    """SparseMAP's marginals over the binary chain along `dim`
    (attnkern.sparsemap_chain) with learnable transition scores."""

    def forward(self, unary: torch.Tensor) -> torch.Tensor:
        return ops.sparsemap_chain(unary, self.pairwise, dim=self.dim)
