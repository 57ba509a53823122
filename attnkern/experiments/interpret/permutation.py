"""Permutation: does shuffling an instance's attention change the output? (Jain & Wallace 2019, Algorithm 2)

For every test instance, the encoder states stay fixed and the attention weights over the real tokens are permuted
100 times; the output change of each permutation is TVD(ŷ^p, ŷ), and the instance's statistic is the median over
permutations. As in the paper's Figure 6, the plot is a density: per model, of the test instances over their maximum
attention and median output change (kernel-density contours, or a 2-D histogram for few instances). With sparse
attention a permutation moves the support as well (the zeros are permuted with the rest).
"""

from __future__ import annotations

import numpy as np
import torch

from attnkern.experiments.common import md_table
from attnkern.experiments.interpret import shared
from attnkern.experiments.interpret.metrics import tvd

NAME = "permutation"
# Its metrics (Kendall τ, top-k, output change) hold for chain marginals too (--normalizers crf, sparsemap).
ACCEPTS_MARGINALS = True


def add_arguments(parser) -> None:
    shared.add_model_arguments(parser)
    parser.add_argument("--permutations", type=int, default=100, help="permutations per instance (default 100)")


def median_change(weights: torch.Tensor, relevance: torch.Tensor, bias: torch.Tensor, probs: torch.Tensor,
                  permutations: int, gen: torch.Generator) -> float:
    """Median over ``permutations`` random permutations of one instance's attention ``weights`` (n,) of the output
    change TVD(ŷ^p, ŷ), with relevance (n, C) and bias (C,) fixed."""
    n = weights.shape[0]
    perms = torch.stack([torch.randperm(n, generator=gen) for _ in range(permutations)])
    permuted = weights[perms]  # (P, n)
    out = shared.decode(permuted, relevance.unsqueeze(0).expand(permutations, -1, -1), bias)
    return float(tvd(out, probs.unsqueeze(0)).median())


def analyse(config: dict, seed: int) -> dict:
    trained = shared.trained_from_config(config)
    gen = torch.Generator().manual_seed(1000 + seed)
    per = {"pred": [], "max_attention": [], "median_change": [], "length": []}
    for enc, _ in shared.test_batches(trained, config["instances"]):
        for i in range(enc.tokens.shape[0]):
            n = shared.instance_record(per, enc, i)
            per["median_change"].append(median_change(enc.weights[i, :n], enc.relevance[i, :n], enc.bias,
                                                      enc.probs[i], config["permutations"], gen))
    return {"per_instance": per, "test_accuracy": trained.info["test_accuracy"]}


def summarize(per: dict) -> dict:
    dy = np.asarray(per["median_change"], dtype=float)
    mx = np.asarray(per["max_attention"], dtype=float)
    out = {"instances": int(dy.size), "median_change_mean": float(dy.mean()),
           "median_change_median": float(np.median(dy)), "frac_change_below_0.01": float((dy < 0.01).mean()),
           "frac_change_above_0.1": float((dy > 0.1).mean()), "max_attention_mean": float(mx.mean())}
    out["by_max_attention"] = shared.by_max_attention(mx, dy, "median_change_mean")
    return out


def _plot(merged: dict, out) -> list[str]:
    return shared.density_grid(merged, out, NAME, "max_attention", "median_change", "max attention",
                               "median output change (TVD)", "permuted attention, encoder fixed: density of instances")


def check_arguments(args) -> None:
    """ValueError naming the argument (the CLI checks before it creates the output directory)."""
    shared.check_model_arguments(args)
    if args.permutations < 1:
        raise ValueError(f"argument --permutations: must be a positive int, got {args.permutations}")


def run(args) -> dict:
    check_arguments(args)
    jobs = shared.model_jobs(args, NAME, extra={"permutations": args.permutations})
    sweep = shared.run_model_jobs(analyse, jobs, args, NAME)
    rows, merged = shared.model_rows(sweep, lambda key, per: summarize(per))
    return shared.write_result(args, NAME, sweep, markdown, permutations=args.permutations, rows=rows,
                               plots=_plot(merged, args.out))


def markdown(result: dict) -> str:
    lines = shared.markdown_head(
        "Permuting attention (Jain & Wallace 2019, Algorithm 2 and Figure 6)",
        f"Each test instance's attention is permuted {result['permutations']} times with the encoder fixed; "
        "the statistic is the median output change TVD(ŷ^p, ŷ). The paper gives no table for this test, only "
        "density plots of the median change against the maximum attention, and concludes that such "
        "counterfactual attention often leaves the output unchanged. Our plots show, per model, the density "
        "of the test instances over maximum attention (x) and median change (y): Gaussian kernel-density "
        f"contours from {shared.KDE_MIN_POINTS} instances on, a 2-D histogram below that.", result)
    body = []
    for r in result["rows"]:
        bins = shared.max_attention_cell(r["by_max_attention"], "median_change_mean")
        body.append([r["dataset"], r["encoder"], r["normalizer"], f"{r['accuracy']:.3f}",
                     f"{r['median_change_mean']:.3f}", f"{r['median_change_median']:.3f}",
                     f"{r['frac_change_below_0.01']:.2f}", f"{r['frac_change_above_0.1']:.2f}",
                     f"{r['max_attention_mean']:.2f}", bins])
    lines.append(md_table(["dataset", "encoder", "normalizer", "acc", "mean Δŷ_med", "median Δŷ_med",
                           "Δŷ_med < 0.01", "Δŷ_med > 0.1", "mean max a",
                           shared.max_attention_header("mean Δŷ_med")], body))
    return shared.markdown_tail(lines, result)
