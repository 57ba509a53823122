"""torch.nn modules around the attnkern normalizers."""

from attnkern.nn.attention import MultiheadAttention
from attnkern.nn.bisect import BudgetBisect, NormmaxBisect, SparsemaxBisect
from attnkern.nn.losses import Entmax15Loss, EntmaxBisectLoss, NormmaxBisectLoss, SparsemaxBisectLoss, SparsemaxLoss
from attnkern.nn.normalizers import (
    CrfMarginals,
    Entmax15,
    EntmaxAlpha,
    EntmaxBisect,
    Fusedmax,
    Oscarmax,
    Softmax,
    SparsemapChain,
    Sparsemax,
)
from attnkern.nn.rnn_attention import AdditiveAttention, LuongAttention, RNNAttention, ScaledDotAttention

__all__ = ["Softmax", "Sparsemax", "Entmax15", "EntmaxBisect", "EntmaxAlpha", "Fusedmax", "Oscarmax",
           "CrfMarginals", "SparsemapChain",
           "MultiheadAttention",
           # attention for recurrent models
           "LuongAttention", "AdditiveAttention", "ScaledDotAttention", "RNNAttention",
           # entmax-package compatibility
           "SparsemaxBisect", "NormmaxBisect", "BudgetBisect",
           "SparsemaxLoss", "SparsemaxBisectLoss", "Entmax15Loss", "EntmaxBisectLoss", "NormmaxBisectLoss"]
