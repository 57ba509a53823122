"""Baselines: is learned attention needed, and can a model be trained to attend elsewhere? (Wiegreffe & Pinter 2019)

- Uniform attention (weights fixed to 1/n, Wiegreffe & Pinter's baseline) and frozen random attention (the scorer
  and query left at their random initialisation) against the learned attention: test accuracy and macro-F1.
- Seed variance: a model trained on the same split from another initialisation, compared with the base model as
  the deceptive models are (Wiegreffe & Pinter's yardstick for how far attention moves by chance).
- The deceptive (adversarial) model, trained to reproduce the base (learned) model's predictions while attending
  differently: per training instance the loss ``TVD(ŷ_adv, ŷ_base) − λ·D(a_adv, a_base)``, for each λ. As in
  Wiegreffe & Pinter's code it is a freshly initialised model (``--deceptive-start scratch``, the full
  configuration's default) trained for as many epochs as the base model, with Adam (amsgrad) and weight decay on
  everything but the attention scorer, keeping the epoch with the best dev objective; ``--deceptive-start base``
  fine-tunes a copy of the base model instead (the quick configuration's default: one epoch). D is, for every
  normalizer, the Jensen-Shannon divergence (so the rows of all normalizers optimise one objective), and for
  softmax models also Wiegreffe & Pinter's own KL(a_adv ‖ a_base) (their ``KLDivLoss(log a_base, a_adv)``);
  KL is infinite between sparse distributions whose supports differ, so sparse models get only the JSD rows.
  Reported on the test split: accuracy, mean TVD to the base model's predictions and mean JSD between the two
  attentions. Not followed: their per-class weighting of the loss (our splits are close to balanced).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from attnkern.experiments import provenance
from attnkern.experiments.common import invocation_meta, md_table, pyplot, save_figure, sweep_block, write_outputs
from attnkern.experiments.interpret import classifiers, shared
from attnkern.experiments.interpret.metrics import jsd, tvd

NAME = "baselines"
DEFAULT_LAMBDAS = (0.001, 0.01, 0.1, 1.0)
QUICK_DECEPTIVE_EPOCHS = 1
# The seed-variance model of a base model with seed s is trained on s's split from initialisation seed s + this.
SEED_VARIANCE_OFFSET = 1000
# A deceptive model trained from scratch starts from initialisation seed s + this (neither the base model's nor
# the seed-variance model's).
DECEPTIVE_INIT_OFFSET = 2000
DECEPTIVE_STARTS = ("scratch", "base")
_FLOOR = 1e-12  # keeps log q finite where float32 softmax underflows to 0


def add_arguments(parser) -> None:
    shared.add_model_arguments(parser, instances_help="(unused: baselines evaluate the whole test split)")
    parser.add_argument("--lambdas", nargs="+", type=float, default=None,
                        help="λ of the deceptive models (default 0.001 0.01 0.1 1; 0.01 1 with --quick)")
    parser.add_argument("--deceptive-start", choices=DECEPTIVE_STARTS, default=None,
                        help="scratch: a fresh model trained as long as the base model (Wiegreffe & Pinter; the "
                             "default); base: a copy of the base model fine-tuned (the default with --quick, "
                             "for one epoch)")


def divergences_for(normalizer: str) -> tuple[str, ...]:
    """The attention divergences a deceptive model of ``normalizer`` is trained with: JSD for every normalizer,
    and Wiegreffe & Pinter's KL(a_adv ‖ a_base) where it is finite (softmax, whose weights are all positive)."""
    return ("jsd", "kl") if normalizer == "softmax" else ("jsd",)


DIVERGENCE_LABELS = {"jsd": "JSD", "kl": "KL(a_adv ‖ a_base)"}


def attention_divergence(a_base: torch.Tensor, a_adv: torch.Tensor, divergence: str) -> torch.Tensor:
    """Per row: JSD(a_base, a_adv), or ``"kl"``: KL(a_adv ‖ a_base) (the log of a_base floored, so float32 softmax
    underflow stays finite)."""
    if divergence == "kl":
        terms = a_adv * (torch.log(a_adv.clamp_min(_FLOOR)) - torch.log(a_base.clamp_min(_FLOOR)))
        return torch.where(a_adv > 0, terms, torch.zeros_like(terms)).sum(-1)
    if divergence == "jsd":
        return jsd(a_base, a_adv)
    raise ValueError(f"divergence must be one of {tuple(DIVERGENCE_LABELS)}, got {divergence!r}")


