"""Diagnostic MLP: do a trained model's attention weights help a simpler model? (Wiegreffe & Pinter 2019, §5)

The diagnostic model has no context: each token's embedding goes through one tanh layer (our ``average``
encoder, which is how the authors' code configures theirs), the attention-weighted sum of those vectors through a
linear output. It is trained three ways on the same split and seed:

- with uniform weights (1/n; the same model for every normalizer);
- with its own attention, learned with the normalizer;
- with its weights imposed per instance and frozen: the attention of a trained contextual model (the "guide",
  the BiLSTM or CNN of ``--encoders``, with the same normalizer), on the training documents while it learns and
  on the test documents when it is scored.

- with the attention of the guide's deceptive model imposed (``--deceptive-lambda``, default 1; the baselines
  experiment's deceptive model with the JSD objective, trained from scratch, or fine-tuned from the guide for one
  epoch with ``--quick``): the attention that keeps the guide's predictions while lying far from its attention.

If the guide's weights let the diagnostic model beat uniform weights and approach or pass its own learned
attention, while the deceptive weights do not, they say something about which tokens matter that does not depend
on the model that produced them: Wiegreffe & Pinter's argument that such weights are meaningful. Test accuracy and
macro-F1; the guide's own accuracy beside them.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from attnkern.experiments.common import md_table
from attnkern.experiments.interpret import baselines, classifiers, shared
from attnkern.experiments.interpret.metrics import macro_f1

NAME = "diagnostic"
GUIDE_ENCODERS = ("bilstm", "cnn")
# The guided diagnostic model of a guide with seed s starts from initialisation seed s + this.
GUIDED_INIT_OFFSET = 3000


def add_arguments(parser) -> None:
    shared.add_model_arguments(parser)
    parser.set_defaults(encoders=list(GUIDE_ENCODERS))
    parser.add_argument("--deceptive-lambda", type=float, default=1.0,
                        help="λ of the deceptive model whose attention is imposed in the last row (default 1; "
                             "0 leaves the row out)")


def check_arguments(args) -> None:
    """ValueError naming the argument (the CLI checks before it creates the output directory)."""
    shared.check_model_arguments(args)
    if not (args.deceptive_lambda >= 0 and math.isfinite(args.deceptive_lambda)):
        raise ValueError(f"argument --deceptive-lambda: must be finite and >= 0, got {args.deceptive_lambda}")
    if "average" in args.encoders:
        raise ValueError("argument --encoders: the guides are contextual encoders (bilstm, cnn); the average "
                         "encoder is the diagnostic model itself")


@torch.no_grad()
def guide_weights(model, seqs, batch_size: int = 64) -> list[torch.Tensor]:
    """The guide model's attention over the tokens of each document (one (n_i,) tensor each)."""
    model.eval()
    out = []
    for start in range(0, len(seqs), batch_size):
        tokens, mask = classifiers.pad_batch(seqs[start:start + batch_size])
        weights = model(tokens, mask).weights
        out.extend(w[m] for w, m in zip(weights, mask, strict=True))
    return out


def _padded(weights: list[torch.Tensor], idx, length: int) -> torch.Tensor:
    w = torch.zeros(len(idx), length)
    for row, i in enumerate(idx):
        w[row, : weights[i].shape[0]] = weights[i]
    return w


@torch.no_grad()
def _scores(model, split, weights: list[torch.Tensor], batch_size: int = 64) -> tuple[float, float]:
    """(accuracy, macro-F1) of ``model`` on ``split`` with the imposed per-document ``weights``."""
    seqs, labels = split
    model.eval()
    preds = []
    for start in range(0, len(seqs), batch_size):
        idx = list(range(start, min(start + batch_size, len(seqs))))
        tokens, mask = classifiers.pad_batch([seqs[i] for i in idx])
        preds.append(model(tokens, mask, weights=_padded(weights, idx, tokens.shape[1])).logits.argmax(-1))
    pred = torch.cat(preds).numpy()
    return float((pred == labels).mean()), macro_f1(pred, labels)


