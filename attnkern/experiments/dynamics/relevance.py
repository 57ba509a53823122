"""relevance: output relevance r vs attention a over training, for text classification.

With a linear output, the logit of class c is y_c = Σ_t a_t r_{t,c} + b_c where
r_t = W h_t is the output relevance of position t (Snell, Zhong et al.). The
claims tested: (1) attention is attracted to positions of larger relevance
(Kendall τ between a_t and the gold-class relevance grows during training);
(2) under frozen uniform attention, r grows fastest at keyword positions, and
the relevance r' of a uniform-attention model agrees with the attention of a
standardly trained model (top-1 match and τ against a shuffled baseline).

Each run trains a standard and a uniform-attention classifier side by side from
the same seed on the same batches, on a synthetic keyword task (one keyword
decides the label) and on the Rotten Tomatoes snippets (`attnkern-exp data fetch vader`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from attnkern.experiments.common import (
    cell_jobs,
    collect_cells,
    common_config,
    fmt_mean_std,
    forward_eval,
    kendall_tau_rows,
    markdown_end,
    md_table,
    mean_std,
    parse_normalizer,
    pyplot,
    run_sweep,
    save_figure,
    scale_and_seeds,
    shuffle_rows,
    sweep_block,
    train_side_by_side,
    write_dynamics_result,
)
from attnkern.experiments.data.synthetic import KeywordTask
from attnkern.experiments.models import AttentionClassifier

NAME = "relevance"
DATASETS = ("keyword", "rotten")
QUICK = dict(embed_dim=32, hidden_dim=32, batch=32, steps=300, eval_every=25, probe=200, seeds=3)
FULL = dict(embed_dim=128, hidden_dim=128, batch=32, steps=3000, eval_every=100, probe=500, seeds=10)
PAPER = {
    "a_attracted_to_r": "attention attracted to larger r (slides: qualitative, no number)",
    "r_uniform_vs_a": "r' of the uniform model correlates with standard attention (qualitative)",
    "keyword_r": "under uniform attention r grows fastest at keywords (qualitative)",
}


def add_arguments(p) -> None:
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--encoder", default="bilstm", choices=AttentionClassifier.ENCODERS)
    p.add_argument("--attention", default="additive", choices=AttentionClassifier.ATTENTIONS)
    p.add_argument("--steps", type=int, default=None, help="override the number of training steps")


def _load(dataset: str, seed: int, probe: int):
    """(train (tokens, mask, labels), probe (tokens, mask, labels, keyword mask or None), vocab size)."""
    if dataset == "keyword":
        task = KeywordTask()
        g = torch.Generator().manual_seed(seed)
        tr = task.sample(4000, g)
        pr = task.sample(probe, g)
        return tr[:3], (*pr[:3], task.is_keyword(pr[0])), task.vocab_size
    from attnkern.experiments.data.rotten import binary_sentiment, load_rotten_tomatoes
    from attnkern.experiments.data.text import Vocab, pad_batch, split_indices, tokenize

    texts, labels = binary_sentiment(load_rotten_tomatoes(), margin=0.5)
    toks = [tokenize(t)[:40] for t in texts]
    train_idx, dev_idx, _ = split_indices(len(toks), seed=0)  # one fixed split for every seed
    vocab = Vocab([toks[i] for i in train_idx], min_count=2)
    y = torch.tensor(labels)

    def enc(idx):
        t, m = pad_batch([vocab.encode(toks[i]) for i in idx])
        return t, m, y[torch.as_tensor(idx)]

    return enc(train_idx), (*enc(dev_idx[:probe]), None), len(vocab)


def _gold_relevance(model, hidden, labels):
    r = model.relevance(hidden)  # (B, T, C)
    return r.gather(-1, labels.view(-1, 1, 1).expand(-1, r.shape[1], 1)).squeeze(-1) - r.mean(-1)


def _taus(x, y, mask, rng=None):
    """Mean over sentences (>= 3 real tokens) of Kendall τ between x and y; with rng, y is
    shuffled within each sentence first (the chance level)."""
    if rng is not None:
        y = shuffle_rows(y, mask, rng)
    t = kendall_tau_rows(x, y, mask)
    ok = np.isfinite(t) & (mask.sum(-1) >= 3)
    return float(t[ok].mean()) if ok.any() else float("nan")


def _support_taus(a, y, mask) -> tuple[float, float]:
    """τ between attention a and y over each sentence's support (a > 0) only, averaged
    over the sentences with >= 3 support tokens, and the fraction of sentences that have
    them. Over all tokens, the exact zeros of sparse attention are ties that agree with
    any y's order among them only by chance, and τ-b counts them."""
    support = mask & (a > 0)
    counted = support.sum(-1) >= 3
    return _taus(a, y, support), float(counted.mean()) if counted.size else float("nan")


