"""The CPU kernels' instruction-set copies: the runtime choice, and every copy
this CPU runs against the reference and against the other copies.

The rest of the suite runs the level chosen by default (the best one here);
this file forces each runnable level in turn."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import torch
from helpers import alpha_for, assert_close_tol, attention_mask, make_qkv, ref_attention, run_python

import attnkern
from attnkern import isa
from attnkern.backends import reference
from attnkern.testing import tolerance

pytestmark = pytest.mark.skipif(not attnkern._extension.LOADED, reason="attnkern._C did not load")

LEVELS = isa.runnable_levels() if attnkern._extension.LOADED else ()
TORCH_LEVEL = {"AVX512": "AVX512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability(), "DEFAULT")


def test_default_choice_follows_torch_capped_by_cpu_and_build():
    d = isa.dispatch()
    assert set(d) == {"active", "reason", "machine", "compiled", "bf16_gemm", "bf16_gemm_unit", "fp16_gemm",
                      "fp16_gemm_unit"}
    want = min(isa.LEVELS.index(TORCH_LEVEL), isa.LEVELS.index(d["machine"]), isa.LEVELS.index(d["compiled"]))
    assert d["active"] == isa.LEVELS[want]
    assert torch.backends.cpu.get_cpu_capability() in d["reason"]
    assert LEVELS[0] == "DEFAULT" and LEVELS[-1] == isa.LEVELS[min(isa.LEVELS.index(d["machine"]),
                                                                     isa.LEVELS.index(d["compiled"]))]


def test_level_names_agree_between_cpp_python_and_setup():
    """One list of levels: the C++ enum (exported as _C.LEVELS), attnkern.isa and
    the copies setup.py compiles (every level but the portable DEFAULT)."""
    import ast
    from pathlib import Path

    from attnkern import _C

    assert _C.LEVELS == isa.LEVELS
    tree = ast.parse((Path(__file__).resolve().parent.parent / "setup.py").read_text())
    built = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "ISA_LEVELS" for t in node.targets))
    assert ("DEFAULT", *built) == isa.LEVELS


def test_an_unknown_level_is_refused_with_the_known_ones():
    from attnkern import _C

    with pytest.raises(ValueError, match="one of DEFAULT, AVX2, AVX512"):
        _C.force_cpu_level("AVX10")


def test_default_build_carries_every_x86_level():
    if os.environ.get("ATTNKERN_CPU_ISA", "all") != "all" or not re.match(r"x86_64|amd64", os.uname().machine, re.I):
        pytest.skip("not a default x86-64 build")
    assert isa.dispatch()["compiled"] == "AVX512"


def test_aten_cpu_capability_forces_a_lower_level():
    code = "import attnkern, json; print(json.dumps(attnkern.isa.dispatch()))"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = run_python(code, env=env)
    out.check_returncode()
    d = __import__("json").loads(out.stdout)
    assert d["active"] == "DEFAULT" and "DEFAULT" in d["reason"]


def test_force_level_checks_and_restores():
    before = isa.dispatch()
    with isa.force_level("DEFAULT"):
        d = isa.dispatch()
        assert d["active"] == "DEFAULT" and d["reason"].startswith("forced")
    assert isa.dispatch() == before
    with pytest.raises(ValueError, match="level must be one of"):
        with isa.force_level("SSE9"):
            pass
    for level in isa.LEVELS[len(LEVELS):]:
        with pytest.raises(ValueError, match="cannot run|does not carry"):
            with isa.force_level(level):
                pass
        assert isa.dispatch() == before


def _run_rowwise(x, alpha):
    outs = {}
    for name, fn in (("softmax", lambda t: attnkern.softmax(t, -1)), ("sparsemax", attnkern.sparsemax),
                     ("entmax15", attnkern.entmax15),
                     ("entmax", lambda t: attnkern.entmax_bisect(t, alpha, dim=-1))):
        t = x.detach().clone().requires_grad_(True)
        y = fn(t)
        (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
        outs[name] = (y.detach(), t.grad)
    return outs


@pytest.mark.parametrize("n", [1, 97, 1025])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rowwise_every_level_matches_reference(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(13, n, generator=g, dtype=torch.float64)).to(dtype)
    x[0] = 0.5  # ties
    alpha = torch.linspace(1.05, 2.6, 13, dtype=dtype).view(13, 1)
    want = {
        "softmax": torch.softmax(x.double(), -1),
        "sparsemax": reference.sparsemax(x.double(), -1),
        "entmax15": reference.entmax15(x.double(), -1),
        "entmax": reference.entmax(x.double(), alpha.double(), -1),
    }
    # The row-wise rule; float64 at ten times it, the bound this test always had.
    scale = 10.0 if dtype == torch.float64 else 1.0
    results = {}
    for level in LEVELS:
        with isa.force_level(level):
            results[level] = _run_rowwise(x, alpha)
        for name, (y, _) in results[level].items():
            assert_close_tol(y, want[name], tolerance(dtype, "rowwise", "forward", scale=scale),
                             f"{level} {name} forward")
    for level in LEVELS[1:]:
        for name in want:
            assert_close_tol(results[level][name][1], results["DEFAULT"][name][1],
                             tolerance(dtype, "rowwise", "gradient", scale=scale),
                             f"{level} vs DEFAULT {name} gradient")


def test_rowwise_bfloat16_every_level_agrees():
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = {}
    for level in LEVELS:
        with isa.force_level(level):
            got[level] = [attnkern.sparsemax(x), attnkern.entmax15(x), attnkern.softmax(x, -1)]
    for level in LEVELS[1:]:
        for a, b in zip(got[level], got["DEFAULT"], strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tolerance(torch.bfloat16, "rowwise", "forward"))


def test_bfloat16_rounding_without_the_avx512_bf16_extension():
    """ATTNKERN_NO_AVX512_BF16=1 makes the AVX512 copy round bfloat16 rows with
    integer operations, as on CPUs without AVX512_BF16: the same values (run in
    a fresh process, since the choice is read once)."""
    code = (
        "import math, torch, attnkern\n"
        "x = (3 * torch.randn(64, 1025, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)\n"
        "x[3, 0] = math.nan\n"
        "for fn in (attnkern.sparsemax, attnkern.entmax15, lambda t: attnkern.softmax(t, -1),\n"
        "           lambda t: attnkern.entmax_bisect(t, 1.3)):\n"
        "    got, want = fn(x), fn(x.float()).to(torch.bfloat16)\n"
        "    nan = torch.isnan(want)\n"
        "    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])\n"
        "print('ok')\n")
    env = dict(os.environ, ATTNKERN_NO_AVX512_BF16="1")
    out = run_python(code, env=env)
    out.check_returncode()
    assert out.stdout.strip() == "ok"


def test_losses_and_budget_every_level_agree():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 41, generator=g, dtype=torch.float64)
    target = torch.randint(0, 41, (9,), generator=g)
    got = {}
    for level in LEVELS:
        with isa.force_level(level):
            xl = x.clone().requires_grad_(True)
            loss = attnkern.entmax15_loss(xl, target).sum() + attnkern.sparsemax_loss(xl, target).sum()
            loss = loss + (attnkern.budget_bisect(xl, 3, dim=-1) ** 2).sum()
            loss = loss + (attnkern.normmax_bisect(xl, 2.0, dim=-1) ** 2).sum()
            loss.backward()
            got[level] = (loss.detach(), xl.grad)
    for level in LEVELS[1:]:
        for a, b in zip(got[level], got["DEFAULT"], strict=True):
            # float64, as test_rowwise_every_level_matches_reference: ten times the row-wise rule.
            torch.testing.assert_close(a, b, **tolerance(torch.float64, "rowwise", "forward", scale=10.0))


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", "entmax"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "fully_masked"])
def test_attention_every_level_matches_reference(normalizer, mask_kind):
    B, H, L, S, E = 2, 4, 97, 131, 59
    q, k, v, dout = make_qkv(B, H, H, L, S, E, E, grad_out=True, seed=11)
    mask, causal = attention_mask(mask_kind, B, H, L, S)
    alpha = alpha_for(normalizer, H)
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    want = ref_attention(qd, kd, vd, mask, causal, normalizer, None if alpha is None else alpha.double())
    want_grads = torch.autograd.grad(want, (qd, kd, vd), dout.double())
    for level in LEVELS:
        with isa.force_level(level):
            ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = attnkern.attention(ql, kl, vl, mask, is_causal=causal, normalizer=normalizer, alpha=alpha,
                                     backend="cpu")
            grads = torch.autograd.grad(out, (ql, kl, vl), dout)
        assert_close_tol(out, want, tolerance(torch.float32, "attention", "forward"), f"{level} {normalizer} output")
        for name, a, b in zip("qkv", grads, want_grads, strict=True):
            assert_close_tol(a, b, tolerance(torch.float32, "attention", "gradient"), f"{level} {normalizer} d{name}")


def test_attention_dropout_every_level_identical():
    q, k, v = make_qkv(1, 2, 2, 33, 70, 16, 16, seed=2)
    got = {}
    for level in LEVELS:
        with isa.force_level(level):
            torch.manual_seed(0)
            got[level] = attnkern.attention(q, k, v, dropout_p=0.3, normalizer="sparsemax", backend="cpu")
    for level in LEVELS[1:]:
        # The same computation at each level: agreement to rounding, tighter than the reference rule.
        torch.testing.assert_close(got[level], got["DEFAULT"], atol=2e-6, rtol=1e-5)


def _functions_using(disassembly: str, pattern: re.Pattern) -> set[str]:
    found, current = set(), None
    for line in disassembly.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            current = head.group(1)
        elif current is not None and pattern.search(line):
            found.add(current)
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_no_copy_leaks_its_instructions_into_shared_code():
    """A function outside a level's namespace may be called on any CPU: it must
    not use AVX2 (ymm) or AVX-512 (zmm, mask registers) instructions. This is
    what keeps the AVX512 copy linked into a library that loads on any x86."""
    if not re.match(r"x86_64|amd64", os.uname().machine, re.I):
        pytest.skip("x86-64 only")
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", attnkern._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    avx512 = _functions_using(dis, re.compile(r"%zmm|%k[1-7]\b|\{1to\d+\}"))
    avx = _functions_using(dis, re.compile(r"%ymm|\bvfmadd|\bvpermps|\bvpbroadcast"))
    assert avx512, "found no AVX-512 code at all: is the AVX512 copy built?"

    def in_level(name: str, level: str) -> bool:
        # demangled (attnkern::cpu::AVX2::...), or mangled where c++filt gave up
        # (OpenMP's outlined "..._omp_fn.0" bodies: ...3cpu4AVX2...)
        return f"::{level}::" in name or f"{len(level)}{level}" in name

    assert not [f for f in avx512 if not in_level(f, "AVX512")]
    assert not [f for f in avx if not in_level(f, "AVX2") and not in_level(f, "AVX512")]
