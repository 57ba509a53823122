"""Helpers shared by the attention test files: inputs, masks, α per head (and
per row), the float64 oracle with α per head, gradients of a function in its
inputs, assert_close with a tolerance dict, backend skips and a `python -c`
subprocess runner.

No tolerance tables here: a kernel's result against the reference takes its
bound from the one rule, attnkern.testing.tolerance(dtype, op, quantity,
scale) (its TOLERANCES by "rowwise" / "attention" and "forward" /
"gradient"); a test that keeps its own literal says why. The row-wise
normalizers' helpers (score makers, assert_close, the dropout keep mask) are
in the public attnkern.testing too.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from attnkern.backends import reference
from attnkern.family import NORMALIZERS, takes_alpha

__all__ = ["NORMALIZERS", "ALPHAS", "KERNEL_ALPHAS", "make_qkv", "attention_mask", "kernel_mask", "alpha_for",
           "alpha_per_row", "ref_attention", "grads_in_marked_inputs", "grads_in_fresh_leaves", "dalpha_tol",
           "assert_close_tol", "require_backend", "run_python", "run_experiment", "train_on_keywords"]

# α per head for "entmax": exact in float32 (the kernels take α in float32),
# covering α < 1, the generic solver, α = 1.5 and 2 (exact families) and α > 2.
ALPHAS = (1.25, 0.75, 1.5, 2.0, 1.75, 2.5, 1.125, 1.0)
# The α per head of the Triton kernel tests (tests/test_triton.py).
KERNEL_ALPHAS = (1.5, 2.0, 1.25, 1.0)

def make_qkv(B, H, Hk, L, S, E, Ev, dtype=torch.float32, *, noncontig=False, seed=0, spread=1.0,
             grad_out=False, device="cpu"):
    """q (B, H, L, E), k (B, Hk, S, E), v (B, Hk, S, Ev) [and, with grad_out, an
    output gradient (B, H, L, Ev)], drawn in float64 from a CPU generator (the
    same numbers on every host) and cast to dtype on device. noncontig: stored
    as (B, seq, heads, dim) and seen as (B, heads, seq, dim), as a projection
    followed by a transpose produces."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        if noncontig:
            x = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g, dtype=torch.float64, device="cpu")
            return (spread * x).to(device=device, dtype=dtype).transpose(1, 2)
        x = torch.randn(*shape, generator=g, dtype=torch.float64, device="cpu")
        return (spread * x).to(device=device, dtype=dtype)

    qkv = rnd(B, H, L, E), rnd(B, Hk, S, E), rnd(B, Hk, S, Ev)
    return qkv + (rnd(B, H, L, Ev),) if grad_out else qkv


