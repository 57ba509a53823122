"""ibm1: IBM Model 1 alignments (EM on co-occurrence) against learned attention and the probe β.

The paper interprets how attention models learn to translate individual words
with IBM Model 1: EM starts from uniform alignments, learns t(o | i) from
word co-occurrence, and the alignments follow. Each run fits IBM Model 1 by
EM on the training pairs, trains a standard and a uniform-attention seq2seq
model (as `ktiw`), and measures the top-1 agreement (and Kendall τ) of the
IBM 1 alignment posteriors with the standard model's attention and with β of
the uniform model, beside a shuffled baseline. On the copy task the gold
alignment is known, so IBM 1's own alignment accuracy is reported too: on
permutations every token co-occurs with every output equally often and EM has
nothing to learn from.
"""

from __future__ import annotations

import numpy as np

from attnkern.experiments.common import (
    common_config,
    fmt_mean_std,
    markdown_end,
    md_table,
    run_sweep,
    sweep_block,
    write_dynamics_result,
)
from attnkern.experiments.dynamics import ktiw

NAME = "ibm1"
DATASETS = ktiw.DATASETS
EXTRA = ktiw.IBM1_DEFAULTS
PAPER = ("The paper's proxy: early in training (attention still uniform) the model learns word translation "
         "from co-occurrence as IBM Model 1 does, and attention then follows those translations; on the "
         "permutation copy distribution co-occurrence carries no signal (no numbers in the material we follow).")
KEYS = ("acc_standard", "ibm1_vs_attention_top1", "ibm1_vs_attention_top1_shuffled", "ibm1_vs_attention_tau",
        "ibm1_vs_beta_uniform_top1", "ibm1_vs_beta_uniform_top1_shuffled", "ibm1_vs_beta_uniform_tau")


def add_arguments(p) -> None:
    ktiw.add_arguments(p)
    p.add_argument("--em-iterations", type=int, default=10, help="EM iterations of IBM Model 1")


def run(args) -> dict:
    if args.em_iterations < 1:
        raise ValueError(f"--em-iterations must be a positive int, got {args.em_iterations}")
    extra = {**EXTRA, "ibm1_iterations": args.em_iterations}
    jobs, scale, seeds = ktiw.jobs_for(args, extra)
    sweep = run_sweep(args, ktiw.train_pair, jobs, namespace=ktiw.NAMESPACE)
    summary = ktiw.collect(args, sweep, seeds, KEYS)
    for cells in summary.values():
        for cell in cells.values():
            infos = list(cell.pop("ibm1", {}).values())
            if infos:
                cell["em_log_likelihood"] = infos[0]["log_likelihood"]
                if "alignment_token_accuracy" in infos[0]:
                    cell["ibm1_alignment_token_accuracy"] = float(np.mean([i["alignment_token_accuracy"]
                                                                           for i in infos]))
                    cell["random_alignment_token_accuracy"] = float(np.mean(
                        [i["alignment_token_accuracy_random"] for i in infos]))
    config = {**common_config(args), "datasets": list(args.datasets), "seeds": seeds, "scale": scale, **extra}
    plots = [ktiw.plot(args.out, summary, "ibm1_vs_attention_top1", "top-1 IBM1 = a(standard)",
                       f"{NAME}_vs_attention.png"),
             ktiw.plot(args.out, summary, "ibm1_vs_beta_uniform_top1", "top-1 IBM1 = β(uniform)",
                       f"{NAME}_vs_beta.png")]
    return write_dynamics_result(args, NAME, config, markdown, paper=PAPER, summary=summary, sweep=sweep_block(sweep),
                                 reading=reading(summary), plots=plots)


def reading(summary) -> str:
    parts = []
    for ds, cells in summary.items():
        for norm, c in cells.items():
            a, sh = c.get("ibm1_vs_attention_top1"), c.get("ibm1_vs_attention_top1_shuffled")
            b = c.get("ibm1_vs_beta_uniform_top1")
            if a and sh and b:
                parts.append(f"{ds}/{norm}: IBM1 = attention {a[0]:.2f}, IBM1 = β(uniform) {b[0]:.2f}, "
                             f"shuffled {sh[0]:.2f}")
        first = next(iter(cells.values()), {})
        if "ibm1_alignment_token_accuracy" in first:
            parts.append(f"{ds}: IBM1 alignment token accuracy {first['ibm1_alignment_token_accuracy']:.2f} "
                         f"(random {first['random_alignment_token_accuracy']:.2f})")
    return "; ".join(parts) + "." if parts else "No complete runs."


def markdown(result) -> str:
    cfg, s = result["config"], result["summary"]
    f = fmt_mean_std
    lines = ["# ibm1: IBM Model 1 alignments vs attention and β", "",
             f"Configuration: {'--quick' if cfg['quick'] else 'full scale'}; {cfg['ibm1_iterations']} EM iterations; "
             f"models as ktiw (hidden {cfg['scale']['hidden_dim']}, {cfg['scale']['steps']} steps, {cfg['seeds']} "
             f"seeds, backend {cfg['backend']}). Agreement at the end of training on held-out pairs, "
             "mean ± std over seeds.", ""]
    rows = []
    for ds, cells in s.items():
        for norm, c in cells.items():
            rows.append([ds, norm, f(c.get("ibm1_vs_attention_top1")), f(c.get("ibm1_vs_beta_uniform_top1")),
                         f(c.get("ibm1_vs_attention_top1_shuffled")), f(c.get("ibm1_vs_attention_tau")),
                         f(c.get("ibm1_vs_beta_uniform_tau"))])
    lines.append(md_table(["data", "normalizer", "top-1 IBM1 = a(standard)", "top-1 IBM1 = β(uniform)",
                           "shuffled IBM1", "τ(IBM1, a)", "τ(IBM1, β uniform)"], rows))
    rows = []
    for ds, cells in s.items():
        c = next(iter(cells.values()), {})
        if "ibm1_alignment_token_accuracy" in c:
            ll = c.get("em_log_likelihood", [])
            rows.append([ds, c["ibm1_alignment_token_accuracy"], c["random_alignment_token_accuracy"],
                         f"{ll[0]:.3f} → {ll[-1]:.3f}" if ll else "n/a"])
    if rows:
        lines += ["IBM Model 1 on the copy task (gold alignment known): the source token it aligns each "
                  "output to is the right one", ""]
        lines.append(md_table(["data", "IBM1 alignment token accuracy", "random position",
                               "EM log-likelihood per word (first → last iteration)"], rows))
    return markdown_end(lines, result, paper=PAPER)
