"""Shared helpers for the pytest-benchmark suites."""

from __future__ import annotations

import torch


def run(benchmark, fn, x: torch.Tensor, mode: str, rounds: int, grad: torch.Tensor | None = None):
    """Times fn(x) ("fwd") or fn(x).backward(grad) ("fwdbwd"); medians come from `rounds` rounds."""
    if mode == "fwd":

        def setup():
            return (x,), {}

        def target(t):
            with torch.no_grad():
                return fn(t)

    else:
        g = grad if grad is not None else torch.randn_like(x)

        def setup():
            return (x.detach().requires_grad_(),), {}

        def target(t):
            fn(t).backward(g)

    return benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=1, iterations=1)
