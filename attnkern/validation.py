"""Validation of the public functions' arguments: tensors, dims, ints and flags,
and the row parameters (α, the budget, attention masks) of ops, attention,
compat, losses and the nn modules.

Value checks never synchronise with a CUDA device: on CPU tensors they raise a
ValueError at once; on other devices they are an asynchronous device-side
assert (torch._assert_async), which fails the next synchronising call.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from attnkern.family import STRUCTURED_NORMALIZERS, Family, acc_dtype, takes_alpha, takes_lam


class DimensionError(IndexError, ValueError):
    """A `dim` argument out of range (an IndexError as in torch, and a ValueError)."""


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


def any_true(mask: torch.Tensor, under_vmap: bool = False) -> bool:
    """bool(mask.any()); `under_vmap` under torch.func.vmap, where values cannot
    steer Python (False, the default, skips a validation check there)."""
    try:
        return bool(mask.any())
    except RuntimeError as exc:
        if "vmap" in str(exc):
            return under_vmap
        raise


def broadcasts_to(shape, target) -> bool:
    """True when a tensor of `shape` expands to exactly `target`."""
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(target)) == torch.Size(target)
    except RuntimeError:
        return False


# --- row parameters: α, budget ------------------------------------------------------------------


def _bound(lower: float | None, strict: bool):
    """(bad(t) -> bool tensor, "what is needed") for a parameter bounded below by
    `lower` (strictly or not); any finite value when lower is None. NaN and
    ±inf are bad whatever the bound (α = +inf or an infinite budget has no
    meaning, and the kernels would return zeros for it)."""
    if lower is None:
        return (lambda a: ~torch.isfinite(a)), "finite"
    if strict:
        return (lambda a: ~torch.isfinite(a) | (a <= lower)), f"finite and > {lower:g}"
    return (lambda a: ~torch.isfinite(a) | (a < lower)), f"finite and >= {lower:g}"


def check_real(value, name: str, lower: float | None = 0.0, strict: bool = True) -> float:
    """A real number (Python or numpy, not bool) within the bound, as a float."""
    bad, need = _bound(lower, strict)
    a = float(value)
    if bool(bad(torch.tensor(a, dtype=torch.float64))):
        raise ValueError(f"{name} must be {need}, got {value}")
    return a


def check_values(t: torch.Tensor, name: str, lower: float | None = 0.0, strict: bool = True) -> None:
    """Every entry of t within the bound (see the module docstring: at once on
    CPU, an asynchronous assert on other devices; nothing for meta tensors)."""
    if not t.numel() or t.device.type == "meta":
        return
    bad, need = _bound(lower, strict)
    with torch.no_grad():
        wrong = bad(t)
        if t.device.type != "cpu":
            try:
                torch._assert_async(~wrong.any(), f"{name} must be {need} everywhere")
            except RuntimeError as exc:  # under torch.func.vmap: the check is skipped
                if "vmap" not in str(exc):
                    raise
            return
        if any_true(wrong):
            raise ValueError(f"{name} must be {need} everywhere; got min {t.min().item()}, max {t.max().item()}"
                             + (" and NaN" if bool(torch.isnan(t).any()) else ""))


def _real_tensor(value, x: torch.Tensor, name: str, accepted: str) -> torch.Tensor:
    """A tensor argument (a torch.Tensor or numpy array) as a floating-point
    tensor on x's device: integer tensors become floating point (no gradient to
    keep); bool, complex, other types and other devices are refused."""
    if isinstance(value, np.ndarray):
        value = torch.as_tensor(value, device=x.device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name} must be a real tensor, got {value.dtype}")
    if not value.is_floating_point():
        value = value.to(acc_dtype(x.dtype))
    if value.device != x.device:
        raise ValueError(f"{name} is on {value.device} but the input is on {x.device}")
    return value


def check_row_param(value, x: torch.Tensor, dim: int, name: str = "alpha", lower: float | None = 0.0,
                    strict: bool = True) -> torch.Tensor | float:
    """A per-row parameter of a row-wise op (α, the budget): a real number
    (Python or numpy) or a tensor (or numpy array) broadcastable to x with size
    1 along dim; not NaN, and > lower (>= lower if not strict; any finite value
    if lower is None). Integer tensors become floating point. Returns a float or
    a floating-point tensor on x's device."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a float or a tensor, got bool")
    if isinstance(value, numbers.Real):
        return check_real(value, name, lower, strict)
    value = _real_tensor(value, x, name, "a float or a torch.Tensor")
    row_shape = list(x.shape)
    if row_shape:
        row_shape[dim] = 1
    if not broadcasts_to(value.shape, row_shape):
        raise ValueError(f"{name} of shape {tuple(value.shape)} does not broadcast to the row shape "
                         f"{tuple(row_shape)} (the input's shape with size 1 along dim={dim})")
    check_values(value, name, lower, strict)
    return value


