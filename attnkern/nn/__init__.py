"""torch.nn modules around the attnkern normalizers."""

from attnkern.nn.normalizers import Entmax15, EntmaxAlpha, EntmaxBisect, Softmax, Sparsemax

__all__ = ["Softmax", "Sparsemax", "Entmax15", "EntmaxBisect", "EntmaxAlpha"]
