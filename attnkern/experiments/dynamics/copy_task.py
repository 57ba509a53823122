"""copy: sequence copying of length 40 under the iid, permutation and subset distributions.

"Approximating How Single Head Attention Learns" (Zhong et al.) argues that an
attention model first learns to translate individual words from word
co-occurrence statistics, and that this knowledge then drives the attention.
Permutations of 40 tokens remove those statistics (every token occurs once in
every sequence), and the slides report that about half of the runs fail to
learn copying; with tokens drawn i.i.d. every run succeeds. This experiment
measures the success rate (token accuracy >= 0.9 on fresh samples at the end
of a fixed step budget) for each distribution and normalizer, and the learning
curves of token accuracy and attention accuracy (the argmax of the weights of
output step l on source position l).
"""

from __future__ import annotations

import numpy as np

from attnkern.experiments import runner
from attnkern.experiments.common import (
    cell_jobs,
    cell_results,
    common_config,
    markdown_end,
    md_table,
    pyplot,
    run_sweep,
    save_figure,
    scale_and_seeds,
    sweep_block,
    write_dynamics_result,
    write_outputs,
)
from attnkern.experiments.data.synthetic import COPY_DISTRIBUTIONS
from attnkern.experiments.dynamics.seq2seq_train import copy_config, train_copy
from attnkern.experiments.models import Seq2Seq

NAME = "copy"
# Its metrics (token accuracy, the argmax of the weights) hold for chain marginals too (--normalizers crf,
# sparsemap).
ACCEPTS_MARGINALS = True

# Step budgets: the quick one is the smallest budget (on the evaluation grid) at which softmax iid
# runs succeed in >= 90% of seeds (CALIBRATION says how it was found).
QUICK = dict(hidden_dim=64, embed_dim=64, batch=32, steps=225, eval_every=25, eval_samples=50, stop_at=0.95,
             seeds=6)
FULL = dict(hidden_dim=256, embed_dim=256, batch=128, steps=3000, eval_every=10, eval_samples=50, stop_at=0.95,
            seeds=20)
CALIBRATION = ("quick budget 225 steps: the smallest at which >= 90% of 10 softmax iid runs succeed "
               "(`attnkern-exp copy --quick --calibrate 600 --seeds 10`: 0.1 at 200 steps, 0.9 at 225, 1.0 at "
               "250); full-scale budget 3000 steps: not calibrated (a full calibration takes CPU-hours; run "
               "`attnkern-exp copy --calibrate 3000`)")

# The output layers (--output), as the markdown names them.
OUTPUT_LAYERS = {"combined": "W_o tanh(W_c [c; d]) (Luong)",
                 "context": "W_o c (the slides' simplified model: the source only through the attention)"}

# What the paper's slides report for softmax attention (no numbers for sparse normalizers).
PAPER = {"iid": "always succeeds (1.0)", "permutation": "about half fail (~0.5)",
         "subset": "not reported in the slides"}


def add_arguments(p) -> None:
    p.add_argument("--distributions", nargs="+", default=list(COPY_DISTRIBUTIONS), choices=COPY_DISTRIBUTIONS)
    p.add_argument("--steps", type=int, default=None, help="override the step budget")
    p.add_argument("--hidden", type=int, default=None, help="override the embedding/hidden size")
    p.add_argument("--batch", type=int, default=None, help="override the batch size")
    p.add_argument("--output", default="combined", choices=Seq2Seq.OUTPUTS,
                   help="the output layer: Luong's W_o tanh(W_c [c; d]) (combined, default) or W_o c (context: the "
                        "source reaches the output only through the attention, the slides' simplified model)")
    p.add_argument("--calibrate", type=int, default=None, metavar="MAX_STEPS",
                   help="instead of the sweep: train softmax iid runs for up to MAX_STEPS and report the smallest "
                        "budget (multiple of the evaluation interval) at which >= 90%% of them succeed")


def configs(args) -> tuple[dict, int]:
    # a --steps override keeps the evaluation interval: budgets are read off the evaluation grid
    scale, seeds = scale_and_seeds(args, QUICK, FULL, {"steps": ("steps",), "hidden": ("hidden_dim", "embed_dim"),
                                                       "batch": ("batch",)}, cap_eval_every=False)
    return {**scale, "output": getattr(args, "output", "combined")}, seeds