@torch.no_grad()
def _measure(std, uni, probe, rng) -> dict:
    dev = next(std.parameters()).device
    tokens, mask, labels = (x.to(dev) for x in probe[:3])
    kw = probe[3].to(dev) if probe[3] is not None else None
    o_s, o_u = forward_eval((std, uni), tokens, mask)
    r_s = _gold_relevance(std, o_s.hidden, labels).masked_fill(~mask, 0)
    r_u = _gold_relevance(uni, o_u.hidden, labels).masked_fill(~mask, 0)
    a_s = o_s.weights
    m = mask.cpu().numpy()
    big = torch.finfo(r_u.dtype).max
    top_r_u = r_u.masked_fill(~mask, -big).argmax(-1)
    rec = {
        "acc_standard": (o_s.logits.argmax(-1) == labels).float().mean().item(),
        "acc_uniform": (o_u.logits.argmax(-1) == labels).float().mean().item(),
        "tau_a_r_standard": _taus(a_s.cpu().numpy(), r_s.cpu().numpy(), m),
        **dict(zip(("tau_a_r_standard_support", "support_coverage"),
                   _support_taus(a_s.cpu().numpy(), r_s.cpu().numpy(), m), strict=True)),
        "tau_runiform_a_standard": _taus(r_u.cpu().numpy(), a_s.cpu().numpy(), m),
        "tau_runiform_a_standard_shuffled": _taus(r_u.cpu().numpy(), a_s.cpu().numpy(), m, rng),
        "top1_runiform_a_standard": (top_r_u == a_s.argmax(-1)).float().mean().item(),
        "top1_shuffled_baseline": float((1.0 / mask.sum(1).float()).mean()),
    }
    if kw is not None:
        other = mask & ~kw
        rec["keyword_attention_standard"] = (a_s * kw).sum(1).mean().item()
        rec["keyword_r_uniform"] = (r_u * kw).sum().item() / kw.sum().item()
        rec["other_r_uniform"] = (r_u * other).sum().item() / other.sum().item()
        rec["keyword_r_standard"] = (r_s * kw).sum().item() / kw.sum().item()
        rec["other_r_standard"] = (r_s * other).sum().item() / other.sum().item()
    return rec


def train_pair(config: dict, seed: int) -> dict:
    """Trains a standard and a uniform-attention classifier on the same batches."""
    train, probe, vocab_size = _load(config["dataset"], seed, config["probe"])
    normalizer, params = parse_normalizer(config["normalizer"])
    kw = dict(encoder=config["encoder"], attention=config["attention"], normalizer=normalizer, **params,
              embed_dim=config["embed_dim"], hidden_dim=config["hidden_dim"], backend=config["backend"])
    torch.manual_seed(seed)
    dev = config["device"]
    std = AttentionClassifier(vocab_size, 2, mode="learned", **kw).to(dev)
    uni = AttentionClassifier(vocab_size, 2, mode="uniform", **kw).to(dev)
    tokens, mask, labels = train
    gen = np.random.default_rng(seed)
    rng = np.random.default_rng(1000 + seed)

    def next_batch():
        idx = torch.as_tensor(gen.integers(0, len(labels), config["batch"]))
        width = int(mask[idx].sum(1).max())
        return tokens[idx, :width].to(dev), mask[idx, :width].to(dev), labels[idx].to(dev)

    def loss(model, batch):
        return F.cross_entropy(model(*batch[:2]).logits, batch[2])

    return train_side_by_side(std, uni, config, lambda std, uni: _measure(std, uni, probe, rng), next_batch, loss)


def jobs_for(args):
    scale, seeds = scale_and_seeds(args, QUICK, FULL, {"steps": ("steps",)})
    if "rotten" in args.datasets:
        from attnkern.experiments.data.sources import cache_path

        cache_path("vader")  # fail early, naming the command that fetches it
    jobs = cell_jobs(args.datasets, args.normalizers, seeds,
                     lambda ds, norm: dict(dataset=ds, normalizer=norm, encoder=args.encoder,
                                           attention=args.attention, lr=1e-3, backend=args.backend,
                                           device=args.device, **scale))
    return jobs, scale, seeds


KEYS = ("acc_standard", "acc_uniform", "tau_a_r_standard", "tau_a_r_standard_support", "support_coverage",
        "tau_runiform_a_standard",
        "tau_runiform_a_standard_shuffled", "top1_runiform_a_standard", "top1_shuffled_baseline",
        "keyword_attention_standard", "keyword_r_uniform", "other_r_uniform")


def summarize(args, sweep, seeds) -> dict:
    out = collect_cells(sweep, args.datasets, args.normalizers, seeds, KEYS)
    for cells in out.values():
        for cell in cells.values():
            curves = list(cell["curves"].values())
            if "keyword_r_uniform" in curves[0]:
                # early training: the first evaluation after step 0
                cell["early_keyword_minus_other_r_uniform"] = mean_std(
                    [c["keyword_r_uniform"][1] - c["other_r_uniform"][1] for c in curves])
    return out