def train_guided(cfg: classifiers.TrainConfig, data: classifiers.TextData, weights: dict) -> dict:
    """Trains the diagnostic model of ``cfg`` (the average encoder) with the imposed ``weights`` ({"train",
    "dev", "test"}: per-document tensors) for ``cfg.epochs`` epochs with Adam, keeping the epoch with the best
    dev accuracy; returns its test accuracy and macro-F1 and the best epoch."""
    init_seed = cfg.training_seed + GUIDED_INIT_OFFSET
    torch.manual_seed(init_seed)
    model = classifiers.build_model(cfg, len(data.vocab), data.num_classes)
    # the imposed weights replace the attention: its scorer and query get no gradient
    params = [p for name, p in model.named_parameters() if not name.startswith(("attention.", "query"))]
    opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(init_seed)
    seqs, labels = data.train
    best, best_state, best_epoch = -1.0, None, 0
    for epoch in range(cfg.epochs):
        model.train()
        for idx in classifiers.batches(len(seqs), cfg.batch_size, rng):
            tokens, mask = classifiers.pad_batch([seqs[i] for i in idx])
            logits = model(tokens, mask, weights=_padded(weights["train"], idx, tokens.shape[1])).logits
            loss = F.cross_entropy(logits, torch.as_tensor(labels[idx], dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            opt.step()
        dev, _ = _scores(model, data.dev, weights["dev"])
        if dev > best:
            best, best_epoch = dev, epoch + 1
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    accuracy, f1 = _scores(model, data.test, weights["test"])
    return {"accuracy": accuracy, "macro_f1": f1, "best_epoch": best_epoch}


def analyse(config: dict, seed: int) -> dict:
    guide_cfg = classifiers.TrainConfig(**config["train"])
    out = config["out"]
    guide = classifiers.get_classifier(guide_cfg, out)
    mlp_cfg = replace(guide_cfg, encoder="average")
    learned = classifiers.get_classifier(mlp_cfg, out)
    uniform = classifiers.get_classifier(replace(mlp_cfg, mode="uniform", normalizer="softmax"), out)
    data = guide.data
    weights = {name: guide_weights(guide.model, getattr(data, name)[0]) for name in ("train", "dev", "test")}
    result = {name: {"accuracy": t.info["test_accuracy"], "macro_f1": t.info["test_macro_f1"]}
              for name, t in (("guide", guide), ("learned", learned), ("uniform", uniform))}
    result["guided"] = train_guided(mlp_cfg, data, weights)
    lam = config["deceptive_lambda"]
    if lam > 0:
        start = "base" if config["quick"] else "scratch"
        _, path = baselines.get_deceptive(guide, lam, "jsd", out, start,
                                          baselines.QUICK_DECEPTIVE_EPOCHS if config["quick"] else None)
        deceptive = baselines.load_deceptive(guide, path)
        weights = {name: guide_weights(deceptive, getattr(data, name)[0]) for name in ("train", "dev", "test")}
        result["guided_deceptive"] = train_guided(mlp_cfg, data, weights)
    return result


def run(args) -> dict:
    check_arguments(args)
    jobs = shared.model_jobs(args, NAME, extra={"deceptive_lambda": args.deceptive_lambda, "quick": args.quick})
    sweep = shared.run_model_jobs(analyse, jobs, args, NAME)
    rows = []
    for (dataset, encoder, normalizer), results in sorted(shared.group_runs(sweep).items()):
        row = {"dataset": dataset, "guide": encoder, "normalizer": normalizer, "seeds": len(results)}
        names = ("uniform", "learned", "guided", "guided_deceptive", "guide")
        for name in (n for n in names if n in results[0]):
            for key in ("accuracy", "macro_f1"):
                values = [r[name][key] for r in results]
                row[f"{name}_{key}"] = float(np.mean(values))
                row[f"{name}_{key}_std"] = float(np.std(values))
        rows.append(row)
    return shared.write_result(args, NAME, sweep, markdown, rows=rows, deceptive_lambda=args.deceptive_lambda,
                               plots=[])


def markdown(result: dict) -> str:
    lines = shared.markdown_head(
        "Diagnostic MLP guided by trained attention (Wiegreffe & Pinter 2019, §5)",
        "Test accuracy (macro-F1) of a model without context (one tanh layer per token, attention-weighted "
        "sum, linear output) with uniform weights, with its own learned attention, with the attention of a "
        "trained contextual model (the guide) imposed and frozen, and with the attention of the guide's "
        "deceptive model (JSD objective) imposed; the guide's own score beside. Mean over seeds (± std when "
        "there are several). Wiegreffe & Pinter found that the weights of a trained LSTM guide the MLP better "
        "than uniform weights and about as well as its own, and a deceptive model's weights worse.", result)
    def cell(r, name):
        if f"{name}_accuracy" not in r:
            return "–"
        spread = f" ± {r[f'{name}_accuracy_std']:.3f}" if r["seeds"] > 1 else ""
        return f"{r[f'{name}_accuracy']:.3f}{spread} ({r[f'{name}_macro_f1']:.3f})"

    body = [[r["dataset"], r["guide"], r["normalizer"], r["seeds"], cell(r, "uniform"), cell(r, "learned"),
             cell(r, "guided"), cell(r, "guided_deceptive"), cell(r, "guide")] for r in result["rows"]]
    lam = result.get("deceptive_lambda")
    lines.append(md_table(["dataset", "guide", "normalizer", "seeds", "MLP, uniform", "MLP, own attention",
                           "MLP, guide's attention", f"MLP, deceptive guide's attention (λ = {lam:g})" if lam else
                           "MLP, deceptive guide's attention", "guide itself"], body))
    return shared.markdown_tail(lines, result)
