"""Test session set-up.

Without a GPU the Triton kernels run in Triton's interpreter, which triton reads
when it is first imported: set it before any test module (or torch.compile)
imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