@torch.no_grad()
def _targets(base, split, batch_size: int = 64):
    """The base model's output distributions and attention per document of a split (lists of tensors)."""
    seqs, labels = split
    probs, weights = [], []
    for tokens, mask, _ in classifiers.iterate(seqs, labels, batch_size):
        out = base(tokens, mask)
        probs.extend(torch.softmax(out.logits, -1))
        weights.extend(w[m] for w, m in zip(out.weights, mask, strict=True))
    return probs, weights


def _batch_targets(idx, probs, weights, T):
    p = torch.stack([probs[i] for i in idx])
    w = torch.zeros(len(idx), T)
    for row, i in enumerate(idx):
        w[row, : weights[i].shape[0]] = weights[i]
    return p, w


def deceptive_loss(model, tokens, mask, base_probs, base_weights, divergence: str, lam: float) -> torch.Tensor:
    """The deceptive model's training loss on a batch: mean of TVD(ŷ, ŷ_base) − λ·D(a, a_base)."""
    out = model(tokens, mask)
    q = torch.softmax(out.logits, -1)
    return (tvd(q, base_probs) - lam * attention_divergence(base_weights, out.weights, divergence)).mean()


def deceptive_stats(model, base_targets, split, divergence: str, lam: float, batch_size: int = 64) -> dict:
    """Mean TVD to the base predictions, mean JSD and mean ``divergence`` (divergence_value) between the
    attentions, accuracy, objective."""
    probs, weights = base_targets
    seqs, labels = split
    tv, js, dv, correct = [], [], [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(seqs), batch_size):
            idx = list(range(start, min(start + batch_size, len(seqs))))
            tokens, mask, y = next(classifiers.iterate([seqs[i] for i in idx], labels[idx], len(idx)))
            out = model(tokens, mask)
            p, w = _batch_targets(idx, probs, weights, tokens.shape[1])
            q = torch.softmax(out.logits, -1)
            tv.append(tvd(q, p))
            js.append(jsd(w, out.weights))
            dv.append(attention_divergence(w, out.weights, divergence))
            correct.append(out.logits.argmax(-1) == y)
    tv, js, dv = torch.cat(tv), torch.cat(js), torch.cat(dv)
    return {"accuracy": float(torch.cat(correct).float().mean()), "tvd": float(tv.mean()), "jsd": float(js.mean()),
            "divergence_value": float(dv.mean()), "objective": float(tv.mean() - lam * dv.mean())}


def deceptive_optimizer(model, cfg: classifiers.TrainConfig) -> torch.optim.Optimizer:
    """Adam (amsgrad) with the base model's step size, weight decay on everything but the attention scorer and
    query, as in Wiegreffe & Pinter's code."""
    attention = {id(p) for p in model.attention.parameters()} | {id(model.query)}
    decayed = [p for p in model.parameters() if id(p) not in attention]
    undecayed = [p for p in model.parameters() if id(p) in attention]
    return torch.optim.Adam([{"params": decayed, "weight_decay": cfg.weight_decay},
                             {"params": undecayed, "weight_decay": 0.0}], lr=cfg.lr, amsgrad=True)


def get_deceptive(base: classifiers.Trained, lam: float, divergence: str, out, start: str = "scratch",
                  epochs: int | None = None) -> tuple[dict, Path]:
    """Trains (or finds saved) the deceptive model for ``base``, λ and ``divergence``: from a fresh
    initialisation (``start="scratch"``) or from the base model's parameters (``"base"``), for ``epochs`` epochs
    (default: the base model's); returns its test statistics and the file it is saved in
    (:func:`load_deceptive` reads it)."""
    if start not in DECEPTIVE_STARTS:
        raise ValueError(f"start must be one of {DECEPTIVE_STARTS}, got {start!r}")
    cfg = base.config
    epochs = cfg.epochs if epochs is None else epochs
    tag = "" if epochs == cfg.epochs else f"-e{epochs}"
    # (named after the base model's file, whose fingerprint it inherits, and this module's code)
    code = provenance.code_fingerprint(__name__)
    path = base.path.with_name(f"{base.path.stem}-deceive{lam:g}-{divergence}-{start}{tag}-{code}.pt")
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True)["stats"], path
    data = base.data
    train_targets = _targets(base.model, data.train)
    dev_targets = _targets(base.model, data.dev)
    test_targets = _targets(base.model, data.test)
    seqs = data.train[0]
    init_seed = cfg.training_seed + (DECEPTIVE_INIT_OFFSET if start == "scratch" else 0)
    torch.manual_seed(init_seed)
    model = classifiers.build_model(cfg, len(data.vocab), data.num_classes)
    if start == "base":
        model.load_state_dict(base.model.state_dict())
    rng = np.random.default_rng(init_seed)
    opt = deceptive_optimizer(model, cfg)
    best, best_state = -math.inf, None
    for _ in range(epochs):
        model.train()
        for idx in classifiers.batches(len(seqs), cfg.batch_size, rng):
            tokens, mask = classifiers.pad_batch([seqs[i] for i in idx])
            p, w = _batch_targets(idx, *train_targets, tokens.shape[1])
            loss = deceptive_loss(model, tokens, mask, p, w, divergence, lam)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
        # model selection on dev, by the same objective (lower is better)
        score = -deceptive_stats(model, dev_targets, data.dev, divergence, lam)["objective"]
        if score > best:
            best, best_state = score, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    stats = deceptive_stats(model, test_targets, data.test, divergence, lam)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict(), "stats": stats, "lambda": lam, "divergence": divergence,
                "start": start, "config": asdict(cfg)}, path)
    return stats, path


