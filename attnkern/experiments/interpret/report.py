"""Report: gathers the interpretability results in --out into one report.md (tables beside the papers', plots).

Reads whichever of importance.json, permutation.json, adversarial.json, baselines.json, diagnostic.json and
erasure.json exist in the output folder, opens with a per-normalizer summary (what sparse attention changes), then
includes each experiment's own markdown with its plots. Runs nothing itself.
"""

from __future__ import annotations

import json
import math

import numpy as np

from attnkern.experiments.common import md_table, write_outputs

NAME = "report"
PARTS = ("importance", "permutation", "adversarial", "baselines", "diagnostic", "erasure")


def add_arguments(parser) -> None:
    """No options of its own: it reads the results already in --out."""


def _mean(values) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(vals)) if vals else math.nan


def summary_by_normalizer(results: dict) -> list[dict]:
    """Per normalizer, means over every (dataset, encoder) row of each experiment's headline statistic."""
    normalizers = []
    for res in results.values():
        for r in res.get("rows", []):
            if r["normalizer"] not in normalizers:
                normalizers.append(r["normalizer"])
    out = []
    for norm in normalizers:
        s = {"normalizer": norm}

        def rows(name, norm=norm):
            return [r for r in results.get(name, {}).get("rows", []) if r["normalizer"] == norm]

        imp = rows("importance")
        s["accuracy"] = _mean([r["accuracy"] for r in imp])
        s["gradient_tau"] = _mean([r["gradient_tau_mean"] for r in imp])
        s["loo_tau"] = _mean([r["loo_tau_mean"] for r in imp])
        s["gradient_support_tau"] = _mean([r["gradient_support_tau_mean"] for r in imp])
        s["support_frac"] = _mean([r["support_frac_mean"] for r in imp])
        s["top1_gradient"] = _mean([r["gradient_topk"]["1"] for r in imp])
        s["top3_gradient"] = _mean([r["gradient_topk"]["3"] for r in imp])
        s["permutation_change"] = _mean([r["median_change_mean"] for r in rows("permutation")])
        s["adversarial_jsd"] = _mean([r["max_jsd_mean"] for r in rows("adversarial")])
        # (the orders on the instances that flip under every order)
        s["erasure_attention_items"] = _mean([r["attention"]["items_frac_common"] for r in rows("erasure")])
        s["erasure_gradient_items"] = _mean([r["gradient"]["items_frac_common"] for r in rows("erasure")])
        base = rows("baselines")
        s["learned_minus_uniform"] = _mean([r["learned_accuracy"] - r["uniform_accuracy"] for r in base])
        s["guided_minus_uniform"] = _mean([r["guided_accuracy"] - r["uniform_accuracy"] for r in rows("diagnostic")])
        out.append(s)
    return out


def run(args) -> dict:
    results, texts = {}, {}
    for name in PARTS:
        path = args.out / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
            md = args.out / f"{name}.md"
            texts[name] = md.read_text() if md.exists() else ""
    if not results:
        raise ValueError(f"argument --out: no interpretability results in {args.out} "
                         f"(run `attnkern-exp importance --out {args.out}` and the others first)")
    summary = summary_by_normalizer(results)
    result = {"experiment": NAME, "parts": list(results), "summary": summary}
    write_outputs(args.out, NAME, result, markdown(result, texts))
    return result


def _cell(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def markdown(result: dict, texts: dict) -> str:
    lines = ["# Is attention explanation? Softmax, sparsemax and entmax attention on real text", "",
             "Jain & Wallace (2019), Wiegreffe & Pinter (2019) and Serrano & Smith (2019), rerun on Rotten "
             "Tomatoes snippets (beside the papers' SST rows), rated tweets (beside their Twitter rows) and BBC "
             "News (beside their AG News / 20 Newsgroups rows), with every attention normalized by attnkern's "
             "kernels. Each part's scale line says whether its embeddings were trained from scratch or started "
             "from word2vec vectors (the papers used pretrained word vectors).", "",
             f"Parts found: {', '.join(result['parts'])}.", "", "## Summary by normalizer", "",
             "Means over the (dataset, encoder) rows of each experiment: test accuracy, τ(attention, gradient), "
             "τ(attention, leave-one-out), τ(attention, gradient) on the support only, support size / length, "
             "top-1 and top-3 agreement with gradient importance, mean median output change under permutation, "
             "mean ε-max adversarial JSD, fraction of items erased before the decision flips (attention order, "
             "gradient order), learned − uniform attention accuracy, and the diagnostic model's accuracy with "
             "the guide's attention − with uniform weights.", ""]
    header = ["normalizer", "acc", "τ_g", "τ_loo", "τ_g supp.", "supp./len", "top-1 g", "top-3 g", "perm. Δŷ",
              "adv. JSD", "erase (attn)", "erase (grad)", "learned − uniform", "guided − uniform"]
    body = [[s["normalizer"], *[_cell(s[k]) for k in ("accuracy", "gradient_tau", "loo_tau", "gradient_support_tau",
                                                      "support_frac", "top1_gradient", "top3_gradient",
                                                      "permutation_change", "adversarial_jsd",
                                                      "erasure_attention_items", "erasure_gradient_items",
                                                      "learned_minus_uniform", "guided_minus_uniform")]]
            for s in result["summary"]]
    lines.append(md_table(header, body))
    for name in result["parts"]:
        text = texts.get(name, "").strip()
        if text:
            # demote the part's headings one level under the report's title
            lines += ["", "\n".join("#" + ln if ln.startswith("#") else ln for ln in text.splitlines())]
    return "\n".join(lines) + "\n"
