"""Tolerances, input makers and assertions shared by the tests and benchmarks."""

from __future__ import annotations

import torch

# Absolute/relative tolerances of a kernel's output against the float64
# reference, per dtype of the computation's input. Probabilities are in
# [0, 1], so an absolute floor dominates.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.float32: dict(atol=2e-5, rtol=2e-4),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    t = TOLERANCES[dtype]
    return dict(atol=t["atol"] * scale, rtol=t["rtol"] * scale)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 scale: float = 1.0, msg: str = "") -> None:
    """Compares in float64 with the tolerance of `dtype` (default: actual's dtype)."""
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), equal_nan=True,
                               msg=(lambda m: f"{msg}: {m}") if msg else None, **tol(dtype, scale))


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
