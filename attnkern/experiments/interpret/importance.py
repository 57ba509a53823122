"""Importance: does attention agree with gradient and leave-one-out importance? (Jain & Wallace 2019, Table 2)

For every test instance of every trained classifier: Kendall τ-b (scipy) between the attention over the tokens and

- gradient importance ``|Σ_d ∂ŷ/∂e_td · e_td|`` (ŷ the predicted class's probability, attention held fixed),
- leave-one-out importance ``TVD(ŷ(x_{-t}), ŷ(x))`` (token t removed).

Reported as the paper's Table 2: mean ± std of τ over instances and the fraction with p ≤ 0.05, overall and by
predicted class. For sparse attention also τ on the support only (instances whose support holds fewer than two
tokens are counted and left out), the support size, and the top-k agreement (k = 1…5) between attention and each
importance.
"""

from __future__ import annotations

import math

import numpy as np

from attnkern.experiments.common import md_table
from attnkern.experiments.interpret import shared
from attnkern.experiments.interpret.classifiers import DATASETS
from attnkern.experiments.interpret.metrics import (
    KendallResult,
    kendall_tau,
    nested_bootstrap_interval,
    summarize_kendall,
    topk_agreement,
)

NAME = "importance"
# Its metrics (Kendall τ, top-k, output change) hold for chain marginals too (--normalizers crf, sparsemap).
ACCEPTS_MARGINALS = True
TOPK = (1, 2, 3, 4, 5)

# Jain & Wallace (2019), Table 2: (mean, std, sig. frac.) per predicted class; gradient τ for the BiLSTM and the
# average encoder, leave-one-out τ for the BiLSTM (the table has no CNN or average leave-one-out columns).
PAPER_TABLE2 = {
    "SST": {
        0: {"bilstm_grad": (0.40, 0.21, 0.59), "average_grad": (0.69, 0.15, 0.93), "bilstm_loo": (0.34, 0.20, 0.47)},
        1: {"bilstm_grad": (0.38, 0.19, 0.58), "average_grad": (0.69, 0.14, 0.94), "bilstm_loo": (0.33, 0.19, 0.47)}},
    "ADR Tweets": {
        0: {"bilstm_grad": (0.45, 0.17, 0.74), "average_grad": (0.71, 0.13, 0.97), "bilstm_loo": (0.29, 0.19, 0.44)},
        1: {"bilstm_grad": (0.45, 0.16, 0.77), "average_grad": (0.71, 0.13, 0.97), "bilstm_loo": (0.40, 0.17, 0.69)}},
    "20News": {
        0: {"bilstm_grad": (0.08, 0.15, 0.31), "average_grad": (0.65, 0.09, 0.99), "bilstm_loo": (0.05, 0.15, 0.28)},
        1: {"bilstm_grad": (0.13, 0.16, 0.48), "average_grad": (0.66, 0.09, 1.00), "bilstm_loo": (0.14, 0.14, 0.51)}},
    "AG News": {
        0: {"bilstm_grad": (0.42, 0.11, 0.93), "average_grad": (0.77, 0.08, 1.00), "bilstm_loo": (0.35, 0.13, 0.80)},
        1: {"bilstm_grad": (0.35, 0.13, 0.81), "average_grad": (0.75, 0.07, 1.00), "bilstm_loo": (0.32, 0.13, 0.73)}},
}

