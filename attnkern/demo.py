"""`make demo`: attnkern's kernels against the `entmax` package and PyTorch on this machine.

Prints a table and writes out/demo.json and out/demo.md: for each
normalizer, median forward and forward+backward times of attnkern, of the
`entmax` package and of torch.softmax, and attnkern's largest difference to
the float64 reference (values and gradients).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import attnkern
from attnkern.backends import reference


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def timings(fn, x: torch.Tensor, g: torch.Tensor, rounds: int) -> tuple[float, float]:
    def fwd():
        with torch.no_grad():
            fn(x)

    def fwdbwd():
        xx = x.detach().requires_grad_()
        fn(xx).backward(g)

    return median_ms(fwd, rounds), median_ms(fwdbwd, rounds)


def max_errors(fn, ref_fn, x: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    xk = x.detach().requires_grad_()
    pk = fn(xk)
    pk.backward(g)
    xr = x.detach().double().requires_grad_()
    pr = ref_fn(xr)
    pr.backward(g.double())
    return (pk.double() - pr).abs().max().item(), (xk.grad.double() - xr.grad).abs().max().item()


def normalizer_rows(shape, rounds: int) -> list[dict]:
    try:
        import entmax
    except ImportError:  # the package is a dev dependency
        entmax = None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen)
    soft_f, soft_fb = timings(lambda t: torch.softmax(t, -1), x, g, rounds)
    cases = [
        ("softmax", attnkern.softmax, reference.softmax, None),
        ("sparsemax", attnkern.sparsemax, reference.sparsemax, entmax and (lambda t: entmax.sparsemax(t, -1))),
        ("entmax15", attnkern.entmax15, reference.entmax15, entmax and (lambda t: entmax.entmax15(t, -1))),
        ("entmax α=1.3", lambda t: attnkern.entmax(t, 1.3), lambda t: reference.entmax(t, 1.3),
         entmax and (lambda t: entmax.entmax_bisect(t, 1.3))),
    ]
    rows = []
    for name, fn, ref_fn, pkg in cases:
        f, fb = timings(fn, x, g, rounds)
        err_p, err_g = max_errors(fn, ref_fn, x[:512], g[:512])
        row = dict(op=name, shape=list(shape), attnkern_fwd_ms=f, attnkern_fwdbwd_ms=fb,
                   vs_softmax_fwd=f / soft_f, vs_softmax_fwdbwd=fb / soft_fb,
                   max_err_p=err_p, max_err_grad=err_g, torch_softmax_fwd_ms=soft_f,
                   torch_softmax_fwdbwd_ms=soft_fb)
        if pkg is not None:
            pf, pfb = timings(pkg, x, g, max(2, rounds // 5))
            row.update(entmax_pkg_fwd_ms=pf, entmax_pkg_fwdbwd_ms=pfb, speedup_fwd=pf / f, speedup_fwdbwd=pfb / fb)
        rows.append(row)
    return rows


def attention_rows(n: int, rounds: int, heads: int = 8, dim: int = 64) -> list[dict]:
    """Fused attention (B=1, H=heads, E=dim, L=S=n, float32) against SDPA and the
    unfused path (matmul, normalizer, matmul), with attnkern's largest difference to
    the float64 reference on a shorter sequence."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(1, heads, n, dim, generator=gen) for _ in range(4))
    scale = dim ** -0.5

    def timed(fn) -> tuple[float, float]:
        def fwd():
            with torch.no_grad():
                fn(q, k, v)

        def fwdbwd():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            fn(qq, kk, vv).backward(g)

        return median_ms(fwd, rounds), median_ms(fwdbwd, rounds)

    sdpa_f, sdpa_fb = timed(F.scaled_dot_product_attention)
    unfused = {"softmax": lambda s: torch.softmax(s, -1), "sparsemax": attnkern.sparsemax,
               "entmax15": attnkern.entmax15, "entmax α=1.3": lambda s: attnkern.entmax(s, 1.3)}
    ref_norm = {"softmax": reference.softmax, "sparsemax": reference.sparsemax,
                "entmax15": reference.entmax15, "entmax α=1.3": lambda s: reference.entmax(s, 1.3)}
    rows = []
    for name in unfused:
        norm, alpha = (("entmax", 1.3) if name.startswith("entmax α") else (name, None))

        def ours(q_, k_, v_, norm=norm, alpha=alpha):
            return attnkern.attention(q_, k_, v_, normalizer=norm, alpha=alpha)

        def plain(q_, k_, v_, f=unfused[name]):
            return f((q_ @ k_.transpose(-1, -2)) * scale) @ v_

        f, fb = timed(ours)
        uf, ufb = timed(plain)
        # Accuracy on a shorter sequence against the float64 reference.
        m = min(n, 256)
        qs, ks, vs = (t[:, :, :m].detach().requires_grad_() for t in (q, k, v))
        ours(qs, ks, vs).backward(g[:, :, :m])
        q64, k64, v64 = (t[:, :, :m].double().requires_grad_() for t in (q, k, v))
        ref = ref_norm[name]((q64 @ k64.transpose(-1, -2)) * scale) @ v64
        ref.backward(g[:, :, :m].double())
        with torch.no_grad():
            out_err = (ours(qs, ks, vs).double() - ref).abs().max().item()
        grad_err = max((a.grad.double() - b.grad).abs().max().item() for a, b in ((qs, q64), (ks, k64), (vs, v64)))
        rows.append(dict(op=name, n=n, attnkern_fwd_ms=f, attnkern_fwdbwd_ms=fb, sdpa_fwd_ms=sdpa_f,
                         sdpa_fwdbwd_ms=sdpa_fb, vs_sdpa_fwd=f / sdpa_f, vs_sdpa_fwdbwd=fb / sdpa_fb,
                         unfused_fwd_ms=uf, unfused_fwdbwd_ms=ufb, max_err_out=out_err, max_err_grad=grad_err))
    return rows


