"""torch.nn modules around the attnkern normalizers."""

from attnkern.nn.attention import MultiheadAttention
from attnkern.nn.normalizers import Entmax15, EntmaxAlpha, EntmaxBisect, Softmax, Sparsemax

__all__ = ["Softmax", "Sparsemax", "Entmax15", "EntmaxBisect", "EntmaxAlpha", "MultiheadAttention"]
