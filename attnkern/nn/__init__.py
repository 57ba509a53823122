"""torch.nn modules around the attnkern normalizers."""

from attnkern.nn.normalizers import EntmaxAlpha, Entmax15, EntmaxBisect, Softmax, Sparsemax

__all__ = ["Softmax", "Sparsemax", "Entmax15", "EntmaxBisect", "EntmaxAlpha"]