# The same cells in the result files Jain & Wallace released, which differ from the paper's table (a different run,
# it seems): successar/AttentionExplanation at commit 752b7791f51573fdee503723eaebc4b42f598c9d,
# graph_outputs/GradientPval_kendalltau/<data>+<encoder>+tanh.csv (gradient) and
# graph_outputs/pyxc-pyc_pval_kendalltau/<data>+lstm+tanh.csv (leave-one-out), with <data> sst, tweet, agnews,
# 20News_sports and <encoder> lstm or average; their rows are per predicted class, the columns pval_sig, mean, std.
RELEASED_TABLE2_COMMIT = "752b7791f51573fdee503723eaebc4b42f598c9d"
RELEASED_TABLE2 = {
    "SST": {
        0: {"bilstm_grad": (0.34, 0.21, 0.48), "average_grad": (0.61, 0.20, 0.87), "bilstm_loo": (0.27, 0.19, 0.33)},
        1: {"bilstm_grad": (0.36, 0.21, 0.49), "average_grad": (0.60, 0.21, 0.83), "bilstm_loo": (0.32, 0.19, 0.40)}},
    "ADR Tweets": {
        0: {"bilstm_grad": (0.47, 0.18, 0.76), "average_grad": (0.73, 0.13, 0.96), "bilstm_loo": (0.29, 0.20, 0.44)},
        1: {"bilstm_grad": (0.49, 0.15, 0.85), "average_grad": (0.72, 0.12, 0.97), "bilstm_loo": (0.44, 0.16, 0.74)}},
    "20News": {
        0: {"bilstm_grad": (0.07, 0.17, 0.37), "average_grad": (0.79, 0.07, 1.00), "bilstm_loo": (0.06, 0.15, 0.29)},
        1: {"bilstm_grad": (0.21, 0.22, 0.61), "average_grad": (0.75, 0.08, 1.00), "bilstm_loo": (0.20, 0.20, 0.62)}},
    "AG News": {
        0: {"bilstm_grad": (0.36, 0.13, 0.82), "average_grad": (0.78, 0.07, 1.00), "bilstm_loo": (0.30, 0.13, 0.69)},
        1: {"bilstm_grad": (0.42, 0.13, 0.90), "average_grad": (0.76, 0.07, 1.00), "bilstm_loo": (0.43, 0.14, 0.91)}},
}

# The CLI checks these before it creates the output directory (run() checks them again).
check_arguments = shared.check_model_arguments


def add_arguments(parser) -> None:
    shared.add_model_arguments(parser)


def analyse(config: dict, seed: int) -> dict:
    """One trained model: per-instance τ (gradient, leave-one-out, on the support), support sizes, top-k."""
    trained = shared.trained_from_config(config)
    model = trained.model
    per = {"pred": [], "label": [], "length": [], "support": [], "grad": [], "loo": [], "grad_supp": [],
           "loo_supp": [], "topk_grad": [], "topk_loo": []}
    for enc, labels in shared.test_batches(trained, config["instances"]):
        grad = shared.gradient_importance(model, enc)
        loo = shared.leave_one_out_importance(model, enc)
        for i in range(enc.tokens.shape[0]):
            n = int(enc.lengths[i])
            a = enc.weights[i, :n].double().numpy()
            g = grad[i, :n].double().numpy()
            lo = loo[i].double().numpy() if n >= 2 else np.zeros(n)
            supp = a > 0
            per["pred"].append(int(enc.pred[i]))
            per["label"].append(int(labels[i]))
            per["length"].append(n)
            per["support"].append(int(supp.sum()))
            for key, imp in (("grad", g), ("loo", lo)):
                r = kendall_tau(a, imp) if n >= 2 else KendallResult(math.nan, math.nan)
                rs = kendall_tau(a[supp], imp[supp]) if supp.sum() >= 2 else KendallResult(math.nan, math.nan)
                per[key].append([r.tau, r.pvalue])
                per[f"{key}_supp"].append([rs.tau, rs.pvalue])
                per[f"topk_{key}"].append([topk_agreement(a, imp, k) for k in TOPK])
    correct = np.mean(np.asarray(per["pred"]) == np.asarray(per["label"]))
    return {"per_instance": per, "test_accuracy": trained.info["test_accuracy"],
            "dev_accuracy": trained.info["dev_accuracy"], "analysed_accuracy": float(correct),
            "train_info": {k: trained.info[k] for k in ("best_epoch", "train_seconds", "sizes")}}


def _kendalls(pairs) -> list[KendallResult]:
    return [KendallResult(math.nan if t is None else t, math.nan if p is None else p) for t, p in pairs]


