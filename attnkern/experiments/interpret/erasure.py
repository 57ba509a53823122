"""Erasure: how much attended input must go before the decision flips? (Serrano & Smith 2019)

With the encoder states fixed, items (encoder positions) are removed one at a time in a ranking order and the
attention is renormalised over the rest, until the model's decision changes. Orders: by attention (highest first),
random, by the gradient of the decision's probability with respect to each attention weight, and by gradient ×
attention. Reported per instance: the number of items removed at the first flip, that number as a fraction of the
document length, and the fraction of the original attention mass removed; instances whose decision never flips
before a single item is left are counted apart.

"Renormalise" means applying the model's own normalizer to the remaining items' scores: for softmax this is exactly
the proportional renormalisation of the paper; for sparsemax and entmax it keeps the attention in the model's
family, and it gives the remaining items weight again when the whole support has been removed (proportional
renormalisation would divide by zero there).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from attnkern.experiments.common import md_table, pyplot, save_figure
from attnkern.experiments.interpret import shared

NAME = "erasure"
ORDERS = ("attention", "random", "gradient", "gradient_x_attention")


# The CLI checks these before it creates the output directory (run() checks them again).
check_arguments = shared.check_model_arguments


def add_arguments(parser) -> None:
    shared.add_model_arguments(parser)


def attention_gradient(model, enc: shared.Encoded) -> torch.Tensor:
    """∂ŷ_pred / ∂a_t (B, T): gradient of the decided class's probability with respect to each attention weight."""
    weights = enc.weights.detach().clone().requires_grad_(True)
    probs = shared.decode(weights, enc.relevance, enc.bias)
    probs.gather(1, enc.pred.unsqueeze(1)).sum().backward()
    return weights.grad.detach()


