"""The normalizer family and the numeric conventions every backend shares.

The one Python definition of: the normalizer names and their family codes
(the C++ kernels' `math::Family` in csrc/include/attnkern/family.h, checked by
tests/test_family.py, and the Triton kernels' FAMILY use the same numbers),
and the accumulation dtype of a computation. Only α = 1 exactly is computed
as softmax: every other α gets its own map, however close to 1.
It imports nothing from attnkern, so every layer (the public API, autograd,
the reference and Triton backends) can use it.
"""

from __future__ import annotations

import enum

import torch


class Family(enum.IntEnum):
    """A normalizer of the α-entmax family, numbered as the kernels number them.
    With b = α - 1: softmax b = 0, sparsemax b = 1, entmax15 b = 1/2, and
    entmax with b read at run time (C++ `Family::kGeneric`)."""

    SOFTMAX = 0
    SPARSEMAX = 1
    ENTMAX15 = 2
    ENTMAX = 3

    @property
    def normalizer(self) -> str:
        """The public name ("softmax", "sparsemax", "entmax15", "entmax")."""
        return self.name.lower()

    @property
    def takes_alpha(self) -> bool:
        """Whether α is an argument (only α-entmax)."""
        return self is Family.ENTMAX

    @classmethod
    def of(cls, normalizer: str, what: str = "normalizer") -> Family:
        """The family of a normalizer name; ValueError naming `what` otherwise."""
        fam = _BY_NAME.get(normalizer) if isinstance(normalizer, str) else None
        if fam is None:
            raise ValueError(f"{what} must be one of {NORMALIZERS}, got {normalizer!r}")
        return fam


_BY_NAME = {f.normalizer: f for f in Family}

# The normalizer names, in family order.
NORMALIZERS: tuple[str, ...] = tuple(_BY_NAME)


# The structured normalizers (Niculae & Blondel): sparsemax after a prox, with
# a λ >= 0 where the family has α. Attention and the RNN attention modules take
# them besides the family (the CPU kernels' attention runs them as sparsemax
# heads with a prox: csrc/cpu/structured_row.h).
STRUCTURED_NORMALIZERS: tuple[str, ...] = ("fusedmax", "oscarmax")

# The chain normalizers of the RNN attention modules, by the row-wise op each
# runs: the marginals P(z_i = 1) of a binary linear chain over the positions
# with learnable 2×2 pairwise scores (Kim et al.'s structured attention, and
# SparseMAP's sparse counterpart). Marginals, not distributions: they need not
# sum to 1.
CHAIN_NORMALIZERS: dict[str, str] = {"crf": "crf_marginals", "sparsemap": "sparsemap_chain"}

# Every normalizer attnkern.attention takes.
ATTENTION_NORMALIZERS: tuple[str, ...] = NORMALIZERS + STRUCTURED_NORMALIZERS


def takes_lam(normalizer: str) -> bool:
    """Whether the normalizer of this name takes λ (the structured ones)."""
    return normalizer in STRUCTURED_NORMALIZERS


def check_attention_normalizer(normalizer) -> None:
    """ValueError unless `normalizer` is one attention takes."""
    if not (isinstance(normalizer, str) and normalizer in ATTENTION_NORMALIZERS):
        raise ValueError(f"normalizer must be one of {ATTENTION_NORMALIZERS}, got {normalizer!r}")


def takes_alpha(normalizer: str) -> bool:
    """Whether the normalizer of this name takes α (False for unknown names)."""
    return normalizer == Family.ENTMAX.normalizer


# |α - 1| below which the gradient in α is taken in its form without the
# closed form's 1/(α - 1)² cancellation: kAlphaGradSeriesBand of
# csrc/include/attnkern/entmax_math.h.
ALPHA_GRAD_SERIES_BAND = 0.25


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a computation on `dtype` accumulates in (and in which α, the
    row shifts and the reduced α-gradients are kept): float64 for float64,
    float32 for every other floating dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32