def jobs_for(args) -> tuple[list[runner.Job], dict, int]:
    scale, seeds = configs(args)
    jobs = cell_jobs(args.distributions, args.normalizers, seeds,
                     lambda dist, norm: copy_config(distribution=dist, normalizer=norm, backend=args.backend,
                                                    device=args.device, **scale))
    return jobs, scale, seeds


# The paper's own horizon (steps) for a success rate beside the survival curves.
PAPER_HORIZON = 200

# A seed's attention learned the alignment when its attention accuracy at the last evaluation of its curve is
# at least this. On permutations seeds split into near 1 and near 0: a model can copy (token accuracy counts it
# a success) with its attention off the diagonal, so the slides' "attention fails to learn" is counted apart.
ALIGNED = 0.5


def aligned_seeds(curves: dict) -> dict:
    """{distribution: {normalizer: [aligned, seeds]}} from a summary's per-seed curves: how many seeds ended
    (at their last evaluation) with attention accuracy >= ALIGNED."""
    return {dist: {norm: [sum(c["attn_acc"][-1] >= ALIGNED for c in by_seed.values()), len(by_seed)]
                   for norm, by_seed in cells.items()} for dist, cells in curves.items()}


def survival(first_steps: list, budget: int) -> dict:
    """The steps-to-success distribution of a cell's seeds as a survival curve: at each step where a seed
    first reached the threshold, the fraction of seeds that had not yet (seeds that never did are censored at
    the budget, their first step None). Steps-to-success rather than success at one budget separates "fails"
    from "learns later"."""
    n = len(first_steps)
    events = sorted(s for s in first_steps if s is not None)
    steps, not_yet = [0], [1.0]
    for i, step in enumerate(events):
        if step == steps[-1]:
            not_yet[-1] = 1.0 - (i + 1) / n
        else:
            steps.append(step)
            not_yet.append(1.0 - (i + 1) / n)
    if steps[-1] < budget:
        steps.append(budget)
        not_yet.append(not_yet[-1])
    return {"step": steps, "not_yet": not_yet, "censored": n - len(events), "seeds": n}


def summarize(args, sweep, scale, seeds) -> dict:
    success, acc, attn, first = {}, {}, {}, {}
    curves, surv, by_horizon = {}, {}, {}
    for dist in args.distributions:
        for key in (success, acc, attn, first, curves, surv, by_horizon):
            key[dist] = {}
        for norm in args.normalizers:
            by_seed = cell_results(sweep, dist, norm, seeds)
            res = list(by_seed.values())
            if not res:
                continue
            success[dist][norm] = float(np.mean([r["success"] for r in res]))
            acc[dist][norm] = float(np.mean([r["final_token_acc"] for r in res]))
            attn[dist][norm] = float(np.mean([r["final_attn_acc"] for r in res]))
            steps = [r["first_step_above_threshold"] for r in res if r["first_step_above_threshold"] is not None]
            first[dist][norm] = float(np.median(steps)) if steps else None
            curves[dist][norm] = {s: r["curve"] for s, r in by_seed.items()}
            firsts = [r["first_step_above_threshold"] for r in res]
            surv[dist][norm] = survival(firsts, scale["steps"])
            # (None where the budget stops short of the paper's horizon)
            by_horizon[dist][norm] = (float(np.mean([f is not None and f <= PAPER_HORIZON for f in firsts]))
                                      if scale["steps"] >= PAPER_HORIZON else None)
    return {"success_rate": success, "final_token_acc": acc, "final_attn_acc": attn,
            "median_first_step_above_threshold": first, "curves": curves, "survival": surv,
            "success_by_paper_horizon": by_horizon, "attention_aligned": aligned_seeds(curves),
            "runs_per_cell": seeds}


