"""Triton backend: fused softmax / sparsemax / α-entmax attention, forward and backward.

Importing this package never imports triton; `available()` says whether the
kernels can run here, and the launchers import them on first use. On CPU
tensors the kernels run only under the Triton interpreter (TRITON_INTERPRET=1),
which is how the tests exercise them without a GPU.

    attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p,
                  dropout_seed, window_left, window_right, key_lengths, row_bounds) -> (out, shift)
    attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha,
                  out, shift, alpha_grad, dropout_p, dropout_seed, window_left,
                  window_right, key_lengths, row_bounds) -> (dq, dk, dv, dalpha)

Shapes and conventions are those of the C++ ops attnkern::attention_fwd/_bwd;
see `attention.attention_fwd` and `attention.attention_bwd`.
"""

from __future__ import annotations

import importlib.util
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
        from attnkern.backends.triton.attention import interpreter_ready

        return interpreter_ready()
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU tensors, slowly)"
    return True, ""


def attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p=0.0, dropout_seed=None,
                  window_left=-1, window_right=-1, key_lengths=None, row_bounds=None):
    from attnkern.backends.triton import attention

    return attention.attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p, dropout_seed,
                                   window_left, window_right, key_lengths, row_bounds)


def attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha, out, shift, alpha_grad,
                  dropout_p=0.0, dropout_seed=None, window_left=-1, window_right=-1, key_lengths=None,
                  row_bounds=None):
    from attnkern.backends.triton import attention

    return attention.attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha, out, shift,
                                   alpha_grad, dropout_p, dropout_seed, window_left, window_right, key_lengths,
                                   row_bounds)


attention_fwd.__doc__ = "See attnkern.backends.triton.attention.attention_fwd."
attention_bwd.__doc__ = "See attnkern.backends.triton.attention.attention_bwd."


# The Library object that holds our registrations; they last as long as it does.
_impl_libs: dict = {}


def _op_exists(qualname: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return False
    return True


def register_as_cuda_impl(namespace: str = "attnkern", dispatch_key: str = "CUDA") -> bool:
    """Installs the Triton launchers as the CUDA kernels of <namespace>::attention_fwd
    and ::attention_bwd.

    A no-op (returning False) when triton is not importable, when either op is
    not defined (the compiled extension is absent), or when either already has a
    kernel for this dispatch key (the CUDA extension provides them). Returns True
    when the launchers are (now, or already) registered. `namespace` and
    `dispatch_key` exist for the tests, which register on a scratch namespace
    and the CPU key to run the ops under the interpreter.
    """
    key = (namespace, dispatch_key)
    if key in _impl_libs:
        return True
    # Whether triton is installed, without importing it: `import attnkern` must
    # not import triton (it reads TRITON_INTERPRET once, when first imported).
    # The launchers import it on first use.
    try:
        if importlib.util.find_spec("triton") is None:
            return False
    except (ImportError, ValueError):
        return False
    import torch

    if namespace == "attnkern":
        from attnkern import _extension  # noqa: F401  (loads attnkern._C, which defines the ops)
    names = ("attention_fwd", "attention_bwd")
    for name in names:
        qual = f"{namespace}::{name}"
        if not _op_exists(qual) or torch._C._dispatch_has_kernel_for_dispatch_key(qual, dispatch_key):
            return False
    lib = torch.library.Library(namespace, "IMPL")
    lib.impl("attention_fwd", attention_fwd, dispatch_key)
    lib.impl("attention_bwd", attention_bwd, dispatch_key)
    _impl_libs[key] = lib
    return True
