"""Public row-wise normalizers: validation, α handling and backend choice.

Signatures follow the `entmax` package so that
`from attnkern import sparsemax, entmax15, entmax_bisect` replaces
`from entmax import ...`.
"""

from __future__ import annotations

import math
import numbers

import torch

from attnkern import _extension
from attnkern.backends import reference

BACKENDS = ("auto", "cpu", "cuda", "triton", "reference")


class DimensionError(IndexError, ValueError):
    """A `dim` argument out of range (an IndexError as in torch, and a ValueError)."""


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), "
                        f"got {x.dtype}")


def check_dim(x: torch.Tensor, dim, name: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise DimensionError(f"{name}={dim} is out of range for a tensor with {x.dim()} dimensions "
                             f"(expected in [{-nd}, {nd - 1}])")
    return dim % nd


def broadcasts_to(shape, target) -> bool:
    """True when a tensor of `shape` expands to exactly `target`."""
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(target)) == torch.Size(target)
    except RuntimeError:
        return False


def check_alpha(alpha, x: torch.Tensor, dim: int, name: str = "alpha") -> torch.Tensor | float:
    """Validates α (> 0, not NaN; a float or a tensor broadcastable to x with size 1
    along dim). Returns a float or a tensor on x's device."""
    if isinstance(alpha, bool):
        raise TypeError(f"{name} must be a float or a tensor, got bool")
    if isinstance(alpha, numbers.Real):
        a = float(alpha)
        if math.isnan(a) or a <= 0:
            raise ValueError(f"{name} must be > 0, got {alpha}")
        return a
    if not isinstance(alpha, torch.Tensor):
        raise TypeError(f"{name} must be a float or a torch.Tensor, got {type(alpha).__name__}")
    if not alpha.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {alpha.dtype}")
    if alpha.device != x.device:
        raise ValueError(f"{name} is on {alpha.device} but the input is on {x.device}")
    row_shape = list(x.shape)
    if row_shape:
        row_shape[dim] = 1
    if not broadcasts_to(alpha.shape, row_shape):
        raise ValueError(f"{name} of shape {tuple(alpha.shape)} does not broadcast to the row shape "
                         f"{tuple(row_shape)} (the input's shape with size 1 along dim={dim})")
    if alpha.numel() and not alpha.device.type == "meta":
        with torch.no_grad():
            bad = torch.isnan(alpha) | (alpha <= 0)
            if bool(bad.any()):
                raise ValueError(f"{name} must be > 0 and not NaN everywhere; got min {alpha.min().item()}"
                                 + (" and NaN" if bool(torch.isnan(alpha).any()) else ""))
    return alpha


# --- backend choice -------------------------------------------------------


def _kernel_unavailable(backend: str, x: torch.Tensor) -> str | None:
    """Why `backend` cannot run a row-wise normalizer on x, or None if it can."""
    if backend == "reference":
        return None
    if backend == "triton":
        return "triton: has no row-wise normalizer kernels (its kernels are the fused attention)"
    if not _extension.LOADED:
        return f"{backend}: the compiled extension did not load ({_extension.LOAD_ERROR})"
    if backend == "cpu":
        return None if x.device.type == "cpu" else f"cpu: input is on {x.device}"
    if backend == "cuda":
        if not _extension.has_cuda_kernels():
            return "cuda: attnkern._C was built without CUDA kernels"
        return None if x.device.type == "cuda" else f"cuda: input is on {x.device}"
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def choose_backend(backend: str, x: torch.Tensor, unavailable=None, candidates=("cpu", "cuda")) -> str:
    """The backend that runs a call on x: one of `candidates` or "reference".

    unavailable(name, x) says why a backend cannot run the call (None if it
    can); it defaults to the row-wise normalizers' rules. "auto" takes the
    first candidate that can run, else the reference; a forced backend that
    cannot run raises one error listing every backend's reason.
    """
    unavailable = unavailable or _kernel_unavailable
    if backend == "reference":
        return "reference"
    if backend == "auto":
        if _compiling():
            return candidates[0]
        for b in candidates:
            if unavailable(b, x) is None:
                return b
        if not _extension.LOADED:
            _extension.warn_fallback()
        return "reference"  # e.g. a meta or MPS tensor: the reference runs anywhere
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    why = unavailable(backend, x)
    if why is not None:
        reasons = [r for r in (unavailable(b, x) for b in ("cpu", "cuda", "triton")) if r]
        raise RuntimeError(f"backend={backend!r} cannot run this call: {why}. All backends: "
                           + "; ".join(reasons + ["reference: available"]))
    return backend


def use_kernels(backend: str, x: torch.Tensor) -> bool:
    """True to call the compiled ops (dispatching on x's device), False for the reference."""
    return choose_backend(backend, x) != "reference"


# --- public functions --------------------------------------------------------


def _prologue(x, dim) -> int:
    if _compiling():
        return dim
    check_tensor(x, "X")
    return check_dim(x, dim)