def plot(out, summary, args) -> list[str]:
    plt = pyplot()
    files = []
    dists, norms = args.distributions, args.normalizers
    for metric, label in (("token_acc", "token accuracy"), ("attn_acc", "attention accuracy")):
        fig, axes = plt.subplots(len(norms), len(dists), figsize=(4 * len(dists), 2.8 * len(norms)),
                                 squeeze=False, sharex=True, sharey=True)
        for i, norm in enumerate(norms):
            for j, dist in enumerate(dists):
                ax = axes[i][j]
                for c in summary["curves"].get(dist, {}).get(norm, {}).values():
                    ax.plot(c["step"], c[metric], lw=0.8, alpha=0.7)
                ax.set_title(f"{dist} / {norm}", fontsize=9)
                ax.set_ylim(0, 1.02)
                if i == len(norms) - 1:
                    ax.set_xlabel("step")
                if j == 0:
                    ax.set_ylabel(label)
        files.append(save_figure(fig, out, f"{NAME}_{metric}.png", dpi=90))
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(dists) * len(norms) / 2, 3))
    width = 0.8 / max(len(norms), 1)
    for k, norm in enumerate(norms):
        vals = [summary["success_rate"].get(d, {}).get(norm, np.nan) for d in dists]
        ax.bar(np.arange(len(dists)) + k * width, vals, width, label=norm)
    ax.set_xticks(np.arange(len(dists)) + width * (len(norms) - 1) / 2, dists)
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    files.append(save_figure(fig, out, f"{NAME}_success.png", dpi=90))
    fig, axes = plt.subplots(1, len(dists), figsize=(4 * len(dists), 3), squeeze=False, sharey=True)
    for j, dist in enumerate(dists):
        ax = axes[0][j]
        for norm in norms:
            sv = summary["survival"].get(dist, {}).get(norm)
            if sv:
                ax.step(sv["step"], sv["not_yet"], where="post", label=f"{norm} ({sv['censored']} censored)")
        ax.axvline(PAPER_HORIZON, color="0.6", ls=":", lw=1)
        ax.set_title(dist, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of seeds not yet at 0.9")
    return files + [save_figure(fig, out, f"{NAME}_survival.png", dpi=90)]


def markdown(result) -> str:
    s, cfg = result["summary"], result["config"]
    dists, norms = cfg["distributions"], cfg["normalizers"]
    lines = [f"# copy: sequence copying (length {cfg['scale'].get('length', 40)})", "",
             f"Configuration: {'--quick' if cfg['quick'] else 'full scale'}; hidden {cfg['scale']['hidden_dim']}, "
             f"batch {cfg['scale']['batch']}, step budget {cfg['scale']['steps']}, {cfg['seeds']} seeds per cell, "
             f"output layer {OUTPUT_LAYERS[cfg['scale'].get('output', 'combined')]}, "
             f"backend {cfg['backend']}. Success = token accuracy >= 0.9 on {cfg['scale']['final_samples']} fresh "
             "samples at the end of the budget.", "",
             "## Success rate (ours) beside the paper's (softmax)", ""]
    rows = [[d] + [s["success_rate"].get(d, {}).get(n, "n/a") for n in norms] + [PAPER[d]] for d in dists]
    lines.append(md_table(["distribution"] + norms + ["paper (softmax)"], rows))
    lines += ["## Final token accuracy / attention accuracy (mean over seeds)", ""]
    rows = [[d] + [f"{s['final_token_acc'].get(d, {}).get(n, float('nan')):.3f} / "
                   f"{s['final_attn_acc'].get(d, {}).get(n, float('nan')):.3f}" for n in norms] for d in dists]
    lines.append(md_table(["distribution"] + norms, rows))
    lines += ["## Median step at which evaluation accuracy first reached 0.9 (successful runs)", ""]
    med = s["median_first_step_above_threshold"]
    rows = [[d] + [("never" if med.get(d, {}).get(n) is None else f"{med[d][n]:.0f}") for n in norms] for d in dists]
    lines.append(md_table(["distribution"] + norms, rows))
    lines += [f"## Steps to success: seeds that reached 0.9 by the paper's {PAPER_HORIZON}-step horizon, and never "
              "(censored at the budget)", "",
              "The full distribution is the survival plot (fraction of seeds not yet at 0.9 against step).", ""]
    hz, sv = s.get("success_by_paper_horizon", {}), s.get("survival", {})
    rows = [[d] + [("–" if n not in sv.get(d, {}) else
                    f"{'n/a' if hz[d][n] is None else f'{hz[d][n]:.2f}'} / {sv[d][n]['censored']} of "
                    f"{sv[d][n]['seeds']}") for n in norms] for d in dists]
    lines.append(md_table(["distribution"] + [f"{n}: by {PAPER_HORIZON} / never" for n in norms], rows))
    lines += [f"## Seeds whose attention learned the alignment (attention accuracy >= {ALIGNED} at the last "
              "evaluation)", "",
              "A seed can copy with its attention off the diagonal; the slides' failures are of the attention.", ""]
    al = s.get("attention_aligned", {})
    rows = [[d] + [("–" if n not in al.get(d, {}) else f"{al[d][n][0]} of {al[d][n][1]}") for n in norms]
            for d in dists]
    lines.append(md_table(["distribution"] + norms, rows))
    return markdown_end(lines, result, notes=[f"Budget: {CALIBRATION}."])


def reading(summary, dists, norms) -> str:
    sr = summary["success_rate"]
    parts = []
    if "iid" in sr and "permutation" in sr:
        for n in norms:
            a, b = sr["iid"].get(n), sr["permutation"].get(n)
            if a is None or b is None:
                continue
            rel = "more often than" if a > b else ("as often as" if a == b else "less often than")
            parts.append(f"{n}: iid succeeds {rel} permutation ({a:.2f} vs {b:.2f})")
    sparse = [n for n in norms if n != "softmax"]
    if "softmax" in norms and sparse and "permutation" in sr:
        diffs = [f"{n} {sr['permutation'].get(n, float('nan')):.2f}" for n in sparse]
        parts.append(f"on permutations, softmax {sr['permutation'].get('softmax', float('nan')):.2f} vs "
                     + ", ".join(diffs))
    return "; ".join(parts) + "." if parts else "No complete cells."


def budget_success(curve: dict, budget: int, threshold: float, stop_at: float | None) -> bool:
    """Whether a run would have succeeded with this step budget, read from its evaluation curve
    (the last evaluation at or before the budget; a run stopped early stays a success)."""
    steps, acc = curve["step"], curve["token_acc"]
    seen = [a for s, a in zip(steps, acc, strict=True) if s <= budget]
    if not seen:
        return False
    if stop_at is not None and steps[-1] <= budget and acc[-1] >= stop_at:
        return True
    return seen[-1] >= threshold


def calibrate(args) -> dict:
    scale, seeds = configs(args)
    scale["steps"] = args.calibrate
    cfg = copy_config(distribution="iid", normalizer="softmax", backend=args.backend, device=args.device, **scale)
    jobs = [runner.Job(f"calibrate/iid/softmax/seed{s}", cfg, s) for s in range(seeds)]
    sweep = run_sweep(args, train_copy, jobs)
    curves = [r["result"]["curve"] for r in sweep.results.values()]
    grid = list(range(cfg["eval_every"], args.calibrate + 1, cfg["eval_every"]))
    rates = {b: float(np.mean([budget_success(c, b, cfg["threshold"], cfg["stop_at"]) for c in curves]))
             for b in grid} if curves else {}
    budget = next((b for b in grid if rates[b] >= 0.9), None)
    result = {"experiment": "copy-calibration", "config": cfg, "seeds": seeds, "meta": runner.metadata(cfg),
              "success_rate_by_budget": rates, "budget": budget, "sweep": sweep_block(sweep)}
    md = (f"# copy: step-budget calibration\n\nsoftmax, iid, {seeds} seeds, hidden {cfg['hidden_dim']}, batch "
          f"{cfg['batch']}: the smallest budget at which >= 90% of runs succeed is **{budget}** steps.\n\n"
          + md_table(["budget", "iid success rate"], [[b, r] for b, r in rates.items()]))
    write_outputs(args.out, "copy_calibration", result, md)
    return result


def check_arguments(args) -> None:
    """ValueError naming the argument (the CLI checks before it creates the output directory)."""
    if getattr(args, "calibrate", None) is not None and args.calibrate < 1:
        raise ValueError(f"argument --calibrate: must be a positive int, got {args.calibrate}")


def run(args) -> dict:
    check_arguments(args)
    if getattr(args, "calibrate", None) is not None:
        return calibrate(args)
    jobs, scale, seeds = jobs_for(args)
    sweep = run_sweep(args, train_copy, jobs)
    summary = summarize(args, sweep, scale, seeds)
    config = {**common_config(args), "distributions": list(args.distributions), "seeds": seeds,
              "scale": copy_config(**scale), "calibration": CALIBRATION}
    return write_dynamics_result(args, NAME, config, markdown, paper=PAPER, success_rate=summary["success_rate"],
                                 summary=summary, sweep=sweep_block(sweep),
                                 reading=reading(summary, args.distributions, args.normalizers),
                                 plots=plot(args.out, summary, args))
