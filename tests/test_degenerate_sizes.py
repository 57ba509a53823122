"""Degenerate sizes: attnkern.attention against SDPA, forward and backward,
one zero (or unit) dimension at a time.

Sizes: E = 0 (query/key head dim), Ev = 0 (value head dim), H = 0, L = 0,
S = 0, S = 1, B = 0, the others small (B=2, H=2, L=3, S=5, E=4, Ev=4); every
dtype, every normalizer (α-entmax at α = 1, 1.3 and 3, α a float or a tensor
that requires grad), and for bfloat16 / float16 each way their GEMMs run:
default, turned off (ATTNKERN_BF16_GEMM=0 / ATTNKERN_FP16_GEMM=0: float32
GEMMs) and emulated (ATTNKERN_HALF_GEMM_EMULATE=1 / =plain), the switches set
as tests/test_attention_half_gemm.py sets them (the kernels read them on
every call).

What every case expects (torch's SDPA gives the same, checked in float64 in
each test). In all of these sizes the weights do not depend on q, k or α:
  S = 1:  one key, weight 1 for every normalizer: the output is v's row, and
          dq = dk = dα = 0, dv = Σ_L dO.
  E = 0:  every score 0: uniform weights 1/S for every normalizer, the output
          is the mean of v over the keys; dq, dk empty, dv = Σ_L dO / S, dα = 0.
  S = 0:  no keys: the output is 0 (SDPA's, not NaN), dq = 0, dk and dv
          empty, dα = 0.
  Ev = 0, L = 0, B = 0, H = 0: an empty output of SDPA's shape; gradients of
          the inputs' shapes, all zero (or empty), dα = 0 of shape (H,).
Outputs and gradients: SDPA's shape, the input dtype, no NaN or inf (SDPA
has none in any case), and the float64 values above within the dtype's
tolerance (attnkern.testing.TOLERANCES).

A crash (SIGSEGV) would end the whole pytest run, so the grid first runs
once in a child process (forked per run from a fresh interpreter, restarted
after a crash); a case that crashed there fails here, with its reproduction,
instead of running in-process.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from helpers import alpha_for, make_qkv, run_python

import attnkern
from attnkern import _extension, isa
from attnkern.testing import assert_close

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason="attnkern._C did not load")

_OFF = {torch.bfloat16: "ATTNKERN_BF16_GEMM", torch.float16: "ATTNKERN_FP16_GEMM"}
_KEY = {torch.bfloat16: "bf16_gemm", torch.float16: "fp16_gemm"}
_EMULATE = "ATTNKERN_HALF_GEMM_EMULATE"

BASE = dict(B=2, H=2, L=3, S=5, E=4, Ev=4)
SIZES = {"E=0": dict(E=0), "Ev=0": dict(Ev=0), "H=0": dict(H=0), "L=0": dict(L=0), "S=0": dict(S=0),
         "S=1": dict(S=1), "B=0": dict(B=0)}
# dtype and GEMM path: "default" (no switch set), "float32_gemm" (the type's
# off switch), "emulated" / "emulated_plain" (ATTNKERN_HALF_GEMM_EMULATE=1 / plain).
_DTYPE_NAMES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
WAYS = [("float32", "default"), ("float64", "default")] + [
    (dt, way) for dt in ("bfloat16", "float16") for way in ("default", "float32_gemm", "emulated", "emulated_plain")]
# (normalizer, α, α as "float" or as a "tensor" that requires grad)
NORMS = [("softmax", None, None), ("sparsemax", None, None), ("entmax15", None, None)] + [
    ("entmax", a, kind) for a in (1.0, 1.3, 3.0) for kind in ("float", "tensor")]

SIZE_IDS = list(SIZES)
WAY_IDS = [f"{dt}-{way}" for dt, way in WAYS]
NORM_IDS = [n if a is None else f"{n}-{a}-{kind}" for n, a, kind in NORMS]
# Every case of the grid, by id: (size id, way id, normalizer id).
CASES = [(s, w, n) for s in SIZE_IDS for w in WAY_IDS for n in NORM_IDS]


def _dims(size_id):
    return dict(BASE, **SIZES[size_id])


def _gemm_env(dtype, way) -> dict[str, str | None]:
    """The GEMM switches of a way (None: unset)."""
    env = {_EMULATE: None, "ATTNKERN_BF16_GEMM": None, "ATTNKERN_FP16_GEMM": None}
    if way == "float32_gemm":
        env[_OFF[dtype]] = "0"
    elif way.startswith("emulated"):
        env[_EMULATE] = "plain" if way == "emulated_plain" else "1"
    return env


def _unpack(case):
    size_id, way_id, norm_id = case
    dt_name, way = WAYS[WAY_IDS.index(way_id)]
    return _dims(size_id), _DTYPE_NAMES[dt_name], way, NORMS[NORM_IDS.index(norm_id)]


def _run(case):
    """One call of the case, forward and backward (the output times a random
    dO, summed): (q, k, v, dO, α or None, out), the inputs holding their .grad."""
    d, dtype, _, (normalizer, a, kind) = _unpack(case)
    q, k, v, go = make_qkv(d["B"], d["H"], d["H"], d["L"], d["S"], d["E"], d["Ev"], dtype=dtype, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    alpha = alpha_for(normalizer, d["H"], values=(a,), requires_grad=True) if kind == "tensor" else a
    out = attnkern.attention(q, k, v, normalizer=normalizer, alpha=alpha)
    out.backward(go)
    return q, k, v, go, alpha if kind == "tensor" else None, out


def _repro(case) -> str:
    """A shell command that runs the case alone."""
    d, dtype, way, (normalizer, a, kind) = _unpack(case)
    env = " ".join(f"{var}={val}" for var, val in _gemm_env(dtype, way).items() if val is not None)
    shapes = [(d["B"], d["H"], d["L"], d["E"]), (d["B"], d["H"], d["S"], d["E"]), (d["B"], d["H"], d["S"], d["Ev"])]
    alpha = {None: "None", "float": repr(a), "tensor": f"torch.full(({d['H']},), {a}, requires_grad=True)"}[kind]
    code = (f"import torch, attnkern; q, k, v = (torch.randn(s, dtype={dtype}, requires_grad=True) for s in "
            f"{shapes}); attnkern.attention(q, k, v, normalizer={normalizer!r}, alpha={alpha}).sum().backward()")
    return f'{env + " " if env else ""}python -c "{code}"'


# --- the crash guard ------------------------------------------------------------------


def _guard_main():
    """(In a fresh interpreter.) Runs every case in a forked child, in order,
    and prints {case id: how the child died} for the cases that killed it;
    after a crash a new child goes on with the next case. Exceptions are left
    to the in-process tests. The parent runs no torch op, so each child starts
    without a thread pool to inherit; it imports what the first backward
    imports (sympy, ~0.4 s), which each child would import again."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    crashed = {}
    start = 0
    while start < len(CASES):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                for i in range(start, len(CASES)):
                    _, dtype, way, _ = _unpack(CASES[i])
                    for var, val in _gemm_env(dtype, way).items():
                        if val is None:
                            os.environ.pop(var, None)
                        else:
                            os.environ[var] = val
                    os.write(w, f"{i}\n".encode())
                    try:
                        _run(CASES[i])
                    except Exception:
                        pass
                os.write(w, b"done\n")
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            seen = f.read().split()
        _, status = os.waitpid(pid, 0)
        if seen and seen[-1] == "done":
            break
        if not seen:
            raise RuntimeError(f"the guard's child died before its first case (status {status})")
        last = int(seen[-1])
        how = (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        crashed["/".join(CASES[last])] = how
        start = last + 1
    print(json.dumps(crashed))


@pytest.fixture(scope="module")
def crashes():
    """{case id: how it killed the process} from the grid run in a child process."""
    if not hasattr(os, "fork"):
        return {}  # no guard: every case runs in-process
    tests = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests!r}); import test_degenerate_sizes as t; t._guard_main()"
    res = run_python(code, cwd=os.path.dirname(tests))
    assert res.returncode == 0, f"the crash guard failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- the grid -------------------------------------------------------------------------


