"""`python -m attnkern.info`: versions, and which backends are available here and why not."""

from __future__ import annotations

import platform
import sys

import torch

import attnkern
from attnkern import _extension


def backends() -> dict[str, tuple[bool, str]]:
    """{backend: (available, reason when not)} for cpu, cuda, triton and reference."""
    out: dict[str, tuple[bool, str]] = {}
    if _extension.LOADED:
        out["cpu"] = (True, "")
    else:
        out["cpu"] = (False, f"attnkern._C did not load: {_extension.LOAD_ERROR}")
    if not _extension.LOADED:
        out["cuda"] = (False, "attnkern._C did not load")
    elif not _extension.has_cuda_kernels():
        out["cuda"] = (False, "attnkern._C was built without the CUDA sources "
                              "(CPU-only torch, no nvcc, or ATTNKERN_SKIP_CUDA_BUILD=1)")
    elif not torch.cuda.is_available():
        out["cuda"] = (False, "CUDA kernels are compiled, but no CUDA device is visible")
    else:
        out["cuda"] = (True, "")
    from attnkern.backends import triton as triton_backend

    out["triton"] = triton_backend.available()
    out["reference"] = (True, "")
    return out


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
    lines.append("")
    lines.append("backends:")
    for name, (ok, why) in backends().items():
        lines.append(f"  {name:<10} {'available' if ok else 'unavailable: ' + why}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