def summarize(per: dict, select=None) -> dict:
    """Table 2 statistics over the instances (optionally only where ``select`` is True)."""
    idx = [i for i in range(len(per["pred"])) if select is None or select[i]]
    out = {"instances": len(idx)}
    support = np.asarray([per["support"][i] for i in idx], dtype=float)
    for key, prefix in (("grad", "gradient"), ("loo", "loo")):
        taus, support_taus = _kendalls(per[key]), _kendalls(per[f"{key}_supp"])
        out.update(summarize_kendall([taus[i] for i in idx]).as_dict(prefix))
        supp = summarize_kendall([support_taus[i] for i in idx])
        out.update({f"{prefix}_support_tau_mean": supp.mean, f"{prefix}_support_tau_std": supp.std,
                    f"{prefix}_support_sig_frac": supp.sig_frac, f"{prefix}_support_undefined": supp.n_undefined})
        topk = np.asarray([per[f"topk_{key}"][i] for i in idx], dtype=float).reshape(len(idx), len(TOPK))
        # Top-k counts only instances whose attention has more than k non-zero tokens: with k or fewer, the
        # exact zeros tie and every position-broken tie agrees by construction.
        out[f"{prefix}_topk"], out[f"{prefix}_topk_coverage"] = {}, {}
        for j, k in enumerate(TOPK):
            eligible = support > k
            out[f"{prefix}_topk"][str(k)] = float(np.nanmean(topk[eligible, j])) if eligible.any() else math.nan
            out[f"{prefix}_topk_coverage"][str(k)] = float(eligible.mean()) if len(idx) else math.nan
    lengths = np.asarray([per["length"][i] for i in idx], dtype=float)
    out["length_mean"] = float(lengths.mean()) if len(idx) else math.nan
    out["support_mean"] = float(support.mean()) if len(idx) else math.nan
    out["support_frac_mean"] = float((support / np.maximum(lengths, 1)).mean()) if len(idx) else math.nan
    return out


def _fmt(mean, std=None, frac=None, ci=None) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    s = f"{mean:.2f}"
    if std is not None:
        s += f" ± {std:.2f}"
    if ci is not None and not any(v is None or math.isnan(v) for v in ci):
        s += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
    if frac is not None:
        s += f" ({frac:.2f})"
    return s


def _paper_cells(dataset: str, encoder: str, cls: int | None, source: dict = PAPER_TABLE2) -> tuple[str, str]:
    """(gradient τ, leave-one-out τ) of ``source`` (PAPER_TABLE2 or RELEASED_TABLE2) for our row, or '–' where it
    has no such cell."""
    rows = DATASETS[dataset].paper_rows
    grad, loo = [], []
    for paper_row in rows:
        table = source.get(paper_row, {})
        classes = [cls] if cls is not None else sorted(table)
        for c in classes:
            cell = table.get(c, {})
            if f"{encoder}_grad" in cell:
                grad.append(f"{paper_row} c{c}: {_fmt(*cell[f'{encoder}_grad'])}")
            if f"{encoder}_loo" in cell:
                loo.append(f"{paper_row} c{c}: {_fmt(*cell[f'{encoder}_loo'])}")
    return ("; ".join(grad) or "–"), ("; ".join(loo) or "–")


def _plot(merged_by_key: dict, out) -> list[str]:
    def draw(ax, key, per):
        preds = np.asarray(per["pred"])
        taus = np.asarray([np.nan if t is None else t for t, _ in per["grad"]], dtype=float)
        for cls in sorted(set(preds.tolist())):
            vals = taus[(preds == cls) & ~np.isnan(taus)]
            if len(vals):
                ax.hist(vals, bins=20, range=(-1, 1), alpha=0.6, label=f"pred {cls}")

    return shared.panel_grid(merged_by_key, out, NAME, "τ(attention, gradient importance) by predicted class", draw,
                             "Kendall τ (attention, gradient)", sharey=False, panel_height=2.4)


def _seed_taus(results: list[dict], key: str, cls: int | None = None) -> list[list[float]]:
    """Per seed, the per-instance τ of ``key`` ("grad" or "loo"), of predicted class ``cls`` if given."""
    out = []
    for r in results:
        per = r["per_instance"]
        out.append([math.nan if t is None else t for (t, _), pred in zip(per[key], per["pred"], strict=True)
                    if cls is None or pred == cls])
    return out


def add_intervals(rows: list[dict], groups: dict) -> None:
    """95% intervals of each row's mean τ (and of each predicted class's), by a nested bootstrap over the
    seeds and the instances within each (metrics.nested_bootstrap_interval)."""
    for row in rows:
        results = groups[(row["dataset"], row["encoder"], row["normalizer"])]
        for key, prefix in (("grad", "gradient"), ("loo", "loo")):
            row[f"{prefix}_tau_ci"] = nested_bootstrap_interval(_seed_taus(results, key))
            for cls, cell in row.get("by_class", {}).items():
                cell[f"{prefix}_tau_ci"] = nested_bootstrap_interval(_seed_taus(results, key, int(cls)))


