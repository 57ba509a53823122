"""Public row-wise normalizers: validation, α handling and backend choice.

Signatures follow the `entmax` package so that
`from attnkern import sparsemax, entmax15, entmax_bisect` replaces
`from entmax import ...`.
"""

from __future__ import annotations

import numbers
import operator

import numpy as np
import torch

from attnkern import _extension
from attnkern.backends import reference
from attnkern.family import acc_dtype

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


def as_index(value, name: str) -> int:
    """An integer argument as a Python int. Accepts what the `entmax` package
    (and torch) accept as an int: Python and numpy integers and one-element
    integer tensors (e.g. `y[0]`); refuses bools, floats and anything else."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or \
                value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a one-element integer tensor, got a tensor of "
                            f"shape {tuple(value.shape)} and dtype {value.dtype}")
        return int(value.item())
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def check_dim(x: torch.Tensor, dim, name: str = "dim") -> int:
    dim = as_index(dim, name)
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise DimensionError(f"{name}={dim} is out of range for a tensor with {x.dim()} dimensions "
                             f"(expected in [{-nd}, {nd - 1}])")
    return dim % nd


def any_true(mask: torch.Tensor) -> bool:
    """bool(mask.any()) for a validation check; False under torch.func.vmap,
    where values cannot steer Python (the check is then skipped)."""
    try:
        return bool(mask.any())
    except RuntimeError as exc:
        if "vmap" in str(exc):
            return False
        raise


def carries_derivative(t) -> bool:
    """True when t needs derivatives: it requires grad, carries a forward-mode
    tangent, or is inside a torch.func transform."""
    if not isinstance(t, torch.Tensor):
        return False
    if _compiling():  # no forward mode or torch.func transform inside a compiled region
        return t.requires_grad
    return (t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)
            or torch.autograd.forward_ad.unpack_dual(t).tangent is not None)


def broadcasts_to(shape, target) -> bool:
    """True when a tensor of `shape` expands to exactly `target`."""
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(target)) == torch.Size(target)
    except RuntimeError:
        return False


def check_alpha(alpha, x: torch.Tensor, dim: int, name: str = "alpha", lower: float | None = 0.0,
                strict: bool = True) -> torch.Tensor | float:
    """Validates α: a real number (Python or numpy) or a tensor (or numpy array)
    broadcastable to x with size 1 along dim; not NaN, and > lower (>= lower if
    not strict; any finite value if lower is None). Integer tensors become
    floating point. Returns a float or a floating-point tensor on x's device."""
    if isinstance(alpha, (bool, np.bool_)):
        raise TypeError(f"{name} must be a float or a tensor, got bool")
    if lower is None:
        def bad(a):
            return ~torch.isfinite(a)
        need = "finite"
    elif strict:
        def bad(a):
            return torch.isnan(a) | (a <= lower)
        need = f"> {lower:g}"
    else:
        def bad(a):
            return torch.isnan(a) | (a < lower)
        need = f">= {lower:g}"
    if isinstance(alpha, numbers.Real):
        a = float(alpha)
        if bool(bad(torch.tensor(a, dtype=torch.float64))):
            raise ValueError(f"{name} must be {need}, got {alpha}")
        return a
    if isinstance(alpha, np.ndarray):
        alpha = torch.as_tensor(alpha, device=x.device)
    if not isinstance(alpha, torch.Tensor):
        raise TypeError(f"{name} must be a float or a torch.Tensor, got {type(alpha).__name__}")
    if alpha.dtype == torch.bool or alpha.is_complex():
        raise TypeError(f"{name} must be a real tensor, got {alpha.dtype}")
    if not alpha.is_floating_point():  # an integer tensor, e.g. torch.tensor(2): no gradient to keep
        alpha = alpha.to(acc_dtype(x.dtype))
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
            if any_true(bad(alpha)):
                raise ValueError(f"{name} must be {need} and not NaN everywhere; got min {alpha.min().item()}"
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
    if k is not None and as_index(k, "k") < 1:
        raise ValueError(f"k must be None or a positive int, got {k!r}")


def check_n_iter(n_iter, allow_any: bool = False) -> None:
    """n_iter as the `entmax` package takes it: an int >= 1 (its bisection needs one
    step), given as a Python or numpy int or a one-element integer tensor. Our
    results are converged whatever its value. allow_any: the package ignores it
    (sparsemax_bisect): any number, or None."""
    if _compiling() or (allow_any and (n_iter is None or isinstance(n_iter, numbers.Real))):
        return
    n = as_index(n_iter, "n_iter")
    if n < 1 and not allow_any:
        raise ValueError(f"n_iter must be a positive int, got {n_iter!r}")


def check_flag(value, name: str) -> None:
    """A flag the `entmax` package only tests for truth (ensure_sum_one): anything
    with a truth value is accepted."""
    try:
        bool(value)
    except Exception as exc:
        raise TypeError(f"{name} must have a truth value (a bool), got {type(value).__name__}: {exc}") from None


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
        from attnkern.autograd import softmax_apply

        return softmax_apply(X, dim)
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
        from attnkern.autograd import sparsemax_apply

        p = sparsemax_apply(X, dim)
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
        from attnkern.autograd import entmax15_apply

        p = entmax15_apply(X, dim)
    else:
        p = reference.entmax15(X, dim)
    return (p, support_size(p, dim)) if return_support_size else p


def entmax(X: torch.Tensor, alpha=1.5, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """α-entmax along `dim`: argmax_{p in Δ} <p, X> + H^T_α(p), with the Tsallis
    α-entropy H^T_α(p) = (1 - Σ p_i^α) / (α(α-1)).

    alpha: a finite float or a tensor broadcastable to X with size 1 along `dim`
    (one α per row, e.g. per head), which may require grad. α = 1 is softmax,
    α = 1.5 entmax15, α = 2 sparsemax (each computed exactly); α < 1 (also
    α ≤ 0, as the `entmax` package accepts) gives the dense members of the
    family. Other α: a safeguarded Newton solver converged to the dtype's
    resolution.
    """
    dim = _prologue(X, dim)
    if not _compiling():
        # Every finite α: α ≤ 0 gives dense members of the family, as for 0 < α < 1
        # (α = 0 is p_i = 1/(c - x_i)), as in the `entmax` package.
        alpha = check_alpha(alpha, X, dim, lower=None)
    kernels = use_kernels(backend, X)
    if not isinstance(alpha, torch.Tensor):
        if kernels and alpha in (1.0, 1.5, 2.0):
            return {1.0: softmax, 1.5: entmax15, 2.0: sparsemax}[alpha](X, dim, backend=backend)
        alpha = torch.tensor(alpha, dtype=acc_dtype(X.dtype), device=X.device)
    if kernels:
        from attnkern.autograd import entmax_apply

        return entmax_apply(X, alpha, dim)
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
        check_n_iter(n_iter)
        check_flag(ensure_sum_one, "ensure_sum_one")
    return entmax(X, alpha, dim, backend=backend)