def rankings(model, enc: shared.Encoded, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Removal order per ranking scheme: (B, T) indices, real positions first (highest score first)."""
    grad = attention_gradient(model, enc)
    keys = {"attention": enc.weights, "random": torch.rand(enc.weights.shape, generator=gen), "gradient": grad,
            "gradient_x_attention": grad * enc.weights}
    out = {}
    for name, score in keys.items():
        score = score.masked_fill(~enc.mask, -math.inf)
        out[name] = torch.argsort(score, dim=1, descending=True, stable=True)
    return out


@torch.no_grad()
def erase_until_flip(model, enc: shared.Encoded, order: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Remove items in ``order`` (B, T) until the decision changes. Returns, per instance, the number of items
    removed at the first flip (0 where it never flips with at least one item left) and the original attention
    mass those items held."""
    B, T = enc.weights.shape
    lengths = enc.lengths
    removed = torch.zeros(B, T, dtype=torch.bool)
    flipped_at = torch.zeros(B, dtype=torch.long)
    mass = torch.zeros(B)
    rows = torch.arange(B)
    for step in range(T - 1):
        active = (flipped_at == 0) & (lengths - step > 1)  # keep at least one item
        if not active.any():
            break
        idx = order[:, step]
        removed[rows[active], idx[active]] = True
        keep = enc.mask & ~removed
        weights = shared.normalize_scores(model, enc.scores, keep)
        pred = shared.decode(weights, enc.relevance, enc.bias).argmax(-1)
        newly = active & (pred != enc.pred)
        flipped_at[newly] = step + 1
        mass[newly] = (enc.weights * removed).sum(1)[newly]
    return flipped_at.numpy(), mass.numpy()


def analyse(config: dict, seed: int) -> dict:
    trained = shared.trained_from_config(config, frozen=True)
    model = trained.model
    gen = torch.Generator().manual_seed(2000 + seed)
    per = {"length": [], "support": [], **{f"{o}_items": [] for o in ORDERS}, **{f"{o}_mass": [] for o in ORDERS}}
    for enc, _ in shared.test_batches(trained, config["instances"], batch_size=64):
        orders = rankings(model, enc, gen)
        per["length"] += enc.lengths.tolist()
        per["support"] += (enc.weights > 0).sum(1).tolist()
        for name in ORDERS:
            items, mass = erase_until_flip(model, enc, orders[name])
            per[f"{name}_items"] += items.tolist()
            per[f"{name}_mass"] += mass.tolist()
    return {"per_instance": per, "test_accuracy": trained.info["test_accuracy"]}


def summarize(per: dict) -> dict:
    """Per order: the fraction of instances that flip, and over those the items and mass removed; and, to
    compare the orders on one set, the same over the instances that flip under every order ("common")."""
    length = np.asarray(per["length"], dtype=float)
    out = {"instances": int(length.size), "length_mean": float(length.mean()),
           "support_mean": float(np.mean(per["support"]))}
    common = np.logical_and.reduce([np.asarray(per[f"{o}_items"]) > 0 for o in ORDERS])
    out["common_frac"] = float(common.mean()) if common.size else math.nan
    for name in ORDERS:
        items = np.asarray(per[f"{name}_items"], dtype=float)
        mass = np.asarray(per[f"{name}_mass"], dtype=float)
        flips = items > 0
        out[name] = {
            "flip_frac": float(flips.mean()),
            "items_mean": float(items[flips].mean()) if flips.any() else math.nan,
            "items_frac_mean": float((items[flips] / length[flips]).mean()) if flips.any() else math.nan,
            "mass_mean": float(mass[flips].mean()) if flips.any() else math.nan,
            "items_frac_common": float((items[common] / length[common]).mean()) if common.any() else math.nan,
            "mass_common": float(mass[common].mean()) if common.any() else math.nan,
        }
    return out


def _plot(rows: list[dict], out) -> list[str]:
    plt = pyplot()
    if not rows:
        return []
    labels = [f"{r['dataset']}/{r['encoder']}/{r['normalizer']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 2), 4))
    width = 0.8 / len(ORDERS)
    x = np.arange(len(rows))
    for i, name in enumerate(ORDERS):
        vals = [r[name]["items_frac_common"] for r in rows]
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=name.replace("_", " "))
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("fraction of items removed at first flip")
    ax.set_title("Erasure until the decision flips (instances that flip under every order)")
    ax.legend(fontsize=7)
    return [save_figure(fig, out, "erasure.png")]


def run(args) -> dict:
    shared.check_model_arguments(args)
    jobs = shared.model_jobs(args, NAME)
    sweep = shared.run_model_jobs(analyse, jobs, args, NAME)
    rows, _ = shared.model_rows(sweep, lambda key, per: summarize(per))
    return shared.write_result(args, NAME, sweep, markdown, orders=list(ORDERS), rows=rows,
                               plots=_plot(rows, args.out))


def markdown(result: dict) -> str:
    lines = shared.markdown_head(
        "Erasure until the decision flips (Serrano & Smith 2019)",
        "Items are removed in each order with the encoder fixed and the remaining attention renormalised "
        "by the model's normalizer. Per order: fraction of instances whose decision flips before one item "
        "is left, and over those, the mean fraction of the items removed and of the original attention mass "
        "removed at the first flip. Serrano & Smith found that removing the most attended item seldom flips "
        "the decision and that the set of items to erase before a flip is often too large to serve as an "
        "explanation, with gradient-based orders finding smaller sets.", result)
    body = []
    for r in result["rows"]:
        cells = []
        for name in ORDERS:
            s = r[name]
            cells.append("–" if math.isnan(s["items_frac_mean"]) else
                         f"{s['flip_frac']:.2f} / {s['items_frac_mean']:.2f} / {s['mass_mean']:.2f}")
        body.append([r["dataset"], r["encoder"], r["normalizer"], f"{r['accuracy']:.3f}", f"{r['length_mean']:.1f}",
                     f"{r['support_mean']:.1f}", *cells])
    lines.append(md_table(["dataset", "encoder", "normalizer", "acc", "length", "support",
                           *[f"{n.replace('_', ' ')}: flips / items / mass" for n in ORDERS]], body))
    lines += ["", "The orders compared on one set of instances, those whose decision flips under every order "
              "(their fraction: 'common'); items / mass removed at the first flip:", ""]
    body = []
    for r in result["rows"]:
        cells = ["–" if math.isnan(r[n].get("items_frac_common", math.nan)) else
                 f"{r[n]['items_frac_common']:.2f} / {r[n]['mass_common']:.2f}" for n in ORDERS]
        body.append([r["dataset"], r["encoder"], r["normalizer"], f"{r.get('common_frac', math.nan):.2f}", *cells])
    lines.append(md_table(["dataset", "encoder", "normalizer", "common",
                           *[f"{n.replace('_', ' ')}: items / mass" for n in ORDERS]], body))
    return shared.markdown_tail(lines, result)
