"""`python -m attnkern.info`: versions, and which backends are available here and why not."""

from __future__ import annotations

import platform
import sys

import torch

import attnkern
from attnkern import _extension, isa
from attnkern.backends import registry


def backends() -> dict[str, tuple[bool, str]]:
    """{backend: (available, reason when not)} for cpu, cuda, triton and reference."""
    return registry.host()


def report() -> str:
    lines = [
        f"attnkern   {attnkern.__version__}",
        f"python     {sys.version.split()[0]} ({platform.machine()})",
        f"torch      {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}, "
        f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, threads: {torch.get_num_threads()})",
    ]
    try:
        import triton

        lines.append(f"triton     {triton.__version__}")
    except Exception as exc:
        lines.append(f"triton     not importable ({type(exc).__name__})")
    if _extension.LOADED:
        lines.append(f"extension  {attnkern._C.__file__}")
        cuda_compiled = _extension.has_cuda_kernels()
        lines.append(f"           CUDA kernels compiled: {'yes' if cuda_compiled else 'no'}")
        d = isa.dispatch()
        lines.append(f"           CPU kernels run at {d['active']} ({d['reason']}); this CPU runs up to "
                     f"{d['machine']}, this build carries up to {d['compiled']}")
        for name, key in (("bfloat16", "bf16_gemm"), ("float16", "fp16_gemm")):
            unit = d[f"{key}_unit"]
            lines.append(f"           {name} attention GEMMs: "
                         + (f"{name} on {unit} (oneDNN brgemm)" if d[key] and not unit.startswith("emulated")
                            else f"{name}, {unit}" if d[key] else unit))
    lines.append("")
    lines.append("backends:")
    for name, (ok, why) in backends().items():
        lines.append(f"  {name:<10} {'available' if ok else 'unavailable: ' + why}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
