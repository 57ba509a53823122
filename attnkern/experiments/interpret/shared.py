"""Shared machinery of the interpretability experiments (importance, permutation, adversarial, erasure).

All of them look at a trained :class:`~attnkern.experiments.models.AttentionClassifier` through the same three
quantities of one batch, computed once with the encoder fixed:

- the hidden states ``h`` (B, T, D) and the raw attention scores ``s`` (B, T) of the learned query;
- the attention ``a`` (B, T) = normalizer(s) over the real positions (exact zeros outside a sparse support);
- the output relevance ``R`` (B, T, C) and the output bias ``b`` (C), so that ``logits = Σ_t a_t R_t + b``.

With ``R`` and ``b`` in hand, any other attention distribution (a permutation, an adversary, an erasure) is scored
without running the encoder again: that is the paper's "h is not changed" protocol, done exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkern.experiments.interpret.metrics import tvd

# What the experiments' modules (and their tests) use from here.
__all__ = [
    "add_model_arguments",
    "by_max_attention",
    "check_model_arguments",
    "decode",
    "density_grid",
    "draw_density",
    "encode_batch",
    "Encoded",
    "gradient_importance",
    "group_runs",
    "instance_record",
    "KDE_MIN_POINTS",
    "leave_one_out_importance",
    "markdown_head",
    "markdown_tail",
    "max_attention_cell",
    "max_attention_header",
    "model_jobs",
    "model_rows",
    "n_seeds",
    "normalize_scores",
    "output_probs",
    "panel_grid",
    "run_model_jobs",
    "scale_note",
    "scatter_grid",
    "test_batches",
    "trained_from_config",
    "write_result",
]


@dataclass
class Encoded:
    """One batch seen through a trained classifier with the encoder fixed (all tensors detached).

    tokens, mask: (B, T) int64 ids and bool mask (True = real token).
    hidden: (B, T, D); scores: (B, T) raw attention scores (masked positions are not meaningful);
    weights: (B, T) the model's attention; relevance: (B, T, C); bias: (C,);
    probs: (B, C) the model's output distribution; pred: (B,) its decision.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    hidden: torch.Tensor
    scores: torch.Tensor
    weights: torch.Tensor
    relevance: torch.Tensor
    bias: torch.Tensor
    probs: torch.Tensor
    pred: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1)


def _query(model, batch: int) -> torch.Tensor:
    return model.query.expand(batch, -1)


@torch.no_grad()
def encode_batch(model, tokens: torch.Tensor, mask: torch.Tensor) -> Encoded:
    """Run the encoder once and collect everything the experiments need (see :class:`Encoded`)."""
    model.eval()
    h = model.encode(tokens, mask)
    scores = model.attention.scores(_query(model, h.shape[0]), h)
    _, weights = model.attend(h, mask)
    relevance = model.relevance(h)
    bias = model.output.bias.detach()
    probs = decode(weights, relevance, bias)
    return Encoded(tokens, mask, h, scores, weights, relevance, bias, probs, probs.argmax(-1))


