"""The normalizer family table is written once in Python (attnkern/family.py) and once in C++
(csrc/include/attnkern/family.h); these tests hold the two, and the Triton kernels, to the same codes."""

import pytest

from attnkern import _extension
from attnkern.family import NORMALIZERS, Family

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason=f"attnkern._C not built: {_extension.LOAD_ERROR}")


def test_cpp_family_codes_match_python():
    from attnkern import _C

    assert _C.FAMILIES == NORMALIZERS
    assert _C.FAMILIES == tuple(Family(code).normalizer for code in range(len(_C.FAMILIES)))


def test_only_alpha_one_is_softmax():
    """No band around α = 1: the kernels compute the map of every α ≠ 1, so the
    output moves off softmax continuously (tests/test_edges_oracle.py checks
    the values against an extended-precision oracle)."""
    import torch

    import attnkern
    from attnkern import _C

    assert not hasattr(_C, "SOFTMAX_BAND")
    x = 3 * torch.randn(4, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    soft = torch.softmax(x, -1)
    assert torch.equal(attnkern.entmax(x, 1.0), attnkern.softmax(x))
    gaps = [(attnkern.entmax(x, 1 + d) - soft).abs().max().item() for d in (1e-9, 1e-8, 1e-7)]
    assert 0 < gaps[0] < gaps[1] < gaps[2]
    assert 5 < gaps[1] / gaps[0] < 20 and 5 < gaps[2] / gaps[1] < 20  # O(|α - 1|)


@pytest.mark.parametrize("name", NORMALIZERS)
def test_cpp_accepts_every_python_name(name):
    # the fused CPU op parses the name with the C++ table: every Python name must be known to it
    import torch

    q = torch.randn(1, 1, 3, 4)
    alpha = torch.full((1,), 1.5) if Family.of(name).takes_alpha else None
    out, shift = torch.ops.attnkern.attention_fwd(q, q, q, None, False, 0.5, name, alpha)
    assert out.shape == (1, 1, 3, 4) and shift.shape == (1, 1, 3)


def test_cpp_rejects_unknown_name_listing_the_table():
    import torch

    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match=", ".join(NORMALIZERS)):
        torch.ops.attnkern.attention_fwd(q, q, q, None, False, 0.5, "softermax", None)
