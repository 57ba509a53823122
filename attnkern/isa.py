"""Which instruction set the compiled CPU kernels run at, and why.

One build of attnkern carries its CPU kernels several times: a portable
DEFAULT copy and, on x86-64, an AVX2 and an AVX512 copy. Each op picks a copy
when it runs: the level PyTorch itself chose (``torch.backends.cpu.
get_cpu_capability()``, which honours the ``ATEN_CPU_CAPABILITY`` environment
variable), capped at the highest level the build carries and the CPU runs.

    >>> attnkern.isa.dispatch()["active"]
    'AVX2'
    >>> with attnkern.isa.force_level("DEFAULT"):   # tests, benchmarks
    ...     y = attnkern.sparsemax(x)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from attnkern import _extension

# The levels, lowest first: the C++ enum's (csrc/include/attnkern/cpu_kernels.h,
# exported as _C.LEVELS) and setup.py's ISA_LEVELS after DEFAULT, which
# tests/test_isa.py checks.
LEVELS = ("DEFAULT", "AVX2", "AVX512")


def dispatch() -> dict[str, str | bool]:
    """{"active", "reason", "machine", "compiled", "bf16_gemm", "bf16_gemm_unit",
    "fp16_gemm", "fp16_gemm_unit"}: the level the CPU ops run at now and why,
    the highest this CPU runs, the highest this build carries, whether
    bfloat16 / float16 attention's GEMMs run in that type (at the AVX512 level
    on CPUs with AVX512-BF16 or AMX-BF16 / with AMX-FP16, unless
    ATTNKERN_BF16_GEMM=0 / ATTNKERN_FP16_GEMM=0 or torch.backends.mkldnn is
    off; at every level with the test switch ATTNKERN_HALF_GEMM_EMULATE), and
    the unit that runs them ("AMX-BF16", "AVX512-BF16", "AMX-FP16") or why
    float32 GEMMs do ("float32: no float16 matrix unit (AMX-FP16)", ...).
    Empty when the compiled extension did not load."""
    if not _extension.LOADED:
        return {}
    from attnkern import _C

    return dict(_C.cpu_dispatch())


def runnable_levels() -> tuple[str, ...]:
    """The levels this build carries that this CPU runs, lowest first."""
    d = dispatch()
    if not d:
        return ()
    top = min(LEVELS.index(d["machine"]), LEVELS.index(d["compiled"]))
    return LEVELS[: top + 1]


@contextlib.contextmanager
def force_level(level: str) -> Iterator[None]:
    """Run the CPU ops at `level` inside the block (process-wide, not thread-local).

    ValueError if the build lacks the level or the CPU cannot run it.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if not _extension.LOADED:
        raise RuntimeError(f"attnkern._C did not load: {_extension.LOAD_ERROR}")
    from attnkern import _C

    before = dispatch()
    _C.force_cpu_level(level)
    try:
        yield
    finally:
        _C.force_cpu_level(None if not before["reason"].startswith("forced") else before["active"])
