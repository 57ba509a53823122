"""Loads the compiled ops (attnkern._C) once and remembers why it failed, if it did."""

from __future__ import annotations

import warnings

import torch

LOAD_ERROR: str | None = None
try:
    from attnkern import _C  # noqa: F401  (registers torch.ops.attnkern.*)

    LOADED = True
except Exception as exc:  # an ImportError, or an undefined symbol from a stale build
    LOADED = False
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"

_warned = False


def warn_fallback() -> None:
    """One warning per process that the reference backend is standing in."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "attnkern: the compiled extension attnkern._C did not load, so the pure-PyTorch reference "
            "backend is used (slow). Run `python -m attnkern.info` for the reason.",
            RuntimeWarning,
            stacklevel=3,
        )


def has_cuda_kernels() -> bool:
    """True when _C was built with the CUDA sources (whether or not a GPU is present)."""
    if not LOADED:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("attnkern::softmax_fwd", "CUDA")
