"""Row-wise normalizers: attnkern vs the `entmax` package vs torch.softmax.

`make bench` runs this file and prints the ratio table (benchmarks/report.py).
Every benchmark records its group, op, provider, mode and shape in extra_info;
report.py divides each median by torch.softmax's for the same shape and mode.
"""

from __future__ import annotations

import entmax
import pytest
import torch
from conftest import record, run

import attnkern

SHAPES = [(4096, 1024), (256, 32768)]
OPS = {
    "softmax": {"attnkern": attnkern.softmax, "torch": lambda x: torch.softmax(x, -1)},
    "sparsemax": {"attnkern": attnkern.sparsemax, "entmax": lambda x: entmax.sparsemax(x, -1)},
    "entmax15": {"attnkern": attnkern.entmax15, "entmax": lambda x: entmax.entmax15(x, -1)},
    "entmax_bisect(1.3)": {
        "attnkern": lambda x: attnkern.entmax_bisect(x, 1.3),
        "entmax": lambda x: entmax.entmax_bisect(x, 1.3),
    },
    "normmax_bisect(2)": {
        "attnkern": lambda x: attnkern.normmax_bisect(x, 2.0),
        "entmax": lambda x: entmax.normmax_bisect(x, 2.0),
    },
    "normmax_bisect(1.5)": {
        "attnkern": lambda x: attnkern.normmax_bisect(x, 1.5),
        "entmax": lambda x: entmax.normmax_bisect(x, 1.5),
    },
    "budget_bisect(2)": {
        "attnkern": lambda x: attnkern.budget_bisect(x, 2.0),
        "entmax": lambda x: entmax.budget_bisect(x, 2.0),
    },
}
CASES = [(op, prov) for op, provs in OPS.items() for prov in provs]

# Losses: fn(x, target) -> per-sample losses (x.shape[0],); torch's cross-entropy
# is the group's baseline.
LOSSES = {
    "cross_entropy": {"torch": lambda x, t: torch.nn.functional.cross_entropy(x, t, reduction="none")},
    "sparsemax_loss": {"attnkern": attnkern.sparsemax_loss, "entmax": entmax.sparsemax_loss},
    "entmax15_loss": {"attnkern": attnkern.entmax15_loss, "entmax": entmax.entmax15_loss},
    "entmax_bisect_loss(1.3)": {
        "attnkern": lambda x, t: attnkern.entmax_bisect_loss(x, t, 1.3),
        "entmax": lambda x, t: entmax.entmax_bisect_loss(x, t, 1.3),
    },
    "normmax_bisect_loss(2)": {
        "attnkern": lambda x, t: attnkern.normmax_bisect_loss(x, t, 2.0),
        "entmax": lambda x, t: entmax.normmax_bisect_loss(x, t, 2.0),
    },
}
LOSS_CASES = [(op, prov) for op, provs in LOSSES.items() for prov in provs]


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op,provider", CASES, ids=[f"{o}-{p}" for o, p in CASES])
def test_normalizer(benchmark, op, provider, shape, mode):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    benchmark.group = f"normalizers {shape[0]}x{shape[1]} {mode}"
    record(benchmark, group="normalizers", op=op, provider=provider, mode=mode, shape="x".join(map(str, shape)),
           baseline=provider == "torch")
    # The entmax package sorts every row: a few rounds are enough to see it.
    rounds = 3 if provider == "entmax" else 15
    run(benchmark, OPS[op][provider], x, mode, rounds)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("shape", SHAPES[:1], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op,provider", LOSS_CASES, ids=[f"{o}-{p}" for o, p in LOSS_CASES])
def test_loss(benchmark, op, provider, shape, mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    target = torch.randint(0, shape[1], (shape[0],), generator=g)
    benchmark.group = f"losses {shape[0]}x{shape[1]} {mode}"
    record(benchmark, group="losses", op=op, provider=provider, mode=mode, shape="x".join(map(str, shape)),
           baseline=provider == "torch")
    rounds = 3 if provider == "entmax" else 15
    fn = LOSSES[op][provider]
    run(benchmark, lambda t: fn(t, target), x, mode, rounds, grad=torch.ones(shape[0]))