def paired_differences(sweep, baseline: str = "softmax") -> list[dict]:
    """Per (dataset, encoder) and normalizer other than ``baseline``: the mean over the same seeds and the same
    test instances of τ(normalizer) − τ(baseline), with a nested-bootstrap 95% interval (seeds, then instances
    within each). Pairing takes out the spread that both models share (the instance's difficulty, the seed's
    data split)."""
    by: dict = {}
    for rec in sweep.results.values():
        train = rec["meta"]["config"]["train"]
        seed = train.get("seed", rec["meta"]["seed"])
        by.setdefault((train["dataset"], train["encoder"], train["normalizer"]), {})[seed] = rec["result"]
    rows = []
    for (dataset, encoder, normalizer), results in sorted(by.items()):
        base = by.get((dataset, encoder, baseline))
        if normalizer == baseline or base is None:
            continue
        seeds = sorted(set(results) & set(base))
        row = {"dataset": dataset, "encoder": encoder, "normalizer": normalizer, "vs": baseline, "seeds": len(seeds)}
        for key, prefix in (("grad", "gradient"), ("loo", "loo")):
            groups = []
            for seed in seeds:
                (ours,), (theirs,) = _seed_taus([results[seed]], key), _seed_taus([base[seed]], key)
                groups.append([a - b for a, b in zip(ours, theirs, strict=True)])
            values = np.asarray([v for g in groups for v in g], dtype=float)
            values = values[np.isfinite(values)]
            row[f"{prefix}_tau_diff"] = float(values.mean()) if values.size else math.nan
            row[f"{prefix}_tau_diff_ci"] = nested_bootstrap_interval(groups)
        rows.append(row)
    return rows


def run(args) -> dict:
    shared.check_model_arguments(args)
    jobs = shared.model_jobs(args, NAME)
    sweep = shared.run_model_jobs(analyse, jobs, args, NAME)

    def fields(key, per):
        preds = np.asarray(per["pred"])
        by_class = {str(c): summarize(per, preds == c) for c in sorted(set(preds.tolist()))}
        return {**summarize(per), "by_class": by_class, "paper_rows": list(DATASETS[key[0]].paper_rows)}

    rows, merged_by_key = shared.model_rows(sweep, fields)
    add_intervals(rows, shared.group_runs(sweep))
    return shared.write_result(
        args, NAME, sweep, markdown, rows=rows, paired=paired_differences(sweep), plots=_plot(merged_by_key, args.out),
        notes=[("embeddings from word2vec vectors trained without the test split" if args.embeddings == "word2vec"
                else "embeddings trained from scratch") + " (the paper used pretrained word vectors)",
               "Kendall tau-b from scipy.stats; undefined tau (fewer than 2 tokens, constant vector) "
               "counted in *_undefined and left out of means and significant fractions",
               "top-k: ties broken by position; k clipped to the document length"])


