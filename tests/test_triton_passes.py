"""Cost of the Triton attention forward on a GPU, by proxy (runs under the interpreter).

- Passes over K: the sparse normalizers find the shifts by passes over the key
  blocks, each recomputing q·kᵀ; counted by the instrumented forward
  (attention.forward_pass_counts) on fixed inputs, in float32 (the
  interpreter's bfloat16 tl.dot is unreliable), against the targets: at most 8
  per query block for sparsemax and entmax15, 10 for α-entmax.
- Memory: nothing the launchers allocate grows with L·S (no per-row, per-key-block
  scratch), checked on the sizes of every allocation at two query and two key
  lengths.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnkern.testing import triton_test_device

pytest.importorskip("triton", reason="triton is not installed")

from attnkern.backends.triton import attention  # noqa: E402

# Every test here runs the Triton kernels: on a GPU, what benchmarks/gpu_check.py selects (-m gpu).
pytestmark = pytest.mark.gpu

DEVICE, _why = triton_test_device()
if DEVICE is None:
    pytest.skip(f"the Triton kernels cannot run here: {_why}", allow_module_level=True)

MAX_PASSES = {"sparsemax": 8, "entmax15": 8, "entmax": 10}


# --- passes over K ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "local"])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_passes_within_target_256(normalizer, kind):
    row = attention.pass_count_summary(normalizer, kind, 256, 256, 64, device=DEVICE)
    assert row["key_blocks"] >= 4  # several key blocks per pass: the search is really blocked
    assert 2 <= row["max_passes"] <= MAX_PASSES[normalizer], row
    assert row["mean_passes"] <= row["max_passes"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "local"])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "entmax"])
def test_passes_within_target_1024(normalizer, kind):
    # L = S = 1024; two query blocks from the middle (the problem is not
    # causal: each block makes the passes it makes in the full problem).
    row = attention.pass_count_summary(normalizer, kind, 1024, 1024, 64, query_rows=slice(448, 576),
                                       device=DEVICE)
    assert row["key_blocks"] >= 16
    assert 2 <= row["max_passes"] <= MAX_PASSES[normalizer], row
    if kind == "local" and normalizer == "sparsemax":
        # Scores peak near the diagonal: after the first pass, the search and
        # P·V read only the key blocks that may hold some row's support (a few
        # for sparsemax; entmax's wider supports reach most blocks here).
        assert row["mean_blocks"] < 0.9 * row["key_blocks"] * row["mean_passes"], row


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax"])
def test_counting_changes_nothing(normalizer):
    q, k, v = attention.pass_count_inputs("random", 70, 90, 16, H=2, seed=4, device=DEVICE)
    alpha = torch.tensor([1.5, 0.8], device=DEVICE) if normalizer == "entmax" else None
    out, shift = attention.attention_fwd(q, k, v, None, True, 0.3, normalizer, alpha)
    out_c, shift_c, passes, blocks = attention.forward_pass_counts(q, k, v, None, True, 0.3, normalizer, alpha)
    assert torch.equal(out, out_c) and torch.equal(shift, shift_c)
    assert passes.shape == blocks.shape == (1, 2, 2)  # BLOCK_M = 64 under the interpreter
    if normalizer == "softmax":
        assert (passes == 1).all()
    else:
        assert (passes >= 2).all() and (blocks >= passes).all()


def test_pass_count_inputs_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        attention.pass_count_inputs("diagonal", 8, 8, 16)


# --- memory ---------------------------------------------------------------------------

_FACTORIES = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like")


class _RecordingTorch:
    """Stands for `torch` in the launchers' module: records the element count of
    every tensor its factories make, and passes everything else through."""

    def __init__(self, log: list[int]):
        self._log = log

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args, **kwargs):
            t = attr(*args, **kwargs)
            self._log.append(t.numel())
            return t

        return factory


def _launcher_allocations(monkeypatch, normalizer, L, S):
    """Element counts of the launchers' allocations, in order, for a forward and a backward."""
    B, H, Hk, E = 1, 2, 1, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, E, generator=g, device=g.device).to(DEVICE) for h, n in ((H, L), (Hk, S), (Hk, S)))
    alpha = torch.tensor([1.5, 1.25], device=DEVICE) if normalizer == "entmax" else None
    log: list[int] = []
    with monkeypatch.context() as mp:
        mp.setattr(attention, "torch", _RecordingTorch(log))
        out, shift = attention.attention_fwd(q, k, v, None, False, 0.25, normalizer, alpha)
        attention.attention_bwd(torch.ones_like(out), q, k, v, None, False, 0.25, normalizer, alpha, out, shift,
                                normalizer == "entmax")
    return log


def _grows_with_product(sizes):
    """Per allocation, whether its size has a term in L·S: sizes maps (L, S) at
    two values of each to the lists of sizes; a + b·L + c·S has a zero mixed
    difference, any L·S term (a per-row, per-key-block buffer) does not."""
    (l1, l2), (s1, s2) = sorted({ls[0] for ls in sizes}), sorted({ls[1] for ls in sizes})
    lists = [sizes[(l1, s1)], sizes[(l1, s2)], sizes[(l2, s1)], sizes[(l2, s2)]]
    assert len({len(x) for x in lists}) == 1, "the launchers took different paths"
    return [a - b - c + d != 0 for a, b, c, d in zip(*lists, strict=True)]


def test_product_detector_flags_a_block_scratch():
    # The check itself: a B·H·L·⌈S/16⌉ buffer (the scratch this replaced) is caught.
    sizes = {(L, S): [L * 16, S * 16, 2 * L * math.ceil(S / 16)] for L in (32, 64) for S in (64, 256)}
    assert _grows_with_product(sizes) == [False, False, True]


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax"])
def test_launchers_allocate_nothing_that_grows_with_l_times_s(monkeypatch, normalizer):
    sizes = {(L, S): _launcher_allocations(monkeypatch, normalizer, L, S) for L in (32, 64) for S in (64, 256)}
    # out and shift (forward), dq, dk, dv, dalpha, ... (backward) were recorded.
    assert len(sizes[(64, 256)]) >= 6 and max(sizes[(64, 256)]) >= 2 * 64 * 16
    assert not any(_grows_with_product(sizes)), sizes
