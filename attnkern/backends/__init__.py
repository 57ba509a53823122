"""Backends: reference (pure PyTorch oracle) and triton (fused attention kernels)."""