def markdown(result: dict) -> str:
    lines = shared.markdown_head(
        "Attention vs. gradient and leave-one-out importance (Jain & Wallace 2019, Table 2)",
        "Kendall τ-b between attention and each importance per test instance: mean ± std over instances, "
        "[95% interval of the mean: nested bootstrap over seeds, then instances within each seed] "
        "(fraction significant at p ≤ 0.05). Our datasets stand beside the paper's nearest rows: Rotten "
        "Tomatoes snippets beside SST, rated tweets beside ADR Tweets, BBC News beside AG News / 20News. "
        + ("Embeddings start from word2vec vectors trained here without the test split (the paper used "
           "pretrained vectors). " if result.get("embeddings") == "word2vec" else
           "Embeddings are trained from scratch (the paper used pretrained vectors). ")
        + "Reference cells are per predicted class (c0, c1), shown on our softmax rows (the paper studied softmax "
        "attention only): the paper's Table 2 and, where they differ, the result files the authors released "
        f"(successar/AttentionExplanation at {RELEASED_TABLE2_COMMIT[:7]}, graph_outputs/GradientPval_kendalltau "
        "and pyxc-pyc_pval_kendalltau); neither has a CNN column or a leave-one-out column for the average "
        "encoder.", result)
    header = ["dataset", "encoder", "normalizer", "acc", "τ_g ours", "τ_g paper", "τ_g authors' files",
              "τ_loo ours", "τ_loo paper", "τ_loo authors' files"]
    body = []
    for r in result["rows"]:
        # the paper studied softmax attention only
        softmax = r["normalizer"] == "softmax"
        pg, pl = _paper_cells(r["dataset"], r["encoder"], None) if softmax else ("", "")
        rg, rl = _paper_cells(r["dataset"], r["encoder"], None, RELEASED_TABLE2) if softmax else ("", "")
        body.append([r["dataset"], r["encoder"], r["normalizer"], f"{r['accuracy']:.3f}",
                     _fmt(r["gradient_tau_mean"], r["gradient_tau_std"], r["gradient_sig_frac"],
                          r.get("gradient_tau_ci")), pg, rg,
                     _fmt(r["loo_tau_mean"], r["loo_tau_std"], r["loo_sig_frac"], r.get("loo_tau_ci")), pl, rl])
    lines.append(md_table(header, body))
    lines += ["## By predicted class", ""]
    body = []
    for r in result["rows"]:
        for cls, s in r["by_class"].items():
            body.append([r["dataset"], r["encoder"], r["normalizer"], cls, s["instances"],
                         _fmt(s["gradient_tau_mean"], s["gradient_tau_std"], s["gradient_sig_frac"],
                              s.get("gradient_tau_ci")),
                         _fmt(s["loo_tau_mean"], s["loo_tau_std"], s["loo_sig_frac"], s.get("loo_tau_ci"))])
    lines.append(md_table(["dataset", "encoder", "normalizer", "pred. class", "n", "τ_g", "τ_loo"], body))
    lines += ["## Sparse attention: support, τ on the support, top-k agreement", "",
              "τ on the support compares only the tokens with non-zero attention (instances whose support has "
              "fewer than 2 tokens are left out; their number is in 'no τ'). Top-k: fraction of attention's k "
              "highest tokens that are among the importance's k highest, over the instances whose attention has "
              "more than k non-zero tokens (with k or fewer, ties among the zeros make any agreement automatic); "
              "'top-k coverage' is the fraction of instances counted.", ""]
    body = []
    for r in result["rows"]:
        body.append([r["dataset"], r["encoder"], r["normalizer"], f"{r['length_mean']:.1f}",
                     f"{r['support_mean']:.1f}", f"{r['support_frac_mean']:.2f}",
                     _fmt(r["gradient_support_tau_mean"], r["gradient_support_tau_std"],
                          r["gradient_support_sig_frac"]),
                     _fmt(r["loo_support_tau_mean"], r["loo_support_tau_std"], r["loo_support_sig_frac"]),
                     r["gradient_support_undefined"],
                     " / ".join(f"{r['gradient_topk'][str(k)]:.2f}" for k in TOPK),
                     " / ".join(f"{r['loo_topk'][str(k)]:.2f}" for k in TOPK),
                     " / ".join(f"{r['gradient_topk_coverage'][str(k)]:.2f}" for k in TOPK)])
    lines.append(md_table(["dataset", "encoder", "normalizer", "length", "support", "support/len",
                           "τ_g support", "τ_loo support", "no τ", "top-1…5 gradient", "top-1…5 loo",
                           "top-1…5 coverage"], body))
    if result.get("paired"):
        lines += ["", "## Sparse against softmax, paired", "",
                  "Mean over the same seeds and test instances of τ(normalizer) − τ(softmax), with its 95% "
                  "interval (nested bootstrap over seeds, then instances): the comparison between normalizers.", ""]
        body = [[p["dataset"], p["encoder"], p["normalizer"], p["seeds"],
                 _fmt(p["gradient_tau_diff"], ci=p["gradient_tau_diff_ci"]),
                 _fmt(p["loo_tau_diff"], ci=p["loo_tau_diff_ci"])] for p in result["paired"]]
        lines.append(md_table(["dataset", "encoder", "normalizer", "seeds", "Δτ_g", "Δτ_loo"], body))
    return shared.markdown_tail(lines, result)
