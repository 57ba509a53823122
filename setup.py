"""Builds attnkern._C, the compiled CPU (and, with a CUDA build of torch, CUDA) ops.

Everything else about the package lives in pyproject.toml.

Environment:
  ATTNKERN_SKIP_CUDA_BUILD=1   build the CPU kernels only (quick local iteration)
  ATTNKERN_CPU_ISA=avx2|none   vector instruction set of the CPU kernels
                               (default: avx2 when the build machine has it)
  TORCH_CUDA_ARCH_LIST         CUDA architectures (default "8.0;9.0")
  MAX_JOBS                     parallel compile jobs (ninja)
"""

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()


def _find_cuda_home():
    """The toolkit root. torch guesses it from the nvcc on PATH, which may be a
    bare bin folder; prefer a folder that holds the runtime headers."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime.h").exists() and (Path(c) / "bin" / "nvcc").exists():
            return c
    return None


CUDA_HOME = _find_cuda_home()
if CUDA_HOME:
    # Must be set before torch.utils.cpp_extension is imported: it reads it once.
    os.environ["CUDA_HOME"] = CUDA_HOME
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _nvidia_include_dirs():
    """cuSPARSE/cuBLAS headers that ATen's CUDA headers include. A bare toolkit
    may lack them; the nvidia-* wheels that torch depends on carry them."""
    dirs = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include"):
            d = Path(entry) / sub
            if d.is_dir():
                dirs.append(str(d))
        for d in glob.glob(str(Path(entry) / "nvidia" / "*" / "include")):
            if Path(d).is_dir() and d not in dirs:
                dirs.append(d)
    return dirs


def _cpu_isa_flags():
    isa = os.environ.get("ATTNKERN_CPU_ISA")
    if isa is None:
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            flags = ""
        isa = "avx2" if (" avx2" in flags and " fma" in flags) else "none"
    if isa == "avx2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    if isa == "none":
        return []
    raise SystemExit(f"ATTNKERN_CPU_ISA must be 'avx2' or 'none', got {isa!r}")


def _want_cuda():
    if os.environ.get("ATTNKERN_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        return False, "ATTNKERN_SKIP_CUDA_BUILD is set"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found"
    return True, ""


def extensions():
    cpu_sources = ["csrc/attnkern.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [str(ROOT / "csrc" / "include"), str(ROOT / "csrc" / "cpu")]
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno"] + _cpu_isa_flags()
    with_cuda, why = _want_cuda()
    if not with_cuda:
        print(f"attnkern: building the CPU kernels only ({why})")
        return [
            CppExtension(
                "attnkern._C",
                cpu_sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx},
                extra_link_args=["-fopenmp"],
            )
        ]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    print(f"attnkern: building CPU and CUDA kernels (CUDA_HOME={CUDA_HOME}, "
          f"arch={os.environ['TORCH_CUDA_ARCH_LIST']})")
    return [
        CUDAExtension(
            "attnkern._C",
            cpu_sources + cuda_sources,
            include_dirs=include_dirs + _nvidia_include_dirs(),
            define_macros=[("ATTNKERN_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx,
                "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"],
            },
            extra_link_args=["-fopenmp"],
        )
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