def _check_k(k) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
        raise ValueError(f"k must be None or a positive int, got {k!r}")


def support_size(p: torch.Tensor, dim: int) -> torch.Tensor:
    """Nonzeros of p along dim (int64, keepdim), as the `entmax` package's
    return_support_size gives it. A NaN row counts 0."""
    if p.dim() == 0:
        return (p > 0).long()
    return (p.detach() > 0).sum(dim, keepdim=True)


def softmax(X: torch.Tensor, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """softmax along `dim`: argmax_{p in Δ} <p, X> + H(p) (Shannon entropy).

    X: any shape, floating point. Returns p of X's shape and dtype. A row of only
    -inf gives zeros (torch.softmax gives NaN there).
    """
    dim = _prologue(X, dim)
    if use_kernels(backend, X):
        from attnkern.autograd import SoftmaxFunction

        return SoftmaxFunction.apply(X, dim)
    return reference.softmax(X, dim)


def sparsemax(X: torch.Tensor, dim: int = -1, k: int | None = None, return_support_size: bool = False, *,
              backend: str = "auto"):
    """sparsemax along `dim`: argmin_{p in Δ} ||p - X||², the Euclidean projection
    onto the simplex (Martins & Astudillo, 2016).

    X: any shape, floating point. k: accepted for compatibility with the `entmax`
    package (a partial-sort hint there); results are exact whatever its value.
    return_support_size: also return the number of nonzeros per row, an int64
    tensor of X's shape with size 1 along `dim`.
    """
    dim = _prologue(X, dim)
    if not _compiling():
        _check_k(k)
    if use_kernels(backend, X):
        from attnkern.autograd import SparsemaxFunction

        p = SparsemaxFunction.apply(X, dim)
    else:
        p = reference.sparsemax(X, dim)
    return (p, support_size(p, dim)) if return_support_size else p


def entmax15(X: torch.Tensor, dim: int = -1, k: int | None = None, return_support_size: bool = False, *,
             backend: str = "auto"):
    """1.5-entmax along `dim`: argmax_{p in Δ} <p, X> + H^T_1.5(p) (Tsallis entropy,
    Peters et al., 2019). k, return_support_size: as in sparsemax."""
    dim = _prologue(X, dim)
    if not _compiling():
        _check_k(k)
    if use_kernels(backend, X):
        from attnkern.autograd import Entmax15Function

        p = Entmax15Function.apply(X, dim)
    else:
        p = reference.entmax15(X, dim)
    return (p, support_size(p, dim)) if return_support_size else p


def entmax(X: torch.Tensor, alpha=1.5, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """α-entmax along `dim`: argmax_{p in Δ} <p, X> + H^T_α(p), with the Tsallis
    α-entropy H^T_α(p) = (1 - Σ p_i^α) / (α(α-1)).

    alpha: a float > 0 or a tensor broadcastable to X with size 1 along `dim`
    (one α per row, e.g. per head), which may require grad. α = 1 is softmax,
    α = 1.5 entmax15, α = 2 sparsemax (each computed exactly); α < 1 gives the
    dense members of the family. Other α: a safeguarded Newton solver converged
    to the dtype's resolution.
    """
    dim = _prologue(X, dim)
    if not _compiling():
        alpha = check_alpha(alpha, X, dim)
    kernels = use_kernels(backend, X)
    if not isinstance(alpha, torch.Tensor):
        if kernels and alpha in (1.0, 1.5, 2.0):
            return {1.0: softmax, 1.5: entmax15, 2.0: sparsemax}[alpha](X, dim, backend=backend)
        alpha = torch.tensor(alpha, dtype=torch.float64 if X.dtype == torch.float64 else torch.float32,
                             device=X.device)
    if kernels:
        from attnkern.autograd import EntmaxFunction

        return EntmaxFunction.apply(X, alpha, dim)
    return reference.entmax(X, alpha, dim)


def entmax_bisect(X: torch.Tensor, alpha=1.5, dim: int = -1, n_iter: int = 50, ensure_sum_one: bool = True,
                  *, backend: str = "auto") -> torch.Tensor:
    """α-entmax with the `entmax` package's `entmax_bisect` signature.

    The result is converged to the dtype's resolution whatever `n_iter` is (it is
    validated and kept for compatibility) and always sums to one, so
    `ensure_sum_one` changes nothing. Unlike the package, α = 1 is softmax (not
    the uniform distribution) and a row of only -inf gives zeros.
    """
    if not _compiling():
        if isinstance(n_iter, bool) or not isinstance(n_iter, numbers.Integral) or n_iter < 1:
            raise ValueError(f"n_iter must be a positive int, got {n_iter!r}")
        if not isinstance(ensure_sum_one, bool):
            raise TypeError(f"ensure_sum_one must be a bool, got {type(ensure_sum_one).__name__}")
    return entmax(X, alpha, dim, backend=backend)