def decode(weights: torch.Tensor, relevance: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Output distribution (..., C) for attention ``weights`` (..., T) over fixed ``relevance`` (..., T, C)."""
    logits = torch.einsum("...t,...tc->...c", weights, relevance) + bias
    return torch.softmax(logits, dim=-1)


def normalize_scores(model, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's own normalizer (softmax, sparsemax or entmax on attnkern kernels) applied to ``scores`` (B, T)
    over the True positions of ``mask``; differentiable."""
    return model.attention.normalize(scores, mask)


def output_probs(model, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's output distribution (B, C) for a batch (no gradient)."""
    with torch.no_grad():
        return torch.softmax(model(tokens, mask).logits, dim=-1)


def gradient_importance(model, enc: Encoded) -> torch.Tensor:
    """Gradient × input importance per token, ``|Σ_d ∂ŷ/∂e_td · e_td|`` (B, T), zero at padding.

    ŷ is the probability of the predicted class; the attention is held at its value (detached), as in Jain &
    Wallace's Algorithm 1, so only the path through the encoder counts. Computed with captum's InputXGradient.
    """
    from captum.attr import InputXGradient

    model.eval()
    weights = enc.weights.detach()
    tokens, mask = enc.tokens, enc.mask

    def forward(embeddings, tokens, mask, weights):
        logits = model(tokens, mask, weights=weights, embeddings=embeddings).logits
        return torch.softmax(logits, dim=-1)

    with torch.no_grad():
        emb = model.embed(tokens)
    emb.requires_grad_(True)
    attr = InputXGradient(forward).attribute(emb, target=enc.pred, additional_forward_args=(tokens, mask, weights))
    return (attr.sum(-1).abs() * mask.to(attr.dtype)).detach()


@torch.no_grad()
def leave_one_out_importance(model, enc: Encoded, chunk: int = 256) -> list[torch.Tensor]:
    """Leave-one-out importance per instance: ``TVD(ŷ(x_{-t}), ŷ(x))`` for each real token t, the token removed
    from the sequence (the rest closes up). Returns one (n_i,) tensor per instance (empty for n_i < 2: removing the
    only token leaves nothing to classify).

    With a non-contextual encoder (the average encoder: each token's hidden state and score depend on that token
    alone) and a normalizer of the entmax family, removing a token of zero attention weight leaves the support,
    its weights and the output unchanged, so its importance is exactly 0 and is set so: computed, it is rounding
    noise whose size depends on the BLAS's blocking, and Kendall's τ would rank it against the ties of sparse
    attention's zeros differently on different CPUs."""
    model.eval()
    exact_zeros = _removal_leaves_zero_weights_out(model)
    out = []
    for i in range(enc.tokens.shape[0]):
        n = int(enc.lengths[i])
        if n < 2:
            out.append(torch.zeros(0))
            continue
        x = enc.tokens[i, :n]
        keep = ~torch.eye(n, dtype=torch.bool)
        variants = x.unsqueeze(0).expand(n, n)[keep].view(n, n - 1)
        vmask = torch.ones_like(variants, dtype=torch.bool)
        deltas = []
        for start in range(0, n, chunk):
            p = output_probs(model, variants[start:start + chunk], vmask[start:start + chunk])
            deltas.append(tvd(p, enc.probs[i].unsqueeze(0)))
        delta = torch.cat(deltas).float()
        out.append(delta.masked_fill(enc.weights[i, :n] == 0, 0.0) if exact_zeros else delta)
    return out


def _removal_leaves_zero_weights_out(model) -> bool:
    """Whether removing a token of zero attention weight leaves the model's output exactly unchanged: tokens
    encoded one by one (the average encoder), and a normalizer whose weights on the other tokens do not depend
    on an entry outside its support (the entmax family; the structured ones couple neighbours)."""
    from attnkern.family import NORMALIZERS

    return (getattr(model, "encoder_kind", None) == "average"
            and getattr(getattr(model, "attention", None), "normalizer", None) in NORMALIZERS)


# --- experiment scaffolding: options, one job per trained model, test instances ----------------------------------


def add_model_arguments(parser, instances_help: str = "test instances analysed per model") -> None:
    """The options every interpretability experiment shares (the CLI adds --out, --quick, --seeds, ...)."""
    from attnkern.experiments.interpret.classifiers import DATASETS, ENCODERS

    parser.add_argument("--dataset", "--datasets", dest="datasets", nargs="+", default=list(DATASETS),
                        help=f"datasets ({', '.join(DATASETS)})")
    parser.add_argument("--encoders", nargs="+", default=list(ENCODERS), help=f"encoders ({', '.join(ENCODERS)})")
    parser.add_argument("--instances", type=int, default=None,
                        help=f"{instances_help} (default: all; 100 with --quick)")
    parser.add_argument("--embeddings", default="scratch",
                        help="scratch (default) or word2vec: word vectors trained here on unlabelled text "
                             "without the test split (needs `attnkern-exp data fetch all`)")


def check_model_arguments(args) -> None:
    """ValueError naming the argument for bad --dataset / --encoders / --instances."""
    from attnkern.experiments.interpret.classifiers import DATASETS, ENCODERS, check_choices
    from attnkern.experiments.interpret.embeddings import EMBEDDINGS

    args.datasets = check_choices(args.datasets, DATASETS, "argument --dataset")
    args.encoders = check_choices(args.encoders, ENCODERS, "argument --encoders")
    check_choices([args.embeddings], EMBEDDINGS, "argument --embeddings")
    if args.instances is not None and args.instances < 1:
        raise ValueError(f"argument --instances: must be a positive int, got {args.instances}")


def n_seeds(args) -> int:
    if getattr(args, "seeds", None):
        return args.seeds
    return 1 if args.quick else 3


def n_instances(args) -> int | None:
    if args.instances is not None:
        return args.instances
    return 100 if args.quick else None


def model_jobs(args, experiment: str, extra: dict | None = None, normalizers=None, modes=("learned",)):
    """One runner job per (dataset, encoder, normalizer, mode, seed); the job's config holds the full
    :class:`TrainConfig`, the output folder (where the models are cached) and the analysis options."""
    from dataclasses import asdict

    from attnkern.experiments.interpret.classifiers import train_config
    from attnkern.experiments.runner import Job

    jobs = []
    for dataset in args.datasets:
        for encoder in args.encoders:
            for normalizer in normalizers or args.normalizers:
                for mode in modes:
                    for seed in range(n_seeds(args)):
                        cfg = train_config(dataset, encoder, normalizer, seed, args.quick, mode=mode,
                                           backend=args.backend, embeddings=args.embeddings)
                        config = {"train": asdict(cfg), "out": str(args.out), "instances": n_instances(args),
                                  **(extra or {})}
                        jobs.append(Job(f"{experiment}/{cfg.name()}", config, seed))
    return jobs


def run_model_jobs(fn, jobs, args, experiment: str):
    """Runs the jobs through the shared runner (joblib or dask, cached under <out>/cache/<experiment>)."""
    from attnkern.experiments.common import run_sweep

    return run_sweep(args, fn, jobs, desc=experiment, namespace=experiment)


def trained_from_config(config: dict, frozen: bool = False):
    """The trained classifier of a job's config (trained now, or loaded from the model cache); with ``frozen``,
    its parameters no longer require grad (for analyses that differentiate through attention only)."""
    from attnkern.experiments.interpret.classifiers import TrainConfig, get_classifier

    trained = get_classifier(TrainConfig(**config["train"]), config["out"])
    if frozen:
        for p in trained.model.parameters():
            p.requires_grad_(False)
    return trained


def test_batches(trained, instances: int | None, batch_size: int = 32):
    """Encoded batches (see :class:`Encoded`) of the first ``instances`` test documents (all when None), with
    their gold labels."""
    from attnkern.experiments.data.text import pad_batch

    seqs, labels = trained.data.test
    n = len(seqs) if instances is None else min(instances, len(seqs))
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        tokens, mask = pad_batch(seqs[start:stop])
        yield encode_batch(trained.model, tokens, mask), torch.as_tensor(labels[start:stop])


def group_runs(sweep, keys=("dataset", "encoder", "normalizer")) -> dict:
    """Job records grouped by the (dataset, encoder, normalizer) of their model: {key tuple: [result, ...]}."""
    groups: dict = {}
    for name in sorted(sweep.results):
        rec = sweep.results[name]
        train = rec["meta"]["config"]["train"]
        groups.setdefault(tuple(train[k] for k in keys), []).append(rec["result"])
    return groups


def scale_note(result: dict) -> str:
    """One line saying at which scale a result was measured."""
    inst = result.get("instances")
    scale = "quick configuration (small models, few epochs)" if result.get("quick") else "full configuration"
    vectors = {"scratch": "embeddings trained from scratch",
               "word2vec": "embeddings starting from word2vec vectors trained without the test split"}
    return (f"*{scale}; {vectors[result.get('embeddings', 'scratch')]}; {result.get('seeds')} seed(s) per model; "
            f"{'all' if inst is None else f'at most {inst}'} test instances per model.*")


# Bins of the largest attention weight of an instance, for the summaries of
# the permutation and adversarial experiments.
MAX_ATTENTION_BINS = (0.0, 0.25, 0.5, 0.75, 1.0001)


def by_max_attention(max_attention, values, name: str) -> list[dict]:
    """Mean of `values` (one per instance) within each bin of max attention."""
    import math

    import numpy as np

    mx, vals = np.asarray(max_attention, dtype=float), np.asarray(values, dtype=float)
    bins = []
    for lo, hi in zip(MAX_ATTENTION_BINS[:-1], MAX_ATTENTION_BINS[1:], strict=True):
        sel = (mx >= lo) & (mx < hi)
        bins.append({"max_attention_from": lo, "max_attention_to": min(hi, 1.0), "instances": int(sel.sum()),
                     name: float(vals[sel].mean()) if sel.any() else math.nan})
    return bins


def max_attention_header(label: str) -> str:
    """Column header for :func:`max_attention_cell` of a statistic called ``label``."""
    return f"{label} (n) by max a in [0,.25) / [.25,.5) / [.5,.75) / [.75,1]"


def max_attention_cell(bins: list[dict], name: str) -> str:
    """The ``name`` means of :func:`by_max_attention`'s bins with their instance counts, one table cell."""
    return " / ".join("–" if b["instances"] == 0 else f"{b[name]:.3f} ({b['instances']})" for b in bins)


def instance_record(per: dict, enc: Encoded, i: int) -> int:
    """Appends instance ``i`` of a batch's predicted class, length and largest attention weight to the lists
    ``per["pred"]``, ``per["length"]`` and ``per["max_attention"]``; returns its length."""
    n = int(enc.lengths[i])
    per["pred"].append(int(enc.pred[i]))
    per["length"].append(n)
    per["max_attention"].append(float(enc.weights[i, :n].max()))
    return n


def merge_instances(results: list[dict]) -> dict:
    """The per-instance lists of one model's seeds (``result["per_instance"]``), concatenated in seed order."""
    merged: dict = {k: [] for k in results[0]["per_instance"]}
    for r in results:
        for k, v in r["per_instance"].items():
            merged[k].extend(v)
    return merged


def model_rows(sweep, fields) -> tuple[list[dict], dict]:
    """One table row per (dataset, encoder, normalizer) model of a sweep, in sorted order: the key, the mean test
    accuracy over seeds, the number of seeds, then ``fields(key, per)`` (the experiment's statistics of the merged
    per-instance lists). Returns (rows, {key: merged per-instance lists}) for the plots."""
    import numpy as np

    rows, merged = [], {}
    for key, results in sorted(group_runs(sweep).items()):
        per = merge_instances(results)
        merged[key] = per
        rows.append({"dataset": key[0], "encoder": key[1], "normalizer": key[2],
                     "accuracy": float(np.mean([r["test_accuracy"] for r in results])), "seeds": len(results),
                     **fields(key, per)})
    return rows, merged


def write_result(args, experiment: str, sweep, markdown, **fields) -> dict:
    """The experiment's result: its name, scale (--quick, instances, seeds per model), ``fields`` (options, rows,
    plots, ...) and the sweep's bookkeeping, written as OUT/<experiment>.json and .md (``markdown(result)``)."""
    from attnkern.experiments.common import invocation_meta, sweep_block, write_outputs

    config = {"backend": args.backend, "device": getattr(args, "device", "cpu")}
    result = {"experiment": experiment, "quick": args.quick, "instances": n_instances(args), "seeds": n_seeds(args),
              "embeddings": args.embeddings, **fields, "meta": invocation_meta(config),
              "sweep": sweep_block(sweep)}
    write_outputs(args.out, experiment, result, markdown(result))
    return result


def markdown_head(title: str, intro: str, result: dict) -> list[str]:
    """The first lines of an experiment's markdown: heading, what was measured, at which scale."""
    return [f"# {title}", "", intro, "", scale_note(result), ""]


def markdown_tail(lines: list[str], result: dict) -> str:
    """The markdown's lines, the result's plots and the list of failed runs, as one text."""
    from attnkern.experiments.common import failures_md

    lines = lines + [f"![{p}]({p})" for p in result["plots"]]
    return "\n".join(lines) + "\n" + failures_md(result["sweep"]["failures"])


def panel_grid(merged: dict, out, experiment: str, title: str, draw, x_label: str, y_label: str | None = None,
               sharey: bool = True, panel_height: float = 2.6, legend: bool = True) -> list[str]:
    """One figure per dataset, OUT/<experiment>_<dataset>.png, with a panel per (encoder, normalizer) (rows:
    encoders, columns: normalizers; a missing model leaves its panel empty) drawn by ``draw(ax, key, per)``.
    merged: {(dataset, encoder, normalizer): per-instance lists}. Returns the file names."""
    from attnkern.experiments.common import pyplot, save_figure
    from attnkern.experiments.interpret.classifiers import DATASETS

    plt = pyplot()
    files = []
    for dataset in sorted({k[0] for k in merged}):
        keys = sorted(k for k in merged if k[0] == dataset)
        encoders = sorted({k[1] for k in keys})
        normalizers = sorted({k[2] for k in keys})
        fig, axes = plt.subplots(len(encoders), len(normalizers), figsize=(3.2 * len(normalizers),
                                 panel_height * len(encoders)), squeeze=False, sharex=True, sharey=sharey)
        for r, encoder in enumerate(encoders):
            for c, normalizer in enumerate(normalizers):
                ax = axes[r][c]
                per = merged.get((dataset, encoder, normalizer))
                if per is None:
                    ax.axis("off")
                    continue
                draw(ax, (dataset, encoder, normalizer), per)
                ax.set_title(f"{encoder} / {normalizer}", fontsize=9)
                if r == len(encoders) - 1:
                    ax.set_xlabel(x_label)
                if c == 0 and y_label is not None:
                    ax.set_ylabel(y_label)
        if legend:
            axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{DATASETS[dataset].title}\n{title}", fontsize=9)
        files.append(save_figure(fig, out, f"{experiment}_{dataset}.png"))
    return files


def scatter_grid(merged: dict, out, experiment: str, x_key: str, x_label: str, title: str,
                 xlim=None) -> list[str]:
    """One figure per dataset: a panel per (encoder, normalizer) with each test
    instance's `x_key` against its max attention, coloured by predicted class.
    merged: {(dataset, encoder, normalizer): per-instance lists}. Returns the file names."""
    import numpy as np

    def draw(ax, key, per):
        preds = np.asarray(per["pred"])
        for cls in sorted(set(preds.tolist())):
            sel = preds == cls
            ax.scatter(np.asarray(per[x_key])[sel], np.asarray(per["max_attention"])[sel], s=6, alpha=0.6,
                       label=f"pred {cls}")
        if xlim is not None:
            ax.set_xlim(*xlim)

    return panel_grid(merged, out, experiment, title, draw, x_label, "max attention")


# A panel gets kernel-density contours from this many instances on; fewer give a 2-D histogram.
KDE_MIN_POINTS = 20


def _spread_in_2d(x, y) -> bool:
    """Whether points (x, y) vary in two directions (not all on one line), as a 2-D kernel density needs."""
    import numpy as np

    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return False
    r = np.corrcoef(x, y)[0, 1]
    return bool(np.isfinite(r) and 1 - r * r > 1e-6)


def draw_density(ax, x, y, xlim: tuple[float, float], ylim: tuple[float, float], bins: int = 20) -> str:
    """The density of the points (x, y) in one panel over ``xlim`` × ``ylim``: filled contours of a Gaussian
    kernel density estimate (scipy.stats.gaussian_kde, Scott's bandwidth; the lowest twentieth of the peak left
    blank) when there are at least KDE_MIN_POINTS finite points not all on one line, else a 2-D histogram of
    ``bins`` × ``bins`` cells (empty cells blank). Returns "kde" or "histogram"."""
    import numpy as np
    from scipy.stats import gaussian_kde

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if x.size >= KDE_MIN_POINTS and _spread_in_2d(x, y):
        try:
            kde = gaussian_kde(np.vstack([x, y]))
        except np.linalg.LinAlgError:  # numerically singular covariance after all
            kde = None
        if kde is not None:
            gx, gy = np.meshgrid(np.linspace(*xlim, 100), np.linspace(*ylim, 100))
            z = kde(np.vstack([gx.ravel(), gy.ravel()])).reshape(gx.shape)
            if z.max() > 0:
                ax.contourf(gx, gy, z, levels=np.linspace(z.max() / 20, z.max(), 10), cmap="viridis")
                ax.set_xlim(*xlim)
                ax.set_ylim(*ylim)
                return "kde"
    ax.hist2d(x, y, bins=bins, range=[list(xlim), list(ylim)], cmap="viridis", cmin=1)
    return "histogram"


def density_grid(merged: dict, out, experiment: str, x_key: str, y_key: str, x_label: str, y_label: str,
                 title: str, xlim: tuple[float, float] = (0.0, 1.0)) -> list[str]:
    """One figure per dataset: a panel per (encoder, normalizer) with the density (:func:`draw_density`) of the
    test instances over (`x_key`, `y_key`) and their number; the y range, from 0 to just above the largest value
    in the dataset's panels, is the same in every panel of a figure. merged: {(dataset, encoder, normalizer):
    per-instance lists}. Returns the file names."""
    import numpy as np

    top: dict = {}
    for key, per in merged.items():
        y = np.asarray(per[y_key], dtype=float)
        y = y[np.isfinite(y)]
        top[key[0]] = max(top.get(key[0], 0.0), float(y.max()) if y.size else 0.0)

    def draw(ax, key, per):
        draw_density(ax, per[x_key], per[y_key], xlim, (0.0, max(top[key[0]], 1e-3) * 1.05))
        ax.text(0.03, 0.95, f"n = {len(per[y_key])}", transform=ax.transAxes, fontsize=7, va="top",
                bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0})

    return panel_grid(merged, out, experiment, title, draw, x_label, y_label, legend=False)
