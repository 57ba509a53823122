"""Loss modules with the `entmax` package's signatures (ignore_index, reduction)."""

from __future__ import annotations

import abc

import torch
from torch import nn

from attnkern import losses


class _FenchelYoungLoss(nn.Module, metaclass=abc.ABCMeta):
    """Per-sample loss of X (n_samples, n_classes) against target (n_samples,),
    reduced by `reduction` ("elementwise_mean" (or "mean"), "sum", "none");
    samples whose target equals ignore_index get loss 0 and no gradient and are
    not counted in the mean."""

    def __init__(self, ignore_index: int = -100, reduction: str = "elementwise_mean"):
        super().__init__()
        # ignore_index may be any int-like (e.g. a 0-d tensor `y[0]`); kept as an int.
        self.ignore_index = losses.check_reduction(reduction, ignore_index)
        self.reduction = reduction

    @abc.abstractmethod
    def loss(self, X: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-sample losses (n_samples,) of X against target, unreduced."""

    def forward(self, X: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return losses.reduce_loss(self.loss, X, target, self.ignore_index, self.reduction)

    def extra_repr(self) -> str:
        # The subclass's own settings (k, n_iter, alpha) first, as set in its __init__.
        own = [f"{name}={getattr(self, name)}" for name in ("alpha", "k", "n_iter") if hasattr(self, name)]
        return ", ".join(own + [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"])


class SparsemaxLoss(_FenchelYoungLoss):
    def __init__(self, k: int | None = None, ignore_index: int = -100, reduction: str = "elementwise_mean"):
        self.k = k
        super().__init__(ignore_index, reduction)

    def loss(self, X, target):
        return losses.sparsemax_loss(X, target, self.k)


class SparsemaxBisectLoss(_FenchelYoungLoss):
    def __init__(self, n_iter: int = 50, ignore_index: int = -100, reduction: str = "elementwise_mean"):
        self.n_iter = n_iter
        super().__init__(ignore_index, reduction)

    def loss(self, X, target):
        return losses.sparsemax_bisect_loss(X, target, self.n_iter)


class Entmax15Loss(_FenchelYoungLoss):
    def __init__(self, k: int | None = 100, ignore_index: int = -100, reduction: str = "elementwise_mean"):
        self.k = k
        super().__init__(ignore_index, reduction)

    def loss(self, X, target):
        return losses.entmax15_loss(X, target, self.k)


class EntmaxBisectLoss(_FenchelYoungLoss):
    def __init__(self, alpha=1.5, n_iter: int = 50, ignore_index: int = -100,
                 reduction: str = "elementwise_mean"):
        self.alpha, self.n_iter = alpha, n_iter
        super().__init__(ignore_index, reduction)

    def loss(self, X, target):
        return losses.entmax_bisect_loss(X, target, self.alpha, self.n_iter)


class NormmaxBisectLoss(_FenchelYoungLoss):
    def __init__(self, alpha=2, n_iter: int = 50, ignore_index: int = -100,
                 reduction: str = "elementwise_mean"):
        self.alpha, self.n_iter = alpha, n_iter
        super().__init__(ignore_index, reduction)

    def loss(self, X, target):
        return losses.normmax_bisect_loss(X, target, self.alpha, self.n_iter)
