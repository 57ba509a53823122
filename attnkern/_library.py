"""Fake (meta) implementations of the attnkern ops, for torch.compile and opcheck."""

from __future__ import annotations

import torch

from attnkern import _extension
from attnkern.family import acc_dtype


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _alpha_rows_like(p: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(p.shape)
    if shape:
        shape[dim] = 1
    return p.new_empty(shape, dtype=acc_dtype(p.dtype))


def _register() -> None:
    for name in ("softmax", "sparsemax", "entmax15"):

        @torch.library.register_fake(f"attnkern::{name}_fwd")
        def _fwd(x, dim):
            return _like(x)

        @torch.library.register_fake(f"attnkern::{name}_bwd")
        def _bwd(p, grad, dim):
            return _like(p)

    @torch.library.register_fake("attnkern::entmax_fwd")
    def _entmax_fwd(x, alpha, dim):
        return _like(x)

    @torch.library.register_fake("attnkern::entmax_bwd")
    def _entmax_bwd(p, grad, alpha, dim, alpha_grad):
        if alpha_grad:
            return _like(p), _alpha_rows_like(p, dim)
        return _like(p), p.new_empty((0,))

    for name in ("fusedmax", "oscarmax"):

        @torch.library.register_fake(f"attnkern::{name}_fwd")
        def _structured_fwd(x, lam, dim):
            return _like(x)

        @torch.library.register_fake(f"attnkern::{name}_bwd")
        def _structured_bwd(x, grad, lam, dim, lam_grad):
            if lam_grad:
                return _like(x), _alpha_rows_like(x, dim).to(torch.float64)
            return _like(x), x.new_empty((0,), dtype=torch.float64)

    @torch.library.register_fake("attnkern::fusedmax_fwd_segments")
    def _fusedmax_fwd_segments(x, lam, dim):
        return _like(x), torch.empty_like(x, dtype=torch.uint8, memory_format=torch.contiguous_format)

    @torch.library.register_fake("attnkern::fusedmax_bwd_segments")
    def _fusedmax_bwd_segments(segments, grad, lam, dim, lam_grad):
        if lam_grad:
            return _like(grad), _alpha_rows_like(grad, dim).to(torch.float64)
        return _like(grad), grad.new_empty((0,), dtype=torch.float64)

    @torch.library.register_fake("attnkern::oscarmax_fwd_clusters")
    def _oscarmax_fwd_clusters(x, lam, dim):
        return (_like(x), torch.empty_like(x, dtype=torch.uint8, memory_format=torch.contiguous_format),
                torch.empty_like(x, dtype=torch.int32, memory_format=torch.contiguous_format))

    @torch.library.register_fake("attnkern::oscarmax_bwd_clusters")
    def _oscarmax_bwd_clusters(flags, ranks, grad, lam, dim, lam_grad):
        if lam_grad:
            return _like(grad), _alpha_rows_like(grad, dim).to(torch.float64)
        return _like(grad), grad.new_empty((0,), dtype=torch.float64)

    for name in ("crf_marginals", "sparsemap_chain"):

        @torch.library.register_fake(f"attnkern::{name}_fwd")
        def _chain_fwd(unary, pairwise, dim):
            return _like(unary)

        @torch.library.register_fake(f"attnkern::{name}_bwd")
        def _chain_bwd(unary, grad, pairwise, dim, pairwise_grad):
            if not pairwise_grad:
                return _like(unary), unary.new_empty((0,), dtype=torch.float64)
            rows = list(unary.shape)
            if rows:
                del rows[dim]
            return _like(unary), unary.new_empty(rows + [2, 2], dtype=torch.float64)

    @torch.library.register_fake("attnkern::sparsemap_chain_active")
    def _sparsemap_chain_active(unary, pairwise, dim):
        rows = list(unary.shape)
        n = 1
        if rows:
            n = rows.pop(dim)
        k = torch.library.get_ctx().new_dynamic_size()  # the largest support: known after the solve
        return (unary.new_empty(rows + [k, n], dtype=torch.bool), unary.new_empty(rows + [k], dtype=torch.float64),
                unary.new_empty(rows, dtype=torch.int64))

    _register_compat()


def _register_compat() -> None:
    """The entmax-package compatibility ops (attnkern/compat.py, attnkern/losses.py)."""

    @torch.library.register_fake("attnkern::budget_fwd")
    def _budget_fwd(x, budget, dim):
        return _like(x)

    @torch.library.register_fake("attnkern::budget_bwd")
    def _budget_bwd(p, grad, dim, budget_grad):
        if budget_grad:
            return _like(p), _alpha_rows_like(p, dim).to(torch.float64)
        return _like(p), p.new_empty((0,), dtype=torch.float64)

    @torch.library.register_fake("attnkern::normmax_bwd")
    def _normmax_bwd(p, grad, alpha, dim):
        return _like(p)

    @torch.library.register_fake("attnkern::entmax_loss_fwd")
    def _entmax_loss_fwd(x, target, alpha):
        return x.new_empty((x.shape[0],), dtype=acc_dtype(x.dtype)), _like(x)


def _register_attention() -> None:
    @torch.library.register_fake("attnkern::attention_fwd")
    def _attention_fwd(q, k, v, mask, is_causal, scale, normalizer, alpha, dropout_p=0.0, dropout_seed=None,
                       window_left=-1, window_right=-1, key_lengths=None, row_bounds=None):
        B, H, L, _ = q.shape
        return q.new_empty((B, H, L, v.shape[-1])), q.new_empty((B, H, L), dtype=torch.float32)

    @torch.library.register_fake("attnkern::attention_bwd")
    def _attention_bwd(grad_out, q, k, v, mask, is_causal, scale, normalizer, alpha, out, shift, alpha_grad,
                       dropout_p=0.0, dropout_seed=None, window_left=-1, window_right=-1, key_lengths=None,
                       row_bounds=None):
        # (In α's dtype: float64 for a float64 α, else float32.)
        adt = torch.float64 if alpha is not None and alpha.dtype == torch.float64 else torch.float32
        dalpha = q.new_empty((q.shape[1],) if alpha_grad else (0,), dtype=adt)
        return _like(q), _like(k), _like(v), dalpha

    @torch.library.register_fake("attnkern::attention_decode_paged")
    def _attention_decode_paged(q, k_pages, v_pages, block_table, seqused_k, scale, window_left=-1,
                                window_right=-1):
        N, H, m, _ = q.shape
        return q.new_empty((N, H, m, v_pages.shape[-1])), q.new_empty((N, H, m), dtype=torch.float32)

    @torch.library.register_fake("attnkern::attention_dropout_mask")
    def _attention_dropout_mask(B, H, L, S, dropout_p, dropout_seed):
        return dropout_seed.new_empty((B, H, L, S), dtype=torch.bool)


if _extension.LOADED:
    _register()
    _register_attention()
    if torch.cuda.is_available():
        # Without compiled CUDA attention kernels, the Triton launchers serve
        # attnkern::attention_fwd/_bwd on CUDA tensors (a no-op otherwise).
        from attnkern.backends import triton as _triton_backend

        _triton_backend.register_as_cuda_impl()
