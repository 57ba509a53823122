"""Packaging behaviour: the fallback when the extension does not load, attnkern.info, the demo."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from helpers import run_python

import attnkern
from attnkern import info

ROOT = Path(__file__).resolve().parents[1]

BLOCK_EXTENSION = textwrap.dedent("""
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "attnkern._C":
                raise ImportError("blocked for the test")
    sys.meta_path.insert(0, Block())
""")


def test_falls_back_to_reference_with_one_warning():
    code = BLOCK_EXTENSION + textwrap.dedent("""
        import warnings, torch
        import attnkern
        from attnkern.backends import reference
        x = torch.randn(4, 9)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            p1 = attnkern.sparsemax(x)
            p2 = attnkern.entmax(x, 1.3)
        assert torch.allclose(p1, reference.sparsemax(x))
        assert torch.allclose(p2, reference.entmax(x, 1.3))
        msgs = [str(m.message) for m in w if "attnkern" in str(m.message)]
        assert len(msgs) == 1, msgs
        from attnkern import info
        print(info.report())
    """)
    res = run_python(code)
    assert res.returncode == 0, res.stderr
    assert "blocked for the test" in res.stdout
    assert "cpu        unavailable" in res.stdout


def test_info_lists_every_backend():
    b = info.backends()
    assert set(b) == {"cpu", "cuda", "triton", "reference"}
    assert b["cpu"] == (True, "") and b["reference"] == (True, "")
    for ok, why in b.values():
        assert ok or why
    text = info.report()
    assert torch.__version__ in text and attnkern.__version__ in text


def test_info_module_runs():
    res = subprocess.run([sys.executable, "-m", "attnkern.info"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "backends:" in res.stdout


def test_demo_writes_results(tmp_path):
    from attnkern import demo

    rows = demo.normalizer_rows((64, 257), rounds=2)
    assert [r["op"] for r in rows] == ["softmax", "sparsemax", "entmax15", "entmax α=1.3"]
    for r in rows:
        assert r["max_err_p"] < 1e-5 and r["max_err_grad"] < 1e-4
        assert r["attnkern_fwd_ms"] > 0
    md = demo.markdown(rows)
    assert md.count("\n") == len(rows) + 1


def test_repository_explains_itself():
    # Pointers go to docs/algorithms.md, which is in the repository (not to a
    # document outside it); the changelog starts with the unreleased changes.
    root = Path(__file__).resolve().parents[1]
    outside = ("shared" + "/", "ALGORITHMS" + ".md")
    offenders = []
    for base in ("README.md", "CHANGELOG.md", "attnkern", "csrc", "tests", "benchmarks", "docs"):
        path = root / base
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in
                                               (".py", ".md", ".h", ".cpp", ".cu", ".cuh", ".txt", ".toml")]
        for f in files:
            text = f.read_text(encoding="utf-8", errors="replace")
            offenders += [f"{f.relative_to(root)}: {s}" for s in outside if s in text]
    assert not offenders, offenders
    algorithms = (root / "docs" / "algorithms.md").read_text(encoding="utf-8")
    for section in ("shifted form", "Backward", "gradient in α", "Fused attention", "Masks", "Numerics"):
        assert section in algorithms, section
    assert "docs/algorithms.md" in (root / "README.md").read_text(encoding="utf-8")
    assert "## Unreleased" in (root / "CHANGELOG.md").read_text(encoding="utf-8")
