"""Builds attnkern._C, the compiled CPU (and, with a CUDA build of torch, CUDA) ops.

Everything else about the package lives in pyproject.toml.

Environment:
  ATTNKERN_SKIP_CUDA_BUILD=1   build the CPU kernels only (quick local iteration)
  ATTNKERN_CPU_ISA=all|avx2|none
                               which instruction-set copies of the CPU kernels
                               to build besides the portable DEFAULT one
                               (default all: AVX2 and AVX512; the op picks the
                               best one the CPU runs when it is called)
  TORCH_CUDA_ARCH_LIST         CUDA architectures (default "8.0;9.0")
  MAX_JOBS                     parallel compile jobs (ninja)
"""

import glob
import os
import re
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


# The instruction-set levels the CPU kernels are compiled for, beyond the
# portable DEFAULT copy (csrc/include/attnkern/cpu_kernels.h). Flags as ATen
# uses for its own AVX2 and AVX512 kernels.
ISA_LEVELS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


def _isa_levels():
    isa = os.environ.get("ATTNKERN_CPU_ISA", "all")
    levels = {"all": ["AVX2", "AVX512"], "avx2": ["AVX2"], "none": []}
    if isa not in levels:
        raise SystemExit(f"ATTNKERN_CPU_ISA must be 'all', 'avx2' or 'none', got {isa!r}")
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return []
    return levels[isa]


def _level_flags(level):
    return [f"-DCPU_CAPABILITY={level}", f"-DCPU_CAPABILITY_{level}"]


class BuildWithIsaCopies(BuildExtension):
    """Compiles the CPU kernel sources once more for every ISA level, each copy
    with its own flags into its own folder, and links the copies after the
    DEFAULT objects. The order matters: where copies share an inline function
    from a header outside the per-level namespaces, the linker keeps the first
    definition, which is then the portable one."""

    def build_extension(self, ext):
        for level in getattr(ext, "isa_levels", []):
            cxx = [f for f in ext.extra_compile_args["cxx"] if not f.startswith("-DCPU_CAPABILITY")]
            objects = self.compiler.compile(
                ext.isa_sources,
                output_dir=os.path.join(self.build_temp, f"isa-{level.lower()}"),
                macros=ext.define_macros,
                include_dirs=ext.include_dirs,
                debug=self.debug,
                extra_postargs={"cxx": cxx + ISA_LEVELS[level] + _level_flags(level), "nvcc": []},
                depends=ext.depends,
            )
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


def _want_cuda():
    if os.environ.get("ATTNKERN_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        return False, "ATTNKERN_SKIP_CUDA_BUILD is set"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found"
    return True, ""


def _with_isa_copies(ext, kernel_sources, levels):
    ext.isa_sources = kernel_sources
    ext.isa_levels = levels
    return ext


def _kernel_bundles():
    """The CPU kernel sources are compiled as the bundles in csrc/cpu/bundles
    (one translation unit each, per level); every csrc/cpu/*.cpp must be in
    exactly one of them."""
    bundles = sorted(glob.glob("csrc/cpu/bundles/*.cpp"))
    included = []
    for b in bundles:
        names = re.findall(r'^#include "\.\./(\w+\.cpp)"', Path(b).read_text(), re.M)
        included += [f"csrc/cpu/{name}" for name in names]
    sources = sorted(glob.glob("csrc/cpu/*.cpp"))
    if sorted(included) != sources:
        raise SystemExit(f"csrc/cpu/bundles must include each of {sources} once; they include {sorted(included)}")
    return bundles


def extensions():
    kernel_sources = _kernel_bundles()
    cpu_sources = ["csrc/attnkern.cpp", "csrc/dispatch/cpu_dispatch.cpp"] + kernel_sources
    include_dirs = [str(ROOT / "csrc" / "include"), str(ROOT / "csrc" / "cpu")]
    levels = _isa_levels()
    # -Werror=switch: a switch over an enum without `default:` must name every
    # enumerator (math::Family: a new family cannot fall through unhandled).
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-Werror=switch"] + _level_flags("DEFAULT")
    cxx += [f"-DATTNKERN_CPU_{level}" for level in levels]
    print(f"attnkern: CPU kernels for DEFAULT{''.join(' + ' + level for level in levels)}")
    with_cuda, why = _want_cuda()
    if not with_cuda:
        print(f"attnkern: building the CPU kernels only ({why})")
        ext = CppExtension(
            "attnkern._C",
            cpu_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
        return [_with_isa_copies(ext, kernel_sources, levels)]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    print(f"attnkern: building CPU and CUDA kernels (CUDA_HOME={CUDA_HOME}, "
          f"arch={os.environ['TORCH_CUDA_ARCH_LIST']})")
    ext = CUDAExtension(
        "attnkern._C",
        cpu_sources + cuda_sources,
        include_dirs=include_dirs + _nvidia_include_dirs(),
        define_macros=[("ATTNKERN_WITH_CUDA", "1")],
        extra_compile_args={
            "cxx": cxx,
            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler=-Werror=switch"],
        },
        extra_link_args=["-fopenmp"],
    )
    return [_with_isa_copies(ext, kernel_sources, levels)]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildWithIsaCopies.with_options(use_ninja=True)})
