"""Attention modules for recurrent models (Luong, additive, scaled dot), with
softmax, sparsemax, 1.5-entmax, α-entmax, fusedmax or oscarmax weights, or the
marginals of a linear-chain CRF or of SparseMAP over the positions, computed by
attnkern's row kernels.

Shapes: a query is (B, Dq) (one decoder step) or (B, L, Dq) (L decoder steps at
once, e.g. under teacher forcing); keys are (B, T, Dk) and values (B, T, Dv).
Scores and weights are (B, T), or (B, L, T) for a (B, L, Dq) query. A mask is
(B, T) bool, True at real positions; it applies to every query step.

Modes:
  "learned"  weights = normalizer(scores), trained as usual;
  "uniform"  weights are uniform over the unmasked positions, with no gradient
             to the scores (the score parameters are never used);
  "fixed"    the caller passes the weights to forward (e.g. taken from another
             model); calling without them is an error.
In every mode, `weights=` given to forward overrides the module's own.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import nn

from attnkern import ops
from attnkern.family import CHAIN_NORMALIZERS, NORMALIZERS, STRUCTURED_NORMALIZERS, acc_dtype
from attnkern.validation import check_module_lam, learnable_alpha_theta

MODES = ("learned", "uniform", "fixed")
RNN_NORMALIZERS = NORMALIZERS + STRUCTURED_NORMALIZERS + tuple(CHAIN_NORMALIZERS)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def uniform_weights(mask: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """Uniform weights over the True positions of mask (B, T), expanded to
    `shape` (B, T) or (B, L, T); a row with no True position gets zeros."""
    m = mask.to(dtype)
    w = m / m.sum(-1, keepdim=True).clamp_min(1.0)
    if len(shape) == 3:
        w = w.unsqueeze(1).expand(shape)
    return w


# The start of the chain normalizers' learnable unary bias (RNNAttention):
# the middle of SparseMAP's range with a gradient, (0, 1); none for the CRF.
CHAIN_UNARY_BIAS = {"crf": 0.0, "sparsemap": 0.5}


class RNNAttention(nn.Module, abc.ABC):
    """Base class: normalization, masks and modes. Subclasses define `scores`.

    normalizer: "softmax", "sparsemax", "entmax15", "entmax" (with alpha), or
      the structured "fusedmax" and "oscarmax" (with lam, attnkern.fusedmax).
    alpha: for "entmax", a float > 0 (fixed) or "learnable": one α kept in
      (1, 2) as α = 1 + sigmoid(θ), starting at alpha_init.
    lam: for "fusedmax" and "oscarmax", a float >= 0 (default 1.0) applied to
      the scores as the attention kind computes them.
    "crf" and "sparsemap" (Kim et al., 2017; Niculae et al., 2018): the
      weights are the marginals μ_i = P(z_i = 1) of a binary chain over the
      positions with unary scores = the scores and learnable 2×2 pairwise
      scores (the `pairwise` parameter, from zeros), by attnkern.crf_marginals
      or attnkern.sparsemap_chain; context = Σ_i μ_i v_i. Marginals in [0, 1],
      not a distribution (they need not sum to 1). The unary scores get a
      learnable bias, `unary_bias`, starting at 0.5 for sparsemap and 0 for
      crf: SparseMAP's marginals are clamp(score, 0, 1) at the pairwise
      scores' start, whose gradient vanishes outside (0, 1), and from scores
      near 0 training can push every position below 0, the all-zero labeling,
      where no gradient reaches the scores again; the bias starts the scores
      in the middle of the range where they have a gradient.
    mode: "learned", "uniform" or "fixed" (see the module docstring).
    backend: attnkern backend of the normalizer ("auto" runs the compiled
      kernel on CPU tensors; "reference" the float64 oracle).
    device, dtype: as for torch's modules, for every parameter; the learnable
      α's θ stays float32 for float16 and bfloat16 (see
      attnkern.validation.learnable_alpha_theta).
    """

    def __init__(self, *, normalizer: str = "softmax", alpha=None, alpha_init: float = 1.5, mode: str = "learned",
                 backend: str = "auto", lam=None, device=None, dtype=None):
        super().__init__()
        if normalizer in CHAIN_NORMALIZERS:
            if alpha is not None or lam is not None:
                raise ValueError(f"normalizer={normalizer!r} takes neither alpha nor lam (its parameters are the "
                                 "learnable pairwise scores)")
            self.lam = None
        else:
            self.lam = check_module_lam(normalizer, alpha, lam)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if backend not in ops.BACKENDS:
            raise ValueError(f"backend must be one of {ops.BACKENDS}, got {backend!r}")
        self.alpha_theta = None
        self.fixed_alpha = None
        # The chain's 2×2 transition scores pairwise[z_i, z_{i+1}], learnable,
        # starting at zeros (independent positions: P(z_i = 1) = sigmoid(score_i)
        # for crf); in the accumulation dtype of `dtype`, as θ.
        if normalizer in CHAIN_NORMALIZERS:
            chain_dtype = acc_dtype(dtype if dtype is not None else torch.get_default_dtype())
            self.pairwise = nn.Parameter(torch.zeros(2, 2, device=device, dtype=chain_dtype))
            self.unary_bias = nn.Parameter(torch.full((), CHAIN_UNARY_BIAS[normalizer], device=device,
                                                      dtype=chain_dtype))
        else:
            self.register_parameter("pairwise", None)
            self.register_parameter("unary_bias", None)
        if alpha == "learnable":
            self.alpha_theta = nn.Parameter(learnable_alpha_theta(alpha_init, device=device, dtype=dtype))
        elif alpha is not None:
            self.fixed_alpha = float(alpha)
        self.normalizer, self.mode, self.backend = normalizer, mode, backend

    @property
    def alpha(self):
        """The α of the normalizer: 1 (softmax), 2 (sparsemax), 1.5, the fixed α,
        or the learnable α as a 0-dim tensor; None for the structured ones."""
        if self.normalizer in STRUCTURED_NORMALIZERS or self.normalizer in CHAIN_NORMALIZERS:
            return None
        if self.alpha_theta is not None:
            return 1.0 + torch.sigmoid(self.alpha_theta)
        if self.fixed_alpha is not None:
            return self.fixed_alpha
        return {"softmax": 1.0, "sparsemax": 2.0, "entmax15": 1.5}[self.normalizer]

    @abc.abstractmethod
    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Raw scores (B, T) or (B, L, T) of query (B, Dq) or (B, L, Dq) against keys (B, T, Dk);
        each attention kind defines its own."""

    def normalize(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Weights (same shape as scores, (B, T) or (B, L, T)) from raw scores, with
        masked positions (mask False) at exactly zero."""
        if mask is not None:
            if mask.dtype != torch.bool:
                raise TypeError(f"mask must be a bool tensor (True = real position), got {mask.dtype}")
            m = mask if scores.dim() == mask.dim() else mask.unsqueeze(1)
            scores = scores.masked_fill(~m, -math.inf)
        if self.normalizer == "softmax":
            return ops.softmax(scores, dim=-1, backend=self.backend)
        if self.normalizer == "sparsemax":
            return ops.sparsemax(scores, dim=-1, backend=self.backend)
        if self.normalizer == "entmax15":
            return ops.entmax15(scores, dim=-1, backend=self.backend)
        if self.normalizer in STRUCTURED_NORMALIZERS:
            return getattr(ops, self.normalizer)(scores, dim=-1, lam=self.lam, backend=self.backend)
        if self.normalizer in CHAIN_NORMALIZERS:
            op = getattr(ops, CHAIN_NORMALIZERS[self.normalizer])
            return op(scores + self.unary_bias.to(scores.dtype), self.pairwise.to(acc_dtype(scores.dtype)), dim=-1,
                      backend=self.backend)
        alpha = self.alpha
        if isinstance(alpha, torch.Tensor):
            alpha = alpha.to(acc_dtype(scores.dtype))
            alpha = alpha.reshape([1] * scores.dim())
        return ops.entmax(scores, alpha, dim=-1, backend=self.backend)

    def _check(self, query, keys, values, mask):
        for name, t in (("query", query), ("keys", keys), ("values", values), ("mask", mask)):
            if not isinstance(t, torch.Tensor) and not (name == "mask" and t is None):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        key_dim, query_dim = getattr(self, "key_dim", None), getattr(self, "query_dim", None)
        if keys.dim() != 3 or (key_dim is not None and keys.shape[-1] != key_dim):
            raise ValueError(f"keys must be (B, T, Dk={key_dim}), got shape {tuple(keys.shape)}")
        if (query.dim() not in (2, 3) or query.shape[0] != keys.shape[0]
                or (query_dim is not None and query.shape[-1] != query_dim)):
            raise ValueError(f"query must be (B, Dq) or (B, L, Dq) with B={keys.shape[0]}, Dq={query_dim}, "
                             f"got shape {tuple(query.shape)}")
        if values.dim() != 3 or values.shape[:2] != keys.shape[:2]:
            raise ValueError(f"values must be (B, T, Dv) with (B, T)={tuple(keys.shape[:2])}, "
                             f"got shape {tuple(values.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(keys.shape[:2]):
            raise ValueError(f"mask must be (B, T)={tuple(keys.shape[:2])}, got shape {tuple(mask.shape)}")

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, weights: torch.Tensor | None = None):
        """Returns (context (B, Dv) or (B, L, Dv), weights (B, T) or (B, L, T))."""
        values = keys if values is None else values
        self._check(query, keys, values, mask)
        out_shape = (keys.shape[0], keys.shape[1]) if query.dim() == 2 else (*query.shape[:2], keys.shape[1])
        if weights is not None:
            if tuple(weights.shape) != out_shape:
                raise ValueError(f"weights must have shape {out_shape}, got {tuple(weights.shape)}")
        elif self.mode == "fixed":
            raise ValueError("mode='fixed' needs the weights: forward(..., weights=...)")
        elif self.mode == "uniform":
            m = mask if mask is not None else torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
            weights = uniform_weights(m, out_shape, keys.dtype)
        else:
            weights = self.normalize(self.scores(query, keys), mask)
        if query.dim() == 2:
            context = torch.bmm(weights.unsqueeze(1), values).squeeze(1)
        else:
            context = torch.bmm(weights, values)
        return context, weights

    def extra_repr(self) -> str:
        a = ", alpha=learnable" if self.alpha_theta is not None else (
            f", alpha={self.fixed_alpha}" if self.fixed_alpha is not None else "")
        if self.lam is not None:
            a = f", lam={self.lam}"
        return f"normalizer={self.normalizer}{a}, mode={self.mode}, backend={self.backend}"


def _dot(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if query.dim() == 2:
        return torch.bmm(keys, query.unsqueeze(-1)).squeeze(-1)
    return torch.bmm(query, keys.transpose(1, 2))


class LuongAttention(RNNAttention):
    """Luong et al. (2015) attention: score(q, k) = q·k ("dot", needs Dq == Dk) or
    q·W k ("general", W of shape (Dq, Dk))."""

    def __init__(self, query_dim: int, key_dim: int, kind: str = "general", *, device=None, dtype=None, **kwargs):
        super().__init__(device=device, dtype=dtype, **kwargs)
        _positive_int(query_dim, "query_dim")
        _positive_int(key_dim, "key_dim")
        if kind not in ("dot", "general"):
            raise ValueError(f"kind must be 'dot' or 'general', got {kind!r}")
        if kind == "dot" and query_dim != key_dim:
            raise ValueError(f"kind='dot' needs query_dim == key_dim, got {query_dim} and {key_dim}")
        self.kind, self.query_dim, self.key_dim = kind, query_dim, key_dim
        self.W = nn.Linear(key_dim, query_dim, bias=False, device=device, dtype=dtype) if kind == "general" else None

    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return _dot(query, keys if self.W is None else self.W(keys))


class ScaledDotAttention(RNNAttention):
    """score(q, k) = q·k / sqrt(Dk) (Vaswani et al., 2017); needs Dq == Dk."""

    def __init__(self, query_dim: int, key_dim: int, **kwargs):
        super().__init__(**kwargs)
        _positive_int(query_dim, "query_dim")
        _positive_int(key_dim, "key_dim")
        if query_dim != key_dim:
            raise ValueError(f"ScaledDotAttention needs query_dim == key_dim, got {query_dim} and {key_dim}")
        self.query_dim, self.key_dim = query_dim, key_dim

    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return _dot(query, keys) / math.sqrt(self.key_dim)


class AdditiveAttention(RNNAttention):
    """Bahdanau et al. (2015) attention: score(q, k) = v·tanh(W k + U q), with W
    (hidden, Dk), U (hidden, Dq) and v (hidden)."""

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int, *, device=None, dtype=None, **kwargs):
        super().__init__(device=device, dtype=dtype, **kwargs)
        _positive_int(query_dim, "query_dim")
        _positive_int(key_dim, "key_dim")
        _positive_int(hidden_dim, "hidden_dim")
        self.query_dim, self.key_dim, self.hidden_dim = query_dim, key_dim, hidden_dim
        factory = {"device": device, "dtype": dtype}
        self.W = nn.Linear(key_dim, hidden_dim, bias=True, **factory)
        self.U = nn.Linear(query_dim, hidden_dim, bias=False, **factory)
        self.v = nn.Linear(hidden_dim, 1, bias=False, **factory)

    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        k = self.W(keys)  # (B, T, H)
        q = self.U(query)
        if query.dim() == 2:
            return self.v(torch.tanh(k + q.unsqueeze(1))).squeeze(-1)
        return self.v(torch.tanh(k.unsqueeze(1) + q.unsqueeze(2))).squeeze(-1)  # (B, L, T)