def load_deceptive(base: classifiers.Trained, path: Path):
    """The deceptive model of ``base`` saved in ``path`` by :func:`get_deceptive`, in eval mode."""
    model = classifiers.build_model(base.config, len(base.data.vocab), base.data.num_classes)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
    return model.eval()


def analyse(config: dict, seed: int) -> dict:
    cfg = classifiers.TrainConfig(**config["train"])
    out = config["out"]
    learned = classifiers.get_classifier(cfg, out)
    random_ = classifiers.get_classifier(replace(cfg, mode="random"), out)
    uniform = classifiers.get_classifier(replace(cfg, mode="uniform", normalizer="softmax"), out)
    result = {}
    for name, trained in (("learned", learned), ("random", random_), ("uniform", uniform)):
        result[name] = {"accuracy": trained.info["test_accuracy"], "macro_f1": trained.info["test_macro_f1"]}
    base_stats = deceptive_stats(learned.model, _targets(learned.model, learned.data.test), learned.data.test,
                                 "jsd", 0.0)
    result["deceptive"] = []
    for divergence in divergences_for(cfg.normalizer):
        for lam in config["lambdas"]:
            stats, _ = get_deceptive(learned, lam, divergence, out, config["deceptive_start"],
                                     config.get("deceptive_epochs"))
            result["deceptive"].append({"lambda": lam, "divergence": divergence, **stats})
    result["base_self"] = base_stats  # sanity: TVD and JSD of the base model against itself are 0
    # Wiegreffe & Pinter's yardstick for "far": how far the attention of a model trained on the same data from
    # another initialisation (and batch order) lies from the base model's.
    other = classifiers.get_classifier(replace(cfg, init_seed=cfg.seed + SEED_VARIANCE_OFFSET), out)
    result["seed_variance"] = deceptive_stats(other.model, _targets(learned.model, learned.data.test),
                                              learned.data.test, "jsd", 0.0)
    return result


def check_arguments(args) -> None:
    """ValueError naming the argument (the CLI checks before it creates the output directory)."""
    shared.check_model_arguments(args)
    if args.lambdas is not None and any(not (lam >= 0 and math.isfinite(lam)) for lam in args.lambdas):
        raise ValueError(f"argument --lambdas: must be finite and >= 0, got {args.lambdas}")


def run(args) -> dict:
    check_arguments(args)
    lambdas = args.lambdas if args.lambdas is not None else ([0.01, 1.0] if args.quick else list(DEFAULT_LAMBDAS))
    start = args.deceptive_start or ("base" if args.quick else "scratch")
    # a copy of the base model already predicts what it must, so one epoch of the quick configuration moves its
    # attention; a model from scratch needs the base model's epochs
    deceptive_epochs = QUICK_DECEPTIVE_EPOCHS if args.quick and start == "base" else None
    jobs = shared.model_jobs(args, NAME, extra={"lambdas": lambdas, "deceptive_start": start,
                                                 "deceptive_epochs": deceptive_epochs})
    sweep = shared.run_model_jobs(analyse, jobs, args, NAME)
    rows = []
    for key, results in sorted(shared.group_runs(sweep).items()):
        dataset, encoder, normalizer = key
        row = {"dataset": dataset, "encoder": encoder, "normalizer": normalizer, "seeds": len(results)}
        for name in ("learned", "random", "uniform"):
            row[f"{name}_accuracy"] = float(np.mean([r[name]["accuracy"] for r in results]))
            row[f"{name}_macro_f1"] = float(np.mean([r[name]["macro_f1"] for r in results]))
        row["seed_variance"] = {k: float(np.mean([r["seed_variance"][k] for r in results]))
                                for k in ("accuracy", "tvd", "jsd")}
        row["deceptive"] = []
        for i, entry in enumerate(results[0]["deceptive"]):
            entries = [r["deceptive"][i] for r in results]
            row["deceptive"].append({"lambda": entry["lambda"], "divergence": entry["divergence"],
                                     **{k: float(np.mean([e[k] for e in entries]))
                                        for k in ("accuracy", "tvd", "jsd", "divergence_value")}})
        rows.append(row)
    plots = _plot(rows, args.out)
    result = {"experiment": NAME, "quick": args.quick, "instances": None, "seeds": shared.n_seeds(args),
              "embeddings": args.embeddings, "lambdas": lambdas, "deceptive_start": start,
              "deceptive_epochs": deceptive_epochs, "rows": rows, "plots": plots,
              "meta": invocation_meta({"backend": args.backend, "device": getattr(args, "device", "cpu")}),
              "sweep": sweep_block(sweep)}
    write_outputs(args.out, NAME, result, markdown(result))
    return result