def check_pairwise(value, x: torch.Tensor, dim: int) -> torch.Tensor:
    """crf_marginals' transition scores: a floating-point tensor (or numpy
    array) on x's device of shape (2, 2), or broadcastable to x's shape without
    dim followed by (2, 2) (one 2×2 per row); no NaN or +inf (-inf forbids a
    transition). Integer tensors become floating point."""
    value = _real_tensor(value, x, "pairwise", "a torch.Tensor")
    target = [s for d, s in enumerate(x.shape) if d != dim] + [2, 2]
    if value.dim() < 2 or tuple(value.shape[-2:]) != (2, 2) or not broadcasts_to(value.shape, target):
        raise ValueError(f"pairwise of shape {tuple(value.shape)} must be (2, 2) or broadcast to {tuple(target)} "
                         f"(the unary scores' shape without dim={dim}, then 2×2)")
    if value.numel() and value.device.type == "cpu":
        with torch.no_grad():
            if any_true(value.isnan() | (value == math.inf)):
                raise ValueError("pairwise must not hold NaN or +inf (-inf forbids a transition)")
    return value


def head_alpha_view(alpha: torch.Tensor, heads: int) -> torch.Tensor:
    """A (H,) tensor means one α per head: view it as (H, 1, 1)."""
    if alpha.dim() == 1 and alpha.shape[0] == heads and heads != 1:
        return alpha.view(heads, 1, 1)
    return alpha


