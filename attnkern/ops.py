"""Public row-wise normalizers: α handling, and the call to the kernels or the
reference (validation in attnkern.validation, backend choice in
attnkern.backends.registry).

Signatures follow the `entmax` package so that
`from attnkern import sparsemax, entmax15, entmax_bisect` replaces
`from entmax import ...`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnkern import _extension
from attnkern.backends import reference, registry
from attnkern.family import acc_dtype
from attnkern.validation import (
    DimensionError,
    check_dim,
    check_flag,
    check_k,
    check_n_iter,
    check_pairwise,
    check_row_param,
    check_tensor,
)

BACKENDS = registry.BACKENDS

__all__ = ["softmax", "sparsemax", "entmax15", "entmax", "entmax_bisect", "fusedmax", "oscarmax", "crf_marginals",
           "sparsemap_chain", "SparsemapActiveSet", "BACKENDS",
           "DimensionError"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def carries_derivative(t) -> bool:
    """True when t needs derivatives: it requires grad, carries a forward-mode
    tangent, or is inside a torch.func transform."""
    if not isinstance(t, torch.Tensor):
        return False
    if _compiling():  # no forward mode or torch.func transform inside a compiled region
        return t.requires_grad
    return (t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)
            or torch.autograd.forward_ad.unpack_dual(t).tangent is not None)


# --- backend choice -------------------------------------------------------


def use_kernels(backend: str, x: torch.Tensor) -> bool:
    """True to call the compiled ops (dispatching on x's device), False for the reference."""
    return registry.choose(backend, x) != "reference"


# --- public functions --------------------------------------------------------


def _prologue(x, dim) -> int:
    if _compiling():
        return dim
    check_tensor(x, "X")
    return check_dim(x, dim)


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
        check_k(k)
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
        check_k(k)
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
        alpha = check_row_param(alpha, X, dim, lower=None)
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


# The structured ops whose parameter is the chain's 2×2 transition scores
# (the others take λ).
_CHAIN_OPS = ("crf_marginals", "sparsemap_chain")
# The structured ops with a CUDA row kernel (csrc/cuda).
_CUDA_ROW_KERNELS = ("fusedmax", "crf_marginals")


def _structured(name: str, X: torch.Tensor, dim: int, param, backend: str) -> torch.Tensor:
    """The structured op `name` (fusedmax, oscarmax with param = λ;
    crf_marginals, sparsemap_chain with param = the pairwise scores) through
    its CPU kernel (fusedmax also its CUDA kernel) or the reference; other
    devices only by the reference, when asked."""
    dim = _prologue(X, dim)
    if not _compiling():
        param = (check_pairwise(param, X, dim) if name in _CHAIN_OPS
                 else check_row_param(param, X, dim, name="lam", lower=0.0, strict=False))
    oracle = getattr(reference, name)
    if backend == "reference":
        return oracle(X, param, dim)
    # (CUDA: the ops of _CUDA_ROW_KERNELS have row kernels; the others raise rather than fall back to the slow
    # reference.)
    on_cuda = X.device.type == "cuda" and backend in ("auto", "cuda") and registry.why_not("cuda", X, name) is None
    if not on_cuda and (X.device.type != "cpu" or backend not in ("auto", "cpu")):
        raise NotImplementedError(
            f"attnkern.{name} has kernels for CPU tensors{' and CUDA' if name in _CUDA_ROW_KERNELS else ''} only "
            f"(got backend={backend!r} on {X.device}); backend='reference' runs the float64 reference on any "
            "device")
    if registry.choose(backend, X) == "reference":  # auto without the compiled extension (warned)
        return oracle(X, param, dim)
    from attnkern import autograd

    if not isinstance(param, torch.Tensor):
        # (The kernels read a float64 λ as it is whatever the input's dtype:
        # a λ beyond the accumulation type's range stays float64 rather than
        # becoming inf.)
        dtype = acc_dtype(X.dtype)
        if abs(param) > torch.finfo(dtype).max:
            dtype = torch.float64
        param = torch.tensor(param, dtype=dtype, device=X.device)
    if name in ("fusedmax", "oscarmax") and not on_cuda:
        return getattr(autograd, f"{name}_cpu_apply")(X, param, dim)
    return getattr(autograd, f"{name}_apply")(X, param, dim)


def fusedmax(X: torch.Tensor, dim: int = -1, lam=1.0, *, backend: str = "auto") -> torch.Tensor:
    """fusedmax along `dim` (Niculae & Blondel, 2017):
    argmin_{p in Δ} ½||p - X||² + lam Σ_i |p_{i+1} - p_i|, a sparse distribution
    that also gives neighbouring entries equal weights (fused segments).

    It equals sparsemax of the 1-D total-variation denoising of the row,
    computed exactly. lam >= 0 applies to X as given (in attention: to the
    scaled scores); a float, or a tensor broadcastable to X with size 1 along
    `dim` (one λ per row), which may require grad. lam = 0 is sparsemax.
    Entries at -inf are removed first: the finite entries on either side of
    them become neighbours, and they get 0 (a row of only -inf gives zeros).
    First derivatives only (in X and lam). Kernels: CPU, and CUDA (one thread
    per row, the CPU kernel's math, scratch of 32 bytes per entry for up to
    256 MiB of rows at a time); on other devices pass backend="reference"
    (float64, slow: an oracle).
    """
    return _structured("fusedmax", X, dim, lam, backend)


def oscarmax(X: torch.Tensor, dim: int = -1, lam=1.0, *, backend: str = "auto") -> torch.Tensor:
    """oscarmax along `dim` (Niculae & Blondel, 2017): sparsemax(prox_Ω(X)) with
    the OSCAR penalty Ω(y) = lam Σ_{i<j} max(|y_i|, |y_j|), which groups entries
    of equal magnitude into clusters of equal weight wherever they sit in the row.

    This is the composition as the authors compute it, not the minimiser of
    ½||p - X||² + Ω(p) over the simplex (the two differ). The penalty weighs
    the k-th largest |y| by lam·(m - k), m the number of finite entries, so it
    is not shift-invariant: adding a constant to X changes the result. Entries
    at -inf are removed first and get 0 (mask with -inf, not with a large
    finite value, which would count in m and in the ranks). Because the
    weights grow with m, a long row at moderate lam has a prox of 0 and
    oscarmax is uniform over its finite entries (so is every row whose largest
    |X| is at most lam·(m - 1)/2; rows of 1024 standard-normal scores are
    uniform from about lam = 0.006 on): scale lam with 1/m to compare rows of
    different lengths. lam, backend, derivatives: as fusedmax.
    """
    return _structured("oscarmax", X, dim, lam, backend)


def crf_marginals(unary: torch.Tensor, pairwise, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """The marginals P(z_i = 1) of a binary linear-chain CRF along `dim` (Kim,
    Denton, Hoang & Rush, "Structured Attention Networks", 2017): over the
    labelings z in {0, 1}^n of each row, p(z) ∝ exp(Σ_i unary_i z_i +
    Σ_i pairwise[z_i, z_{i+1}]).

    The result is in [0, 1] entry by entry and does not sum to one: it is a
    vector of marginals, not a distribution over positions. pairwise: the 2×2
    transition scores (rows: z_i, columns: z_{i+1}), shared (shape (2, 2)) or
    one per row (unary's shape without `dim`, then (2, 2), or anything that
    broadcasts to it); it may require grad, and -inf forbids a transition.
    Entries of `unary` at -inf are removed first: the finite entries on either
    side become neighbours, and they get 0 (a row of only -inf gives zeros). A
    row with NaN or +inf gives NaN, as does a row that no labeling can score.
    Forward-backward in float64, exact, except on the CPU for float32,
    bfloat16 and float16 rows of weakly coupled chains (|log ρ| <= 4, ρ =
    exp(pairwise[0,0] + pairwise[1,1] - pairwise[0,1] - pairwise[1,0]), with
    the spread of pairwise <= 27 and max |unary| + that spread <= 40), which
    run in float: within 10 float ulps of the exact marginals (docs/api.md).
    First derivatives only (in unary and pairwise). Kernels: CPU, and CUDA
    (one thread per row, the CPU kernel's log-space math, scratch of 120 bytes
    per entry for up to 256 MiB of rows at a time); on other devices pass
    backend="reference" (float64, slow: an oracle).
    """
    return _structured("crf_marginals", unary, dim, pairwise, backend)


class SparsemapActiveSet(NamedTuple):
    """sparsemap_chain(..., return_active=True): the marginals and the active
    set that gives them, marginals = Σ_k weights[..., k] · structures[..., k, :]
    (along the last dim; moved back to `dim` in marginals only)."""

    marginals: torch.Tensor  # as sparsemap_chain returns it (differentiable)
    structures: torch.Tensor  # bool (rows..., K, n): the active labelings, K the largest support of any row
    weights: torch.Tensor  # float64 (rows..., K): their weights, 0 past a row's support
    oracle_calls: torch.Tensor  # int64 (rows...): the Viterbi calls of each row's solve


def sparsemap_chain(unary: torch.Tensor, pairwise, dim: int = -1, *, backend: str = "auto",
                    return_active: bool = False):
    """SparseMAP over the binary linear chain of crf_marginals (Niculae,
    Martins, Blondel & Cardie, 2018): the unary marginals μ of

        argmax over the chain's marginal polytope of
        Σ_i unary_i μ_i + Σ_i Σ_ab pairwise[a, b] μ_i(a, b) − ½ Σ_i μ_i²,

    μ_i = P(z_i = 1) and μ_i(a, b) = P(z_i = a, z_{i+1} = b). The regulariser
    is on P(z_i = 1) alone (the binary-variable form; the one-hot form, which
    also counts (1 − μ_i)², is this one with unary (unary + 1)/2 and pairwise
    pairwise/2). The solution is a sparse mixture of a few
    labelings, so μ often holds exact 0s and 1s; with pairwise = 0 it is
    clamp(unary, 0, 1). Arguments, masks and derivatives as crf_marginals.
    Solved exactly: in closed form, certified by one Viterbi call (a clamped
    total-variation prox when every transition is allowed, a clamped
    order-constrained projection when one is forbidden), else by the
    active-set method with Viterbi as the oracle.
    return_active=True returns a SparsemapActiveSet: the marginals, and per row
    (unary's shape without `dim`) the active labelings, their weights and the
    solve's Viterbi calls, from the CPU kernel (no derivatives: the active set
    is piecewise constant). Rows with no finite entry, NaN or no feasible
    labeling have an empty support and 0 calls.
    """
    marginals = _structured("sparsemap_chain", unary, dim, pairwise, backend)
    if not return_active:
        return marginals
    if backend not in ("auto", "cpu") or unary.device.type != "cpu" or not _extension.LOADED:
        raise NotImplementedError("sparsemap_chain(return_active=True) reads the active set from the CPU kernel: "
                                  f"it needs a CPU tensor, the compiled extension and backend 'auto' or 'cpu' (got "
                                  f"backend={backend!r} on {unary.device})")
    d = dim % unary.dim() if unary.dim() else 0
    pw = pairwise if isinstance(pairwise, torch.Tensor) else torch.as_tensor(pairwise, dtype=torch.float64)
    structures, weights, calls = torch.ops.attnkern.sparsemap_chain_active(unary.detach(), pw.detach(), d)
    return SparsemapActiveSet(marginals, structures, weights, calls)