def plot(out, summary) -> list[str]:
    plt = pyplot()
    files = []
    for ds, cells in summary.items():
        if not cells:
            continue
        panels = [("tau_a_r_standard", "τ(a, r), standard"), ("tau_runiform_a_standard", "τ(r' uniform, a standard)")]
        if ds == "keyword":
            panels.append(("keyword_gap", "r' keyword − other"))
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3), squeeze=False)
        for ax, (key, title) in zip(axes[0], panels, strict=True):
            for norm, cell in cells.items():
                ys = []
                for c in cell["curves"].values():
                    if key == "keyword_gap":
                        ys.append(np.array(c["keyword_r_uniform"]) - np.array(c["other_r_uniform"]))
                    else:
                        ys.append(np.array(c[key], dtype=float))
                steps = next(iter(cell["curves"].values()))["step"]
                ax.plot(steps, np.nanmean(np.stack(ys), 0), label=norm)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
        axes[0][0].legend(fontsize=8)
        files.append(save_figure(fig, out, f"{NAME}_{ds}.png", dpi=90))
    return files


def markdown(result) -> str:
    cfg, s = result["config"], result["summary"]
    f = fmt_mean_std
    lines = ["# relevance: output relevance r and attention a over training", "",
             f"Configuration: {'--quick' if cfg['quick'] else 'full scale'}; {cfg['encoder']} encoder, "
             f"{cfg['attention']} attention, hidden {cfg['scale']['hidden_dim']}, {cfg['scale']['steps']} steps, "
             f"{cfg['seeds']} seeds, backend {cfg['backend']}. Values: mean ± std over seeds at the end of "
             "training, on held-out sentences. τ: Kendall's tau per sentence, averaged. τ(a, r) on the support: "
             "over the tokens with non-zero attention only (sentences with at least 3 of them; 'coverage' is "
             "their fraction): over all tokens, the exact zeros of sparse attention are ties that τ counts.", ""]
    for ds, cells in s.items():
        lines += [f"## {ds}", ""]
        rows = []
        for norm, c in cells.items():
            rows.append([norm, f(c.get("acc_standard")), f(c.get("acc_uniform")),
                         f(c.get("tau_a_r_standard")), f(c.get("tau_a_r_standard_support")),
                         f(c.get("support_coverage")), f(c.get("tau_runiform_a_standard")),
                         f(c.get("tau_runiform_a_standard_shuffled")), f(c.get("top1_runiform_a_standard")),
                         f(c.get("top1_shuffled_baseline"))])
        lines.append(md_table(["normalizer", "acc standard", "acc uniform", "τ(a, r) standard",
                               "τ(a, r) on the support", "coverage", "τ(r' uniform, a standard)", "shuffled",
                               "top-1 match", "shuffled top-1"], rows))
        if ds == "keyword":
            rows = [[norm, f(c.get("keyword_attention_standard")), f(c.get("keyword_r_uniform")),
                     f(c.get("other_r_uniform")), f(c.get("early_keyword_minus_other_r_uniform"))]
                    for norm, c in cells.items()]
            lines.append(md_table(["normalizer", "attention on keyword (standard)", "r' at keywords (uniform)",
                                   "r' elsewhere (uniform)", "r' keyword − other, first evaluation"], rows))
    lines += ["## The paper's claims", ""] + [f"- {v}" for v in PAPER.values()] + [""]
    return markdown_end(lines, result)


def reading(summary) -> str:
    parts = []
    for ds, cells in summary.items():
        for norm, c in cells.items():
            t, sh = c.get("tau_runiform_a_standard"), c.get("tau_runiform_a_standard_shuffled")
            tar = c.get("tau_a_r_standard")
            tsup, cov = c.get("tau_a_r_standard_support"), c.get("support_coverage")
            if t and sh and tar:
                on_support = (f" ({tsup[0]:.2f} on the support, {cov[0]:.0%} of sentences)"
                              if tsup and cov and np.isfinite(tsup[0]) else "")
                parts.append(f"{ds}/{norm}: τ(a, r) = {tar[0]:.2f}{on_support}; τ(r' uniform, a standard) = "
                             f"{t[0]:.2f} vs {sh[0]:.2f} shuffled")
            if ds == "keyword" and c.get("keyword_r_uniform"):
                parts.append(f"keyword/{norm}: under uniform attention r' at keywords {c['keyword_r_uniform'][0]:.2f}"
                             f" vs {c['other_r_uniform'][0]:.2f} elsewhere")
    return "; ".join(parts) + "." if parts else "No complete runs."


def run(args) -> dict:
    jobs, scale, seeds = jobs_for(args)
    sweep = run_sweep(args, train_pair, jobs)
    summary = summarize(args, sweep, seeds)
    config = {**common_config(args), "datasets": list(args.datasets), "encoder": args.encoder,
              "attention": args.attention, "seeds": seeds, "scale": scale}
    return write_dynamics_result(args, NAME, config, markdown, paper=PAPER, summary=summary, sweep=sweep_block(sweep),
                                 reading=reading(summary), plots=plot(args.out, summary))