def _head_param(value, name: str, target: tuple, heads: int, device: torch.device, strict: bool):
    """A per-head parameter of attention (α, λ): a finite float > 0 (>= 0 if not
    strict), or a floating-point tensor on the query's `device` broadcastable
    to `target` = (*batch, H, 1, 1), where a 1-d tensor of H values is one value
    per head (returned viewed as (H, 1, 1))."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a tensor, got bool")
    if isinstance(value, numbers.Real):
        return check_real(value, name, lower=0.0, strict=strict)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float or a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but query is on {device}")
    t = head_alpha_view(value, heads)
    if not broadcasts_to(t.shape, target):
        raise ValueError(f"{name} of shape {tuple(value.shape)} must be a float, a tensor of {heads} values "
                         f"(one per head), or broadcastable to {tuple(target)}")
    check_values(t, name, lower=0.0, strict=strict)
    return t


def check_attention_alpha(alpha, normalizer: str, target: tuple, heads: int, device: torch.device):
    """attention's α: None unless the normalizer takes it; then as _head_param
    (> 0)."""
    if not takes_alpha(normalizer):
        if alpha is not None:
            raise ValueError(f"alpha is only used with normalizer='entmax', got normalizer={normalizer!r}")
        return None
    if alpha is None:
        raise ValueError("normalizer='entmax' needs alpha (a float > 0 or a tensor of one value per head)")
    return _head_param(alpha, "alpha", target, heads, device, strict=True)


def check_attention_lam(lam, normalizer: str, target: tuple, heads: int, device: torch.device):
    """attention's λ: None unless the normalizer is structured (fusedmax,
    oscarmax); then 1.0 for None (as the row-wise ops), else as _head_param
    (>= 0)."""
    if not takes_lam(normalizer):
        if lam is not None:
            raise ValueError(f"lam is only used with normalizer in {STRUCTURED_NORMALIZERS}, got "
                             f"normalizer={normalizer!r}")
        return None
    return 1.0 if lam is None else _head_param(lam, "lam", target, heads, device, strict=False)


def check_module_alpha(normalizer: str, alpha) -> None:
    """An nn module's normalizer and α setting: for "entmax", alpha is a float >
    0 or "learnable"; for the other normalizers it is None."""
    Family.of(normalizer)
    if takes_alpha(normalizer):
        if alpha is None:
            raise ValueError("normalizer='entmax' needs alpha: a float > 0 or 'learnable'")
        if not (isinstance(alpha, str) and alpha == "learnable") and (
                isinstance(alpha, (str, bool)) or not float(alpha) > 0):
            raise ValueError(f"alpha must be a float > 0 or 'learnable', got {alpha!r}")
    elif alpha is not None:
        raise ValueError(f"alpha is only used with normalizer='entmax', got alpha={alpha!r} "
                         f"with normalizer={normalizer!r}")


def check_module_lam(normalizer: str, alpha, lam, learnable: bool = False):
    """An nn module's normalizer parameters: for a structured normalizer, alpha
    must be None and lam a finite float >= 0 (None: 1.0) or, where the module
    allows it (`learnable`), "learnable"; for the others, alpha as
    check_module_alpha and lam None. Returns lam as a float, "learnable" or
    None."""
    if not takes_lam(normalizer):
        check_module_alpha(normalizer, alpha)
        if lam is not None:
            raise ValueError(f"lam is only used with normalizer in {STRUCTURED_NORMALIZERS}, got lam={lam!r} "
                             f"with normalizer={normalizer!r}")
        return None
    if alpha is not None:
        raise ValueError(f"alpha is only used with normalizer='entmax', got alpha={alpha!r} with "
                         f"normalizer={normalizer!r} (it takes lam)")
    if lam is None:
        return 1.0
    if learnable and isinstance(lam, str) and lam == "learnable":
        return lam
    if isinstance(lam, (str, bool)) or not isinstance(lam, numbers.Real) or not (
            math.isfinite(float(lam)) and float(lam) >= 0):
        allowed = "a finite float >= 0" + (" or 'learnable'" if learnable else "")
        raise ValueError(f"lam must be {allowed}, got {lam!r}")
    return float(lam)


def learnable_alpha_theta(alpha_init, device=None, dtype=None) -> torch.Tensor:
    """θ with α = 1 + sigmoid(θ) = alpha_init, the parameter of a learnable α
    kept in (1, 2); alpha_init must lie in (1, 2). device and dtype are the
    module's factory kwargs (None: torch's defaults). θ is made in the
    accumulation dtype of `dtype` (float32 for float16 and bfloat16): every
    consumer casts α to that dtype before use (the kernels take α in float32 or
    float64), and a half-precision θ would round away small updates of α."""
    if not 1.0 < float(alpha_init) < 2.0:
        raise ValueError(f"alpha_init must be in (1, 2), got {alpha_init}")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return torch.logit(torch.tensor(float(alpha_init) - 1.0, dtype=acc_dtype(dtype), device=device))


# --- attention masks ---------------------------------------------------------------------------------


def check_mask_dtype(mask: torch.Tensor, name: str) -> None:
    """A mask is bool or floating point (added to the scores)."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be a bool or floating-point tensor, got {mask.dtype}")


def check_attn_mask(attn_mask, query: torch.Tensor) -> None:
    """attention's attn_mask: None, or a bool or float tensor on query's device
    (its shape is checked against the broadcast batch by the caller)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None or a torch.Tensor, got {type(attn_mask).__name__}")
    check_mask_dtype(attn_mask, "attn_mask")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")


# --- ints and flags -------------------------------------------------------------------------------


def check_k(k) -> None:
    if k is not None and as_index(k, "k") < 1:
        raise ValueError(f"k must be None or a positive int, got {k!r}")


def check_n_iter(n_iter, allow_any: bool = False) -> None:
    """n_iter as the `entmax` package takes it: an int >= 1 (its bisection needs one
    step), given as a Python or numpy int or a one-element integer tensor. Our
    results are converged whatever its value. allow_any: the package ignores it
    (sparsemax_bisect): any number, or None."""
    if torch.compiler.is_compiling() or (allow_any and (n_iter is None or isinstance(n_iter, numbers.Real))):
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
