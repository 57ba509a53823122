"""Tolerances, input makers and assertions shared by the tests and benchmarks."""

from __future__ import annotations

import torch

# The one tolerance rule of a kernel's result against the float64 reference
# (attnkern.backends.reference), for inputs of unit scale: (atol, rtol) by the
# op's kind, the quantity compared and the dtype the kernel computes in.
# "rowwise": the normalizers and losses (probabilities in [0, 1], so the
# absolute floor dominates); "attention": attnkern.attention, whose outputs are
# weighted sums of V and whose gradients sum over a row or a column of scores,
# hence the looser gradient entries. Half types are compared in their own
# rounding (their forward and gradient bounds are the same).
TOLERANCES: dict[tuple[str, str], dict[torch.dtype, tuple[float, float]]] = {
    ("rowwise", "forward"): {torch.float64: (1e-10, 1e-8), torch.float32: (2e-5, 2e-4),
                             torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)},
    ("rowwise", "gradient"): {torch.float64: (1e-10, 1e-8), torch.float32: (2e-5, 2e-4),
                              torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)},
    ("attention", "forward"): {torch.float64: (1e-9, 1e-7), torch.float32: (4e-5, 2e-4),
                               torch.bfloat16: (2e-2, 1e-2), torch.float16: (4e-3, 2e-3)},
    ("attention", "gradient"): {torch.float64: (1e-8, 1e-6), torch.float32: (1e-4, 1e-3),
                                torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)},
}
OPS = ("rowwise", "attention")
QUANTITIES = ("forward", "gradient")

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def tolerance(dtype: torch.dtype, op: str = "rowwise", quantity: str = "forward", scale: float = 1.0) -> dict:
    """dict(atol=..., rtol=...) for torch.testing.assert_close: the rule
    (TOLERANCES) for a kernel's result in `dtype` against the float64
    reference, both bounds times `scale` (inputs far from unit scale, or a
    test that documents why it needs more)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")
    table = TOLERANCES[(op, quantity)]
    if dtype not in table:
        raise ValueError(f"dtype must be one of {tuple(table)}, got {dtype}")
    atol, rtol = table[dtype]
    return dict(atol=atol * scale, rtol=rtol * scale)


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """The row-wise forward tolerance: tolerance(dtype, "rowwise", "forward", scale)."""
    return tolerance(dtype, "rowwise", "forward", scale)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 scale: float = 1.0, msg: str = "", op: str = "rowwise", quantity: str = "forward") -> None:
    """Compares in float64 with tolerance(dtype, op, quantity, scale) (dtype: default actual's)."""
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), equal_nan=True,
                               msg=(lambda m: f"{msg}: {m}") if msg else None,
                               **tolerance(dtype, op, quantity, scale))


def half_rule_bound(kernel_err: float, torch_err: float, dtype: torch.dtype) -> bool:
    """FlashAttention's rule for half types: the kernel's error against a float64
    reference is at most twice that of plain PyTorch in the same precision, plus
    a rounding band of the dtype."""
    band = {torch.bfloat16: 8e-3, torch.float16: 1e-3}.get(dtype, 0.0)
    return kernel_err <= 2 * torch_err + band


def make_scores(shape, dtype=torch.float32, scale: float = 1.0, seed: int = 0, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def with_ties(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Scores with many exact ties (small integers)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g, device=g.device).to(dtype)


def mask_some(x: torch.Tensor, frac: float = 0.3, seed: int = 0, full_rows: int = 1) -> torch.Tensor:
    """x with a fraction of entries set to -inf along the last dim, and the first
    `full_rows` rows entirely -inf."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(x.shape, generator=g, device=g.device) < frac
    y = x.masked_fill(m.to(x.device), float("-inf"))
    if full_rows and y.dim() >= 2:
        y.view(-1, y.shape[-1])[:full_rows] = float("-inf")
    return y


def attention_dropout_mask(B: int, H: int, L: int, S: int, dropout_p: float, seed: torch.Tensor) -> torch.Tensor:
    """The keep mask (B, H, L, S) bool that the fused attention kernels (CPU and
    Triton) apply with dropout_p and seed; attnkern.attention draws its seed with
    attnkern.attention.draw_dropout_seed() (so after torch.manual_seed(s), the
    same call gives the same seed). Pass it to the reference as dropout_mask."""
    return torch.ops.attnkern.attention_dropout_mask(B, H, L, S, float(dropout_p), seed)


def triton_test_device() -> tuple[str | None, str]:
    """(device, "") for the Triton kernel tests: "cuda" when a GPU runs the
    compiled kernels, "cpu" when they run in Triton's interpreter
    (TRITON_INTERPRET=1 set before triton was first imported); (None, why not)
    otherwise."""
    from attnkern.backends import triton as tb

    ok, why = tb.available()
    if not ok:
        return None, why
    return ("cpu" if tb._interpreting() else "cuda"), ""