def _plot(rows, out) -> list[str]:
    if not rows:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for r in rows:
        xs = [d["jsd"] for d in r["deceptive"]]
        ys = [d["accuracy"] for d in r["deceptive"]]
        ax.plot(xs, ys, marker="o", label=f"{r['dataset']}/{r['encoder']}/{r['normalizer']}")
    ax.set_xlabel("mean JSD(base attention, deceptive attention)")
    ax.set_ylabel("deceptive model test accuracy")
    ax.set_title("Deceptive models over λ")
    ax.legend(fontsize=6)
    return [save_figure(fig, out, "baselines.png")]


def markdown(result: dict) -> str:
    lines = ["# Uniform, random and deceptive attention (Wiegreffe & Pinter 2019)", "",
             "Test accuracy (macro-F1) with learned attention, frozen random attention and uniform attention "
             "(uniform does not depend on the normalizer). Wiegreffe & Pinter found that uniform weights often "
             "lose little, in which case attention is not needed for the task and says little about it.", "",
             shared.scale_note(result), ""]
    body = [[r["dataset"], r["encoder"], r["normalizer"],
             f"{r['learned_accuracy']:.3f} ({r['learned_macro_f1']:.3f})",
             f"{r['random_accuracy']:.3f} ({r['random_macro_f1']:.3f})",
             f"{r['uniform_accuracy']:.3f} ({r['uniform_macro_f1']:.3f})"] for r in result["rows"]]
    lines.append(md_table(["dataset", "encoder", "normalizer", "learned", "frozen random", "uniform"], body))
    start = result.get("deceptive_start", "base")
    how = ("A freshly initialised model (Wiegreffe & Pinter's protocol), trained for as many epochs as the base "
           "model" if start == "scratch" else
           "A copy of the base model (not Wiegreffe & Pinter's protocol, which trains a fresh model), fine-tuned "
           f"for {result.get('deceptive_epochs') or 'as many epochs as the base model had'}"
           + (" (quick configuration)" if result.get("deceptive_epochs") else ""))
    lines += ["## Deceptive models", "",
              f"{how}, to keep the base model's predictions (TVD) while pushing its attention away "
              "(−λ · divergence): JSD for every normalizer, so that all rows with JSD optimise one objective, "
              "and for softmax also Wiegreffe & Pinter's KL(a_adv ‖ a_base), infinite for sparse attention "
              "across different supports. Test split: accuracy, mean TVD to the base predictions, mean JSD "
              "between the attentions (nats, ≤ 0.693).", ""]
    lines += ["The row \"another seed\" is Wiegreffe & Pinter's yardstick: a model trained on the same split "
              "from another initialisation and batch order, compared with the base model in the same way. "
              "A deceptive model whose attention lies no farther from the base model's than that has not "
              "moved it far.", ""]
    body = []
    for r in result["rows"]:
        sv = r.get("seed_variance")
        if sv:
            body.append([r["dataset"], r["encoder"], r["normalizer"], "–", "another seed",
                         f"{sv['accuracy']:.3f}", f"{sv['tvd']:.3f}", f"{sv['jsd']:.3f}"])
        for d in r["deceptive"]:
            body.append([r["dataset"], r["encoder"], r["normalizer"], DIVERGENCE_LABELS[d["divergence"]],
                         f"{d['lambda']:g}", f"{d['accuracy']:.3f}", f"{d['tvd']:.3f}", f"{d['jsd']:.3f}"])
    lines.append(md_table(["dataset", "encoder", "normalizer", "divergence", "λ", "acc", "TVD to base",
                           "JSD of attention"], body))
    return shared.markdown_tail(lines, result)
