"""GPU hosts, mostly by simulation (this machine has no GPU).

- `import attnkern` must not import triton: triton reads TRITON_INTERPRET once,
  when first imported, and tests/conftest.py sets it only after the package
  may have been imported. Simulated in a subprocess with torch's GPU check
  patched.
- The Triton tests make their tensors on the device the kernels run on: CUDA
  with a GPU, CPU under the interpreter. Simulated in subprocesses that import
  triton before attnkern, with and without the patched GPU check.
- The CUDA normalizer kernels (and the fusedmax and crf_marginals row kernels)
  against the CPU kernels (marked `gpu`: they run
  with `make test` on a machine with a GPU and a CUDA build, and skip here).
- Rows of 2³¹ entries or more are refused by the backward ops as by the
  forward ones (the kernels index rows with int32).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import run_python

import attnkern
from attnkern import _extension
from attnkern.testing import assert_close, make_scores, mask_some

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Makes this process look like a GPU host to attnkern (no CUDA tensor is made).
PATCH_GPU = "import torch\ntorch.cuda.is_available = lambda: True\n"


def _run(code: str, interpret: bool | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return run_python(code, env=env, cwd=ROOT)


def test_import_does_not_import_triton_on_a_gpu_host():
    res = _run(PATCH_GPU + textwrap.dedent("""
        import sys
        import attnkern
        from attnkern import _extension
        assert "triton" not in sys.modules, "import attnkern imported triton"
        if _extension.LOADED and not _extension.has_cuda_kernels():
            # The Triton launchers still serve the attention ops on CUDA tensors (imported on first use).
            assert torch._C._dispatch_has_kernel_for_dispatch_key("attnkern::attention_fwd", "CUDA")
        print("ok")
    """))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_triton_tests_use_cuda_tensors_on_a_gpu_host():
    pytest.importorskip("triton", reason="triton is not installed")
    # triton imported first, without the interpreter, on a (simulated) GPU host:
    # the Triton test module must hand its kernels CUDA tensors.
    res = _run(PATCH_GPU + textwrap.dedent("""
        import triton
        import attnkern
        import test_triton
        assert test_triton.DEVICE == "cuda", test_triton.DEVICE
        print("ok")
    """))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_triton_tests_use_cpu_tensors_under_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    res = _run(textwrap.dedent("""
        import triton
        import attnkern
        import test_triton
        assert test_triton.DEVICE == "cpu", test_triton.DEVICE
        q, k, v, do = test_triton.make_inputs(1, 2, 1, 3, 5, 16, 8)
        mask, _ = test_triton.make_mask("float", 1, 2, 3, 5)
        assert all(t.device.type == "cpu" for t in (q, k, v, do, mask))
        test_triton.check_against_reference(q, k, v, do, mask, False, 0.5, "sparsemax", None)
        print("ok")
    """), interpret=True)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# --- long rows -------------------------------------------------------------------------------------

_LONG_ROW = textwrap.dedent("""
    import resource, torch, attnkern
    # Cap the address space a little above what is mapped now: a copy of the
    # 2^31-entry row (4 GiB in float16) cannot be made.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    n = 1 << 31
    p = torch.zeros(1, dtype=torch.float16).expand(n)  # no memory: stride 0
    msgs = []
    for call in (lambda: torch.ops.attnkern.sparsemax_bwd(p, p, 0),
                 lambda: torch.ops.attnkern.softmax_bwd(p, p, 0),
                 lambda: torch.ops.attnkern.entmax_bwd(p, p, torch.tensor(1.5), 0, True)):
        try:
            call()
            msgs.append("no error")
        except Exception as exc:
            msgs.append(str(exc).splitlines()[0])
    try:
        torch.ops.attnkern.sparsemax_fwd(p, 0)
        msgs.append("no error")
    except Exception as exc:
        msgs.append(str(exc).splitlines()[0])
    print("\\n".join(msgs))
