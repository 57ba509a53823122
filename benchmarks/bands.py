"""Attention whose keys are cut to a band, a document or a cache length,
against the dense calls that would stand in for it: interleaved rounds.

    python benchmarks/bands.py --out results/bench/<cpu>/bands
    python benchmarks/bands.py --cases window --threads 2 --rounds 3

Cases (float32, H = 8, E = 64; the baseline is named in the case):
  window     sliding window (256, 0), B = 1, N = 16384, fwd+bwd, every
             normalizer, against attnkern's own causal attention at the same N
             (target 0.06), and at N = 8192 against SDPA given the window as a
             boolean mask (softmax, target 0.1; the sparse normalizers' ratio
             to the same SDPA call is reported without a target)
  packed     16 documents of lengths uniform in [64, 2048] (seed 0), causal,
             through attention_varlen, fwd+bwd, against the 16 per-document
             calls (target 1.2) and against SDPA on the padded batch with
             causality and padding as one boolean mask (softmax, target 0.3)
  decode     batch 8, a cache of 8192 with valid lengths uniform in
             [512, 8192] (seed 0), one query, cache_seqlens, against the eight
             calls on exactly-sized caches (target 0.8); H = 8 and GQA 8:2;
             and the same from a paged cache (pages of 16 keys, shuffled)
             through attention_varlen's block_table, against the
             cache_seqlens call on the contiguous cache (no target)
  blockmask  a FlexAttention BlockMask, N = 8192, B = 1: sliding window
             (256 back, causal) and 8 causal documents (lengths uniform in
             [256, 2048], seed 0, the last cut to fill 8192); forward against
             FlexAttention's compiled CPU forward given the same BlockMask
             (softmax, target 1.0; the other normalizers without a target), and
             our fwd+bwd against our forward (FlexAttention has no CPU
             backward; backward <= 2.5x forward is a ratio <= 3.5); also 64
             global keys plus that window, whose rows have gaps (no target
             against FlexAttention: attention_by_blocks gathers key blocks)
Ratios as in ratios.py (the median over rounds of attnkern's time over the
baseline's); the result file has ratios.py's format, so `make docs` renders it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from ratios import NORMALIZER_KW, interleaved, record_float32_cases

import attnkern

H, E = 8, 64
WINDOW = (256, 0)
WINDOW_N, WINDOW_SDPA_N = 16384, 8192
# Targets (issue: packed, windowed and cached attention): the largest passing ratio.
WINDOW_VS_CAUSAL, WINDOW_VS_SDPA, PACKED_VS_DOCS, PACKED_VS_SDPA, DECODE_VS_CALLS = 0.06, 0.1, 1.2, 0.3, 0.8
BLOCKMASK_N, BLOCKMASK_VS_FLEX, BLOCKMASK_FWD_BWD_VS_FWD = 8192, 1.0, 3.5
# The global keys of the BlockMask whose rows have gaps (global keys plus the window).
GLOBAL_KEYS = 64
# Keys a page of the paged decoding cache holds (vLLM's default block size).
PAGE = 16


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def fwd_bwd(fn, inputs, dout):
    def call():
        xs = [t.detach().requires_grad_(True) for t in inputs]
        fn(*xs).backward(dout)
    return call


def window_rows(rounds):
    rows = []
    q, k, v, do = (randn(1, H, WINDOW_N, E, seed=s) for s in range(4))
    for name, kw in NORMALIZER_KW.items():
        t = interleaved(fwd_bwd(lambda a, b, c, kw=kw: attnkern.attention(a, b, c, window=WINDOW, **kw), (q, k, v), do),
                        fwd_bwd(lambda a, b, c, kw=kw: attnkern.attention(a, b, c, is_causal=True, **kw), (q, k, v),
                                do), rounds)
        rows.append((f"window {WINDOW}, N = {WINDOW_N}, vs attnkern causal", name, "fwd+bwd", WINDOW_VS_CAUSAL, t))
    n = WINDOW_SDPA_N
    q, k, v, do = (t[:, :, :n].contiguous() for t in (q, k, v, do))
    i = torch.arange(n)
    band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - WINDOW[0])
    sdpa = fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=band), (q, k, v), do)
    for name, kw in NORMALIZER_KW.items():
        t = interleaved(fwd_bwd(lambda a, b, c, kw=kw: attnkern.attention(a, b, c, window=WINDOW, **kw), (q, k, v), do),
                        sdpa, max(1, rounds // 2))
        rows.append((f"window {WINDOW}, N = {n}, vs SDPA with the window as a bool mask", name, "fwd+bwd",
                     WINDOW_VS_SDPA if name == "softmax" else None, t))
    return rows


def packed_rows(rounds):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 2049, (16,), generator=g).tolist()
    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, do = (randn(total, H, E, seed=s) for s in range(4))
    rows = []
    longest = max(lengths)
    # SDPA's padded batch: (16, H, longest, E), causality and padding in one mask (SDPA refuses both together).
    pad = torch.zeros(16, longest, dtype=torch.bool)
    for d, n in enumerate(lengths):
        pad[d, :n] = True
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    mask = (causal[None] & pad[:, None, :]).unsqueeze(1)

    def padded(t):
        out = t.new_zeros(16, longest, H, E)
        for d, n in enumerate(lengths):
            out[d, :n] = t[cu[d]:cu[d + 1]]
        return out.transpose(1, 2).contiguous()

    qp, kp, vp, dop = (padded(t) for t in (q, k, v, do))
    docs = [tuple(t[cu[d]:cu[d + 1]].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, do))
            for d in range(16)]
    for name, kw in NORMALIZER_KW.items():
        ours = fwd_bwd(lambda a, b, c, kw=kw: attnkern.attention_varlen(a, b, c, cu, cu, longest, longest,
                                                                        is_causal=True, **kw), (q, k, v), do)

        def per_doc(kw=kw):
            # (Each document's own contiguous (1, H, n, E) tensors, forward and backward.)
            for qd, kd, vd, dod in docs:
                xs = [t.detach().requires_grad_(True) for t in (qd, kd, vd)]
                attnkern.attention(*xs, is_causal=True, **kw).backward(dod)

        t = interleaved(ours, per_doc, rounds)
        rows.append(("16 packed documents (64–2048), causal, vs 16 per-document calls", name, "fwd+bwd",
                     PACKED_VS_DOCS, t))
        t = interleaved(ours, fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask),
                                      (qp, kp, vp), dop), max(1, rounds // 2))
        rows.append(("16 packed documents (64–2048), causal, vs SDPA on the padded batch with one bool mask", name,
                     "fwd+bwd", PACKED_VS_SDPA if name == "softmax" else None, t))
    return rows


def decode_rows(rounds):
    rows = []
    lengths = torch.randint(512, 8193, (8,), generator=torch.Generator().manual_seed(0))
    for hk in (H, 2):
        q = randn(8, H, 1, E, seed=1)
        k, v = randn(8, hk, 8192, E, seed=2), randn(8, hk, 8192, E, seed=3)
        for name, kw in NORMALIZER_KW.items():
            def ours(kw=kw, q=q, k=k, v=v):
                with torch.no_grad():
                    attnkern.attention(q, k, v, cache_seqlens=lengths, enable_gqa=True, **kw)

            def calls(kw=kw, q=q, k=k, v=v):
                with torch.no_grad():
                    for b in range(8):
                        n = int(lengths[b])
                        attnkern.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=True, **kw)

            t = interleaved(ours, calls, rounds * 4)
            rows.append((f"decode, batch 8, cache 8192 (512–8192 valid), H {H}:{hk}, vs 8 exactly-sized calls",
                         name, "fwd", DECODE_VS_CALLS, t))
        rows.append(paged_row(q, k, v, lengths, hk, rounds))
    return rows


def paged_row(q, k, v, lengths, hk, rounds):
    """The same decoding from a paged cache (pages of PAGE keys in shuffled
    order, attention_varlen with block_table) against the cache_seqlens call
    on the contiguous cache: what reading through the page table costs."""
    pages = 8192 // PAGE
    table = torch.randperm(8 * pages, generator=torch.Generator().manual_seed(4)).view(8, pages)

    def pool(t):
        p = torch.empty(8 * pages, PAGE, hk, E)
        p[table.reshape(-1)] = t.permute(0, 2, 1, 3).reshape(8 * pages, PAGE, hk, E)
        return p

    pool_k, pool_v = pool(k), pool(v)
    q_tokens, cu = q.squeeze(2), torch.arange(9, dtype=torch.int32)

    def ours():
        with torch.no_grad():
            attnkern.attention_varlen(q_tokens, pool_k, pool_v, cu, None, seqused_k=lengths, block_table=table,
                                      enable_gqa=True)

    def contiguous():
        with torch.no_grad():
            attnkern.attention(q, k, v, cache_seqlens=lengths, enable_gqa=True)

    return (f"decode from a paged cache (pages of {PAGE}, shuffled), batch 8, H {H}:{hk}, vs cache_seqlens on "
            "the contiguous cache", "softmax", "fwd", None, interleaved(ours, contiguous, rounds * 4))


def blockmask_rows(rounds):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = BLOCKMASK_N
    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < n:
        lengths.append(min(int(torch.randint(256, 2049, (1,), generator=g)), n - sum(lengths)))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    masks = {
        f"sliding window ({WINDOW[0]} back, causal)": lambda b, h, q, kv: (q >= kv) & (q - kv <= WINDOW[0]),
        f"{len(lengths)} causal documents": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
        f"{GLOBAL_KEYS} global keys + sliding window ({WINDOW[0]} back, causal)":
            lambda b, h, q, kv: (kv < GLOBAL_KEYS) | ((q >= kv) & (q - kv <= WINDOW[0])),
    }
    gaps = {label for label in masks if "global" in label}
    q, k, v, do = (randn(1, H, n, E, seed=s) for s in range(4))
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for label, mod in masks.items():
        bm = create_block_mask(mod, None, None, n, n, device="cpu")

        def theirs(bm=bm):
            with torch.no_grad():
                flex(q, k, v, block_mask=bm)

        for name, kw in NORMALIZER_KW.items():
            def ours(kw=kw, bm=bm):
                with torch.no_grad():
                    attnkern.attention(q, k, v, bm, **kw)

            rows.append((f"BlockMask {label}, N = {n}, vs FlexAttention compiled", name, "fwd",
                         BLOCKMASK_VS_FLEX if name == "softmax" and label not in gaps else None,
                         interleaved(ours, theirs, rounds)))
            both = fwd_bwd(lambda a, b, c, kw=kw, bm=bm: attnkern.attention(a, b, c, bm, **kw), (q, k, v), do)
            rows.append((f"BlockMask {label}, N = {n}, fwd+bwd vs our fwd", name, "fwd+bwd",
                         BLOCKMASK_FWD_BWD_VS_FWD, interleaved(both, ours, rounds)))
    return rows


CASES = {"window": window_rows, "packed": packed_rows, "decode": decode_rows, "blockmask": blockmask_rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True, help="prefix of the .md and .json written")
    args = ap.parse_args()
    note = ("Ratio = attnkern's banded, packed or cached call / the baseline the case names (< 1: the banded call "
            "is faster; the \"baseline ms\" column holds the baseline's time)")

    def run_cases():
        for case in args.cases:
            yield from CASES[case](args.rounds)

    record_float32_cases("benchmarks/bands.py", note, args.threads, run_cases, Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
