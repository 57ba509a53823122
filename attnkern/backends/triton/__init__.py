"""Triton backend: fused softmax / sparsemax / α-entmax attention, forward and backward.

Importing this package never imports triton; `available()` says whether the
kernels can run here, and the launchers import them on first use. On CPU
tensors the kernels run only under the Triton interpreter (TRITON_INTERPRET=1),
which is how the tests exercise them without a GPU.

    attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha) -> (out, shift)
    attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha,
                  out, shift, alpha_grad) -> (dq, dk, dv, dalpha)

Shapes and conventions are those of the C++ ops attnkern::attention_fwd/_bwd;
see `attention.attention_fwd` and `attention.attention_bwd`.
"""

from __future__ import annotations

import os

__all__ = ["available", "attention_fwd", "attention_bwd", "register_as_cuda_impl"]


def _interpreting() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available() -> tuple[bool, str]:
    """(True, "") when the Triton kernels can run here, else (False, why not)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if _interpreting():
        return True, ""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU tensors, slowly)"
    return True, ""


def attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha):
    from attnkern.backends.triton import attention

    return attention.attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha)


def attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha, out, shift, alpha_grad):
    from attnkern.backends.triton import attention

    return attention.attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha, out, shift,
                                   alpha_grad)


attention_fwd.__doc__ = "See attnkern.backends.triton.attention.attention_fwd."
attention_bwd.__doc__ = "See attnkern.backends.triton.attention.attention_bwd."