def _expected(q, k, v, go):
    """Float64 (out, dq, dk, dv) of the degenerate sizes: uniform weights 1/S
    (S = 1: weight 1; S = 0: no weights), independent of q and k."""
    q, k, v, go = (t.detach().double() for t in (q, k, v, go))
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    w = torch.full((B, H, L, S), 1.0 / S if S else 0.0, dtype=torch.float64)
    return w @ v, torch.zeros_like(q), torch.zeros_like(k), w.transpose(-1, -2) @ go


def _sdpa(q, k, v, go):
    """SDPA's (out, dq, dk, dv) in float64."""
    xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*xs)
    out.backward(go.double())
    return (out.detach(), *(t.grad for t in xs))


@pytest.mark.parametrize("norm_id", NORM_IDS)
@pytest.mark.parametrize("way_id", WAY_IDS)
@pytest.mark.parametrize("size_id", SIZE_IDS)
def test_degenerate_size_as_sdpa(size_id, way_id, norm_id, monkeypatch, crashes):
    case = (size_id, way_id, norm_id)
    if "/".join(case) in crashes:
        pytest.fail(f"{'/'.join(case)}: the process died ({crashes['/'.join(case)]}) in the crash guard's child "
                    f"(not run here: it would end pytest). Reproduce: {_repro(case)}", pytrace=False)
    _, dtype, way, _ = _unpack(case)
    for var, val in _gemm_env(dtype, way).items():
        if val is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, val)
    if way.startswith("emulated"):
        assert isa.dispatch()[_KEY[dtype]]
    elif way == "float32_gemm":
        assert not isa.dispatch()[_KEY[dtype]]

    q, k, v, go, alpha, out = _run(case)
    expected = _expected(q, k, v, go)
    if q.shape[1] > 0:
        # The expectation is SDPA's (float64, forward and backward). (torch
        # 2.11's SDPA dies of SIGFPE with no heads; every tensor is empty there.)
        sdpa_same = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
        for name, s, e in zip(("out", "dq", "dk", "dv"), _sdpa(q, k, v, go), expected, strict=True):
            assert s.shape == e.shape
            assert_close(s, e, msg=f"SDPA's {name}")
        assert out.shape == sdpa_same.shape and out.dtype == sdpa_same.dtype
    assert out.shape == expected[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all(), out
    assert_close(out, expected[0], dtype, msg="out")
    for name, t, e in zip(("dq", "dk", "dv"), (q, k, v), expected[1:], strict=True):
        g = t.grad
        assert g is not None, f"no {name}"
        assert g.shape == t.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), (name, g)
        assert_close(g, e, dtype, msg=name)
    if alpha is not None:  # the weights do not depend on α
        g = alpha.grad
        assert g is not None, "no dα"
        assert g.shape == alpha.shape and g.dtype == alpha.dtype, (g.shape, g.dtype)
        assert torch.isfinite(g).all(), g
        assert_close(g, torch.zeros_like(g, dtype=torch.float64), dtype, msg="dα")
