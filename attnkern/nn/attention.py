"""Multi-head attention with softmax, sparsemax, entmax15, α-entmax, fusedmax or
oscarmax weights, a drop-in for torch.nn.MultiheadAttention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnkern.attention import _check_window, attention
from attnkern.family import acc_dtype
from attnkern.nn.normalizers import EntmaxAlpha
from attnkern.validation import check_mask_dtype, check_module_lam


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """torch.nn.MultiheadAttention's mask convention (bool True = may NOT
    attend; float added) as a float mask to add to the scores."""
    if mask is None:
        return None
    check_mask_dtype(mask, name)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -math.inf)
    return mask.to(dtype)


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention with a choice of normalizer.

    Same constructor and forward arguments, parameter names and state_dict
    keys as torch's module (so weights load either way), plus:
      normalizer: "softmax" (default; matches torch's module), "sparsemax",
        "entmax15", "entmax", or the structured "fusedmax" and "oscarmax"
        (attnkern.attention's; adjacent means adjacent keys).
      alpha ("entmax" only): a float (fixed α for every head) or "learnable":
        one α per head, α = 1 + sigmoid(θ) ∈ (1, 2), initialized at
        `alpha_init` (as attnkern.nn.EntmaxAlpha; θ follows device and dtype,
        but stays float32 for float16 and bfloat16).
      lam ("fusedmax", "oscarmax" only): a float >= 0 (fixed λ for every
        head; default 1.0) or "learnable": one λ = exp(ρ) > 0 per head,
        initialized at `lam_init` (ρ float32 for float16 and bfloat16).
      backend: passed to attnkern.attention.
      window: (left, right) keys around each query's position, as
        attnkern.attention's (bottom-right alignment; -1 unbounded), computed
        without materializing a mask; None: every key.
    Shapes: query (L, N, E) or (N, L, E) with batch_first, or unbatched (L, E).
    need_weights=True returns the attention weights (averaged over heads when
    average_attn_weights), which materializes them; pass need_weights=False for
    the fused kernels.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None, *,
                 normalizer: str = "softmax", alpha=None, alpha_init: float = 1.5, backend: str = "auto",
                 window=None, lam=None, lam_init: float = 1.0):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got {embed_dim} and {num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        lam = check_module_lam(normalizer, alpha, lam, learnable=True)
        if lam == "learnable" and not (math.isfinite(lam_init) and lam_init > 0):
            raise ValueError(f"lam_init must be a finite float > 0, got {lam_init!r}")
        window = _check_window(window)
        if window is not None and (add_bias_kv or add_zero_attn):
            raise ValueError("window cannot be combined with add_bias_kv or add_zero_attn: the keys they append "
                             "would move the window's bottom-right alignment")
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.normalizer, self.backend, self.window = normalizer, backend, window
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        if alpha == "learnable":
            self.entmax_alpha = EntmaxAlpha(num_heads, alpha_init, **factory)
            self.fixed_alpha = None
        else:
            self.entmax_alpha = None
            self.fixed_alpha = None if alpha is None else float(alpha)
        # λ = exp(ρ) per head when learnable (ρ in float32 for the half types, as θ).
        self.lam_init = float(lam_init)
        if lam == "learnable":
            self.lam_log = nn.Parameter(torch.empty(num_heads, device=device, dtype=acc_dtype(
                dtype if dtype is not None else torch.get_default_dtype())))
            self.fixed_lam = None
        else:
            self.register_parameter("lam_log", None)
            self.fixed_lam = None if lam is None else float(lam)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # As torch.nn.MultiheadAttention.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        if self.entmax_alpha is not None:
            self.entmax_alpha.reset_parameters()
        if self.lam_log is not None:
            nn.init.constant_(self.lam_log, math.log(self.lam_init))

    @property
    def alpha(self):
        """α per head (a tensor) when learnable, the fixed float, or None."""
        return self.entmax_alpha.alpha if self.entmax_alpha is not None else self.fixed_alpha

    @property
    def lam(self):
        """λ per head (a tensor) when learnable, the fixed float, or None."""
        return self.lam_log.exp() if self.lam_log is not None else self.fixed_lam

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        """query (L, N, E) [(N, L, E) if batch_first, or (L, E)], key (S, N, kdim),
        value (S, N, vdim). key_padding_mask (N, S) and attn_mask (L, S) or
        (N·heads, L, S): bool True = may not attend, float added.
        is_causal: used as the causal mask when attn_mask is None (torch takes
        it as a hint about attn_mask and requires one).
        Returns (output like query, weights (N, L, S) or (N, heads, L, S), or None)."""
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0).flatten(0, 1)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        N, L, E = query.shape
        H, hd = self.num_heads, self.head_dim
        if E != self.embed_dim:
            raise ValueError(f"query's last dim must be embed_dim={self.embed_dim}, got {E}")

        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

        mask = _additive(attn_mask, q.dtype, "attn_mask")
        if mask is not None and mask.dim() == 3:
            mask = mask.view(N, H, L, -1)
        kpm = _additive(key_padding_mask, q.dtype, "key_padding_mask")
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(N, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.expand(N, 1, E)], dim=1)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        S = k.shape[1]
        q = q.view(N, L, H, hd).transpose(1, 2)
        k = k.view(N, S, H, hd).transpose(1, 2)
        v = v.view(N, S, H, hd).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, H, 1, hd)], dim=2)
            v = torch.cat([v, v.new_zeros(N, H, 1, hd)], dim=2)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        if kpm is not None:
            kpm = kpm.view(N, 1, 1, -1)
            mask = kpm if mask is None else mask + kpm
        causal = bool(is_causal) and attn_mask is None and key_padding_mask is None
        if bool(is_causal) and attn_mask is None and key_padding_mask is not None:
            Lq, Sk = q.shape[2], k.shape[2]
            tri = torch.zeros(Lq, Sk, dtype=q.dtype, device=q.device).masked_fill_(
                ~torch.ones(Lq, Sk, dtype=torch.bool, device=q.device).tril(), -math.inf)
            mask = mask + tri

        res = attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                        is_causal=causal, normalizer=self.normalizer, alpha=self.alpha, lam=self.lam,
                        backend=self.backend,
                        return_weights=need_weights, window=self.window)
        out, weights = res if need_weights else (res, None)
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, E))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights
