"""Fake (meta) implementations of the attnkern ops, for torch.compile and opcheck."""

from __future__ import annotations

import torch

from attnkern import _extension


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _alpha_rows_like(p: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(p.shape)
    if shape:
        shape[dim] = 1
    acc = torch.float64 if p.dtype == torch.float64 else torch.float32
    return p.new_empty(shape, dtype=acc)


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


if _extension.LOADED:
    _register()