def attention_markdown(rows: list[dict]) -> str:
    out = ["| normalizer | N | attnkern fwd ms | × SDPA | fwd+bwd ms | × SDPA | unfused fwd / fwd+bwd ms | "
           "max |Δout| | max |Δgrad| |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['n']} | {r['attnkern_fwd_ms']:.1f} | {r['vs_sdpa_fwd']:.2f} | "
                   f"{r['attnkern_fwdbwd_ms']:.1f} | {r['vs_sdpa_fwdbwd']:.2f} | "
                   f"{r['unfused_fwd_ms']:.1f} / {r['unfused_fwdbwd_ms']:.1f} | {r['max_err_out']:.1e} | "
                   f"{r['max_err_grad']:.1e} |")
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    out = ["| op | shape | attnkern fwd ms | × torch.softmax | fwd+bwd ms | × torch.softmax | "
           "entmax pkg fwd / fwd+bwd ms | attnkern speed-up | max |Δp| | max |Δgrad| |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pkg = (f"{r['entmax_pkg_fwd_ms']:.1f} / {r['entmax_pkg_fwdbwd_ms']:.1f}" if "entmax_pkg_fwd_ms" in r
               else "–")
        sp = f"{r['speedup_fwd']:.0f}× / {r['speedup_fwdbwd']:.0f}×" if "speedup_fwd" in r else "–"
        out.append(f"| {r['op']} | {r['shape'][0]}×{r['shape'][1]} | {r['attnkern_fwd_ms']:.2f} | "
                   f"{r['vs_softmax_fwd']:.2f} | {r['attnkern_fwdbwd_ms']:.2f} | {r['vs_softmax_fwdbwd']:.2f} | "
                   f"{pkg} | {sp} | {r['max_err_p']:.1e} | {r['max_err_grad']:.1e} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per measurement (median)")
    ap.add_argument("--out", default="out", help="folder for demo.json and demo.md")
    ap.add_argument("--attention-n", type=int, default=2048, help="sequence length of the attention comparison")
    args = ap.parse_args(argv)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"attnkern {attnkern.__version__} on {machine}; float32; medians of {args.rounds} rounds\n")
    rows = normalizer_rows((4096, 1024), args.rounds)
    md = "## Row-wise normalizers, float32 [4096, 1024]\n\n" + markdown(rows)
    print(md + "\n")
    att = attention_rows(args.attention_n, max(3, args.rounds // 3))
    att_md = (f"## Fused attention, float32, B=1 H=8 E=64 N={args.attention_n} (SDPA: "
              f"torch.nn.functional.scaled_dot_product_attention, softmax)\n\n" + attention_markdown(att))
    print(att_md)
    md = md + "\n\n" + att_md
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(dict(machine=machine, normalizers=rows, attention=att), indent=2))
    (out / "demo.md").write_text(md + "\n")
    print(f"\nwrote {out / 'demo.json'} and {out / 'demo.md'}")


if __name__ == "__main__":
    main()