def attention_mask(kind, B, H, L, S, seed=1):
    """(attn_mask, is_causal) of attnkern.attention for a mask kind: none,
    causal, bool, float, key_padding, fully_masked, causal_float."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool":
        m = torch.rand(B, H, L, S, generator=g, device=g.device) > 0.3
        m[..., 0] = True
        return m, False
    if kind == "float":
        return torch.randn(1, H, L, S, generator=g, device=g.device, dtype=torch.float64).to(torch.float32), False
    if kind == "key_padding":
        lengths = torch.randint(1, S + 1, (B,), generator=g, device=g.device)
        return (torch.arange(S)[None, :] < lengths[:, None]).view(B, 1, 1, S), False
    if kind == "fully_masked":
        m = torch.rand(B, H, L, S, generator=g, device=g.device) > 0.5
        m[..., 0, :] = False  # the first query of every head sees nothing
        if L > 2:
            m[0, 0, L // 2, :] = False
        return m, False
    if kind == "causal_float":
        m = torch.randn(B, 1, 1, S, generator=g, device=g.device).clamp(-2, 2)
        return m, True
    raise ValueError(kind)


def kernel_mask(kind, B, H, L, S, dtype=torch.float32, seed=1, device="cpu"):
    """(mask, is_causal) of the raw attention launchers (float masks, -inf = not
    allowed) for a mask kind: none, causal, float, empty_rows (float with some
    rows fully masked, and causal)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    mask = torch.randn(B, 1, L, S, generator=g, dtype=torch.float64, device="cpu")
    mask = mask.masked_fill(torch.rand(B, 1, L, S, generator=g, device="cpu") < 0.25, -math.inf).to(device)
    mask[..., 0] = 0.0  # every row keeps a key...
    if kind == "empty_rows":
        mask[0, 0, L // 2] = -math.inf  # ...but these
        if B > 1:
            mask[1, 0, L - 1] = -math.inf
    return mask.to(dtype).expand(B, H, L, S), kind == "empty_rows"


def alpha_for(normalizer, H, values=ALPHAS, requires_grad=False, *, dtype=torch.float32):
    """α per head (H,) in dtype (float32 unless told) cycling through `values`
    for "entmax", else None."""
    if not takes_alpha(normalizer):
        return None
    a = torch.tensor([values[h % len(values)] for h in range(H)], dtype=dtype)
    return a.requires_grad_(requires_grad)


def alpha_per_row(values, dtype=torch.float64):
    """α per row of a (rows, n) input: `values` as a (rows, 1) tensor in dtype (float64 unless told)."""
    return torch.tensor(values, dtype=dtype).reshape(-1, 1)


def ref_attention(q, k, v, mask, causal, normalizer, alpha, scale=None, **kw):
    """reference.attention (float64, differentiable by autograd) with alpha None
    or (H,), one α per head."""
    return reference.attention(q, k, v, mask, causal, scale, normalizer=normalizer,
                               alpha=None if alpha is None else alpha.view(-1, 1, 1), **kw)


def grads_in_marked_inputs(fn, inputs, go):
    """Gradients of fn(*inputs) against go in those inputs that already require grad (None entries skipped)."""
    out = fn(*inputs)
    return torch.autograd.grad(out, [t for t in inputs if t is not None and t.requires_grad], go)


def grads_in_fresh_leaves(fn, inputs, go=None, loss=None):
    """Gradients in fresh leaf copies of all inputs: of fn's output against go, or with loss="square" of Σ out²."""
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    if loss == "square":
        return torch.autograd.grad(out.pow(2).sum(), xs)
    if loss is not None:
        raise ValueError(f"unknown loss {loss!r}")
    return torch.autograd.grad(out, xs, None if go is None else go.to(out.dtype))


def dalpha_tol(tol, rows):
    """The bound of dα, a sum over `rows` rows, from the gradient tolerance dict
    `tol` (attnkern.testing.tolerance(dtype, "attention", "gradient", ...)):
    atol times the row count, rtol at least 1e-4."""
    return dict(atol=tol["atol"] * rows, rtol=max(tol["rtol"], 1e-4))


def assert_close_tol(actual, expected, tol, what=""):
    """assert_close in float64 with tol = dict(atol=..., rtol=...), as
    attnkern.testing.tolerance returns it."""
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), **tol,
                               msg=lambda m: f"{what}: {m}")


def require_backend(backend):
    """Skips the test when `backend` ("triton") cannot run here, with the reason."""
    if backend == "triton":
        from attnkern.backends import triton as triton_backend

        ok, why = triton_backend.available()
        if not ok:
            pytest.skip(why)


def run_python(code, env=None, timeout=300, cwd=None):
    """Runs `python -c code` with this interpreter and returns the CompletedProcess (output captured as text)."""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def assert_same_with_1_and_2_threads(body):
    """Runs `body` (Python source that appends the tensors to compare to a list
    `row`; torch, attnkern and make_qkv imported) in a fresh process with 1 and
    then 2 threads, torch.manual_seed(0) before each, and asserts the results
    are bitwise equal."""
    import os
    import textwrap

    code = ("import torch, attnkern\nfrom helpers import make_qkv\nres = []\nfor n in (1, 2):\n"
            "    torch.set_num_threads(n)\n    torch.manual_seed(0)\n    row = []\n"
            + textwrap.indent(textwrap.dedent(body), "    ")
            + "\n    res.append(row)\n"
            "assert all(torch.equal(a, b) for a, b in zip(*res, strict=True)), \\\n"
            "    'results differ between 1 and 2 threads'\n"
            "print('ok')\n")
    r = run_python(code, env=dict(os.environ, PYTHONPATH=os.path.dirname(__file__)))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def run_experiment(name, out, *argv):
    """Runs `attnkern-exp NAME --out OUT ARGV...` in this process and returns its
    result JSON and markdown, after checking that it exited 0, wrote both files
    and every plot it lists, and reported no failed run."""
    import json

    from attnkern.experiments import cli

    assert cli.main([name, "--out", str(out), *argv]) == 0
    result = json.loads((out / f"{name}.json").read_text())
    md = (out / f"{name}.md").read_text()
    assert md.strip(), f"{name}.md is empty"
    for plot in result.get("plots", []):
        assert (out / plot).stat().st_size > 0, plot
    assert not result.get("sweep", {}).get("failures"), result["sweep"]["failures"]
    return result, md


def train_on_keywords(model, task, steps, batch, seed=0, lr=1e-2):
    """Adam on cross-entropy over `steps` batches of `batch` sentences of a
    data.synthetic.KeywordTask drawn from a generator seeded `seed`; returns the losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens, mask, labels, _ = task.sample(batch, gen)
        loss = torch.nn.functional.cross_entropy(model(tokens, mask).logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
