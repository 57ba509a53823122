"""Which backend is available here, and if not why: the one place that decides
it, for the row-wise normalizers (attnkern.ops), fused attention
(attnkern.attention) and `python -m attnkern.info`.

Backends: "cpu" and "cuda" (the compiled extension attnkern._C), "triton"
(fused attention only; attnkern.backends.triton) and "reference" (pure
PyTorch, runs anywhere). "auto" picks the first kernel backend that can run a
call, else the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from attnkern import _extension

KERNEL_BACKENDS = ("cpu", "cuda", "triton")
BACKENDS = ("auto",) + KERNEL_BACKENDS + ("reference",)
# The ops a backend may be asked to run: row-wise normalizers, or fused attention.
OPS = ("normalizer", "attention")


def host() -> dict[str, tuple[bool, str]]:
    """{backend: (available, reason when not)} on this host, whatever the input."""
    out: dict[str, tuple[bool, str]] = {}
    if _extension.LOADED:
        out["cpu"] = (True, "")
    else:
        out["cpu"] = (False, f"attnkern._C did not load: {_extension.LOAD_ERROR}")
    if not _extension.LOADED:
        out["cuda"] = (False, "attnkern._C did not load")
    elif not _extension.has_cuda_kernels():
        out["cuda"] = (False, "attnkern._C was built without the CUDA sources "
                              "(CPU-only torch, no nvcc, or ATTNKERN_SKIP_CUDA_BUILD=1)")
    elif not torch.cuda.is_available():
        out["cuda"] = (False, "CUDA kernels are compiled, but no CUDA device is visible")
    else:
        out["cuda"] = (True, "")
    from attnkern.backends import triton as triton_backend

    out["triton"] = triton_backend.available()
    out["reference"] = (True, "")
    return out


def _triton_why_not(x: torch.Tensor) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton: the triton package is not installed"
    if x.device.type != "cuda" and not (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"triton: input is on {x.device} (needs a CUDA device, or CPU tensors with TRITON_INTERPRET=1)"
    try:
        mod = importlib.import_module("attnkern.backends.triton")
    except Exception as exc:  # ImportError, or triton failing to initialize
        return f"triton: attnkern.backends.triton did not import ({type(exc).__name__}: {exc})"
    missing = [f for f in ("attention_fwd", "attention_bwd") if not hasattr(mod, f)]
    if missing:
        return f"triton: attnkern.backends.triton has no {', '.join(missing)}"
    return None


def _extension_why_not(backend: str, x: torch.Tensor, op: str) -> str | None:
    if not _extension.LOADED:
        return f"{backend}: the compiled extension did not load ({_extension.LOAD_ERROR})"
    if backend == "cpu":
        return None if x.device.type == "cpu" else f"cpu: input is on {x.device}"
    if not _extension.has_cuda_kernels():
        return "cuda: attnkern._C was built without CUDA kernels"
    if x.device.type != "cuda":
        return f"cuda: input is on {x.device}"
    if op != "normalizer" and not torch._C._dispatch_has_kernel_for_dispatch_key(f"attnkern::{op}_fwd", "CUDA"):
        return f"cuda: attnkern._C has no CUDA {op} kernel"
    return None


def why_not(backend: str, x: torch.Tensor, op: str = "normalizer", *, mask_grad: bool = False) -> str | None:
    """Why `backend` cannot run `op` ("normalizer", "attention", or an op with
    kernels of its own such as "fusedmax") on x, or None if it can. mask_grad:
    the attention call needs a gradient in its float attn_mask, which only the
    reference gives."""
    if backend == "reference":
        return None
    if backend == "triton":
        if op != "attention":
            return "triton: has no row-wise normalizer kernels (its kernels are the fused attention)"
        why = _triton_why_not(x)
    elif backend in ("cpu", "cuda"):
        why = _extension_why_not(backend, x, op)
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if why is None and mask_grad:
        return f"{backend}: no gradient for a float attn_mask that requires grad"
    return why


def choose(backend: str, x: torch.Tensor, op: str = "normalizer", *, mask_grad: bool = False) -> str:
    """The backend that runs `op` on x: a kernel backend or "reference".

    "auto" takes the first kernel backend that can run the call (cpu, cuda,
    and for attention triton), else the reference; a forced backend that
    cannot run raises one RuntimeError listing every backend's reason.
    """
    if backend == "reference":
        return "reference"
    candidates = KERNEL_BACKENDS if op == "attention" else ("cpu", "cuda")
    if backend == "auto":
        if torch.compiler.is_compiling():
            return candidates[0]
        for b in candidates:
            if why_not(b, x, op, mask_grad=mask_grad) is None:
                return b
        if not _extension.LOADED:
            _extension.warn_fallback()
        return "reference"  # e.g. a meta or MPS tensor: the reference runs anywhere
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    why = why_not(backend, x, op, mask_grad=mask_grad)
    if why is not None:
        reasons = [r for r in (why_not(b, x, op, mask_grad=mask_grad) for b in KERNEL_BACKENDS) if r]
        raise RuntimeError(f"backend={backend!r} cannot run this call: {why}. All backends: "
                           + "; ".join(reasons + ["reference: available"]))
    return backend