""")


@pytest.mark.skipif(not _extension.LOADED, reason="the compiled extension did not load")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and RLIMIT_AS")
def test_backward_refuses_rows_of_2_31_entries():
    res = _run(_LONG_ROW)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 4, res.stdout
    assert "rows longer than 2^31 - 1" in lines[3]  # the forward, already
    for m in lines[:3]:
        assert "rows longer than 2^31 - 1" in m, lines


# --- CUDA normalizer kernels against the CPU kernels -------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and _extension.has_cuda_kernels()),
    reason="needs a CUDA device and attnkern._C built with the CUDA sources")

FAMILIES = ["softmax", "sparsemax", "entmax15", "entmax"]


def _fwd(family, x, dim, alpha=None):
    ops = torch.ops.attnkern
    if family == "entmax":
        return ops.entmax_fwd(x, alpha, dim)
    return getattr(ops, f"{family}_fwd")(x, dim)


def _bwd(family, p, g, dim, alpha=None, alpha_grad=False):
    ops = torch.ops.attnkern
    if family == "entmax":
        return ops.entmax_bwd(p, g, alpha, dim, alpha_grad)
    return getattr(ops, f"{family}_bwd")(p, g, dim), None


def _rows_alpha(x, dim, values=(1.25, 1.5, 2.0, 3.0, 0.75, 1.0)):
    shape = list(x.shape)
    shape[dim] = 1
    n = math.prod(shape)
    a = torch.tensor([values[i % len(values)] for i in range(n)], dtype=torch.float64).reshape(shape)
    return a.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,dim", [((7, 33), -1), ((5, 1031), -1), ((3, 4, 70), 1), ((2, 40000), -1),
                                       ((6, 1), 1), ((0, 9), -1)])
def test_cuda_normalizers_match_cpu(family, dtype, shape, dim):
    x = mask_some(make_scores(shape, torch.float64, scale=2.0, seed=1), frac=0.2, full_rows=1).to(dtype)
    if x.numel() > 8:
        x.view(-1)[5] = math.nan
    g = make_scores(shape, torch.float64, seed=2).to(dtype)
    alpha = _rows_alpha(x, dim) if family == "entmax" else None
    p_cpu = _fwd(family, x, dim, alpha)
    p_gpu = _fwd(family, x.cuda(), dim, None if alpha is None else alpha.cuda())
    assert p_gpu.device.type == "cuda" and p_gpu.dtype == dtype
    assert_close(p_gpu.cpu(), p_cpu, scale=10.0)
    dx_cpu, da_cpu = _bwd(family, p_cpu, g, dim, alpha, alpha_grad=True)
    dx_gpu, da_gpu = _bwd(family, p_gpu, g.cuda(), dim, None if alpha is None else alpha.cuda(), alpha_grad=True)
    assert_close(dx_gpu.cpu(), dx_cpu, scale=10.0)
    if family == "entmax":
        assert_close(da_gpu.cpu(), da_cpu, dtype=dtype, scale=100.0)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_public_api_and_autograd(family):
    x = make_scores((4, 300), torch.float32, scale=2.0, seed=3)
    a = torch.tensor([[1.2], [1.5], [2.5], [1.0]])
    fn = {"softmax": attnkern.softmax, "sparsemax": attnkern.sparsemax, "entmax15": attnkern.entmax15,
          "entmax": lambda t: attnkern.entmax(t, a.to(t.device))}[family]
    outs = []
    for dev in ("cpu", "cuda"):
        xr = x.to(dev).requires_grad_()
        (gx,) = torch.autograd.grad((fn(xr) * torch.arange(300.0, device=dev)).sum(), xr)
        outs.append((fn(x.to(dev)).cpu(), gx.cpu()))
    assert_close(outs[1][0], outs[0][0], scale=10.0)
    assert_close(outs[1][1], outs[0][1], scale=10.0)


@gpu
@needs_cuda_kernels
def test_cuda_opcheck():
    x = make_scores((5, 17), torch.float32, seed=4).cuda()
    for family in ("softmax", "sparsemax", "entmax15"):
        torch.library.opcheck(getattr(torch.ops.attnkern, f"{family}_fwd"), (x, -1))
        p = _fwd(family, x, -1)
        torch.library.opcheck(getattr(torch.ops.attnkern, f"{family}_bwd"), (p, x, -1))
    a = torch.full((5, 1), 1.3, device="cuda")
    torch.library.opcheck(torch.ops.attnkern.entmax_fwd, (x, a, -1))
    p = _fwd("entmax", x, -1, a)
    torch.library.opcheck(torch.ops.attnkern.entmax_bwd, (p, x, a, -1, True))


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,dim", [((7, 33), -1), ((3, 1031), -1), ((3, 4, 70), 1), ((6, 1), 1), ((0, 9), -1)])
def test_cuda_fusedmax_matches_cpu(dtype, shape, dim):
    """The CUDA fusedmax row kernel (one thread per row, the CPU kernel's math)
    against the CPU kernel: values, the gradient in x and in λ per row, masked
    entries, a fully masked row and a NaN row."""
    x = mask_some(make_scores(shape, torch.float64, scale=2.0, seed=5), frac=0.2, full_rows=1).to(dtype)
    if x.numel() > 8:
        x.view(-1)[5] = math.nan
    g = make_scores(shape, torch.float64, seed=6).to(dtype)
    lam = _rows_alpha(x, dim, values=(0.0, 0.1, 0.5, 2.0)).to(torch.float64)
    ops = torch.ops.attnkern
    assert_close(ops.fusedmax_fwd(x.cuda(), lam.cuda(), dim).cpu(), ops.fusedmax_fwd(x, lam, dim), scale=10.0)
    dx_cpu, dl_cpu = ops.fusedmax_bwd(x, g, lam, dim, True)
    dx_gpu, dl_gpu = ops.fusedmax_bwd(x.cuda(), g.cuda(), lam.cuda(), dim, True)
    assert_close(dx_gpu.cpu(), dx_cpu, scale=10.0)
    assert dl_gpu.shape == dl_cpu.shape
    assert_close(dl_gpu.cpu(), dl_cpu, dtype=torch.float64, scale=100.0)


@gpu
@needs_cuda_kernels
def test_cuda_fusedmax_public_api_autograd_and_opcheck():
    x = make_scores((4, 300), torch.float32, scale=2.0, seed=7)
    lam = torch.tensor([[0.1], [0.5], [1.0], [0.0]])
    outs = []
    for dev in ("cpu", "cuda"):
        xr, lr = x.to(dev).requires_grad_(), lam.to(dev).requires_grad_()
        p = attnkern.fusedmax(xr, lam=lr)
        gx, gl = torch.autograd.grad((p * torch.arange(300.0, device=dev)).sum(), (xr, lr))
        outs.append((p.detach().cpu(), gx.cpu(), gl.cpu()))
    for a, b in zip(outs[1], outs[0], strict=True):
        assert_close(a, b, scale=10.0)
    xc, lc = x.cuda(), lam.cuda().double()
    torch.library.opcheck(torch.ops.attnkern.fusedmax_fwd, (xc, lc, -1))
    torch.library.opcheck(torch.ops.attnkern.fusedmax_bwd, (xc, xc, lc, -1, True))
    with pytest.raises(NotImplementedError, match="CPU"):
        attnkern.oscarmax(x.cuda())


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,dim", [((7, 33), -1), ((3, 1031), -1), ((3, 4, 70), 1), ((6, 1), 1), ((0, 9), -1)])
def test_cuda_crf_marginals_matches_cpu(dtype, shape, dim):
    """The CUDA crf_marginals row kernel (one thread per row, the CPU kernel's
    log-space math) against the CPU kernel: values, the gradients in unary and
    in the per-row pairwise scores, masked entries, a fully masked row, a NaN
    row and a row whose forbidden transitions leave no labeling."""
    x = mask_some(make_scores(shape, torch.float64, scale=2.0, seed=8), frac=0.2, full_rows=1).to(dtype)
    if x.numel() > 8:
        x.view(-1)[5] = math.nan
    g = make_scores(shape, torch.float64, seed=9).to(dtype)
    rows_shape = list(x.movedim(dim, -1).shape[:-1])
    w = torch.randn(rows_shape + [2, 2], generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    if w.numel() >= 8:
        w.view(-1, 2, 2)[1] = torch.tensor([[-math.inf, -math.inf], [-math.inf, -math.inf]])
    ops = torch.ops.attnkern
    assert_close(ops.crf_marginals_fwd(x.cuda(), w.cuda(), dim).cpu(), ops.crf_marginals_fwd(x, w, dim), scale=10.0)
    dx_cpu, dw_cpu = ops.crf_marginals_bwd(x, g, w, dim, True)
    dx_gpu, dw_gpu = ops.crf_marginals_bwd(x.cuda(), g.cuda(), w.cuda(), dim, True)
    assert_close(dx_gpu.cpu(), dx_cpu, scale=10.0)
    assert dw_gpu.shape == dw_cpu.shape
    assert_close(dw_gpu.cpu(), dw_cpu, dtype=torch.float64, scale=100.0)


@gpu
@needs_cuda_kernels
def test_cuda_crf_marginals_public_api_autograd_and_opcheck():
    x = make_scores((4, 300), torch.float32, scale=2.0, seed=11)
    w = torch.tensor([[0.5, -1.0], [-0.5, 1.0]])
    outs = []
    for dev in ("cpu", "cuda"):
        xr, wr = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        mu = attnkern.crf_marginals(xr, wr)
        gx, gw = torch.autograd.grad((mu * torch.arange(300.0, device=dev)).sum(), (xr, wr))
        outs.append((mu.detach().cpu(), gx.cpu(), gw.cpu()))
    for a, b in zip(outs[1], outs[0], strict=True):
        assert_close(a, b, scale=10.0)
    xc, wc = x.cuda(), w.cuda()
    torch.library.opcheck(torch.ops.attnkern.crf_marginals_fwd, (xc, wc, -1))
    torch.library.opcheck(torch.ops.attnkern.crf_marginals_bwd, (xc, xc, wc, -1, True))
    with pytest.raises(NotImplementedError, match="CPU"):
        attnkern.sparsemap_chain(x.cuda(), w.cuda())


@gpu
@needs_cuda_kernels
def test_cuda_fusedmax_attention_runs_the_row_kernel_unfused():
    """fusedmax attention on CUDA tensors: materialized scores, the CUDA row
    kernel, P·V; values and gradients (q, k, v, λ per head) as the CPU fused
    kernel's, with a window, GQA and a bool mask; oscarmax is refused."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 37, 16, generator=g)
    k, v = torch.randn(2, 2, 45, 16, generator=g), torch.randn(2, 2, 45, 8, generator=g)
    mask = torch.rand(2, 1, 37, 45, generator=g) > 0.2
    lam = torch.tensor([0.05, 0.2, 0.5, 1.0])
    outs = []
    for dev in ("cpu", "cuda"):
        xs = [t.to(dev).requires_grad_() for t in (q, k, v, lam)]
        out = attnkern.attention(xs[0], xs[1], xs[2], mask.to(dev), normalizer="fusedmax", lam=xs[3],
                                 enable_gqa=True, window=(20, 3))
        grads = torch.autograd.grad((out * torch.arange(8.0, device=dev)).sum(), xs)
        outs.append([out.detach().cpu()] + [t.cpu() for t in grads])
    for a, b in zip(outs[1], outs[0], strict=True):
        assert_close(a, b, scale=10.0)
    with pytest.raises(NotImplementedError, match="CPU kernels only"):
        attnkern.attention(q.cuda(), k.cuda(), v.cuda(), normalizer="oscarmax", enable_gqa=True)
