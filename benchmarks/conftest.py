"""Shared helpers for the pytest-benchmark suites."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def steady_heap() -> bool:
    """Makes glibc's malloc keep freed memory (no trimming, no mmap per large
    block), as a long-running training process sees it. With the default
    dynamic thresholds, whether a 16 MB tensor comes back as fresh pages (a
    page fault every 4 KiB) depends on what was allocated and freed before, so
    the same op measured 8 ms or 28 ms (torch.softmax forward and backward at
    [4096, 1024]) depending on the case before it. Applies to both contenders
    alike; returns False (changing nothing) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_trim_threshold, 2**31 - 1)) and bool(mallopt(m_mmap_max, 0))


steady_heap()


def record(benchmark, *, group: str, op: str, provider: str, mode: str, shape: str, baseline: bool, **extra):
    """Stores what benchmarks/report.py reads about a timed benchmark: its
    group, op, provider, mode and shape, and whether it is the baseline of its
    (group, shape, mode); `extra` adds case-specific numbers."""
    benchmark.extra_info.update(group=group, op=op, provider=provider, mode=mode, shape=shape, baseline=baseline,
                                **extra)


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
