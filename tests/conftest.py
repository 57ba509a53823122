"""Test session set-up.

Without a GPU the Triton kernels run in Triton's interpreter, which triton reads
when it is first imported: set it before any test module (or torch.compile)
imports triton.

torch.compile's on-disk kernel cache (TORCHINDUCTOR_CACHE_DIR) does not key its
compiled CPU kernels on ATEN_CPU_CAPABILITY: after a run at one level, a run at
another reuses kernels generated for the wrong vector width (torch 2.14.1,
measured here: heap corruption at AVX512 after an avx2 run, with or without
attnkern). The suite may be run at every level (docs/design.md, "Runtime instruction-set dispatch"), so each level gets
its own cache unless the caller chose one.
"""

import getpass
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(),
                 f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native') or 'native'}"),
)
