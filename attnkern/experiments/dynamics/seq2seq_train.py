"""Training loops for the sequence-copying experiments (copy, ktiw, multihead).

One run = one seed of one configuration; every function takes (config, seed)
with a JSON-serializable config so the runner can cache and distribute it.
"""

from __future__ import annotations

import math

import torch

from attnkern.experiments.common import parse_normalizer
from attnkern.experiments.data.synthetic import CopyTask
from attnkern.experiments.models import Seq2Seq

# Every option of a copy run, at the paper's scale (1-layer LSTM, 256 units,
# Luong general attention and output layer, Adam 1e-3, batch 128, fresh samples
# every step, evaluation every 10 steps on 50 fresh samples).
COPY_DEFAULTS = dict(distribution="permutation", normalizer="softmax", length=40, subset_vocab=60, rnn="lstm",
                     attention="general", output="combined", embed_dim=256, hidden_dim=256, num_layers=1,
                     mode="learned", lr=1e-3,
                     batch=128, steps=3000, eval_every=10, eval_samples=50, final_samples=500, stop_at=None,
                     threshold=0.9, backend="auto", device="cpu")


def copy_config(**overrides) -> dict:
    unknown = set(overrides) - set(COPY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown copy options: {sorted(unknown)}")
    return {**COPY_DEFAULTS, **overrides}


def _model_options(cfg: dict, task: CopyTask) -> dict:
    """The keyword arguments a copy model (single- or multi-head) takes from a copy config."""
    normalizer, params = parse_normalizer(cfg["normalizer"])
    return dict(rnn=cfg["rnn"], attention=cfg["attention"], output=cfg["output"], normalizer=normalizer, **params,
                backend=cfg["backend"], pad_idx=task.pad_idx, bos_idx=task.bos_idx)


def build_copy_model(cfg: dict) -> tuple[CopyTask, Seq2Seq]:
    task = CopyTask(cfg["distribution"], cfg["length"], cfg["subset_vocab"])
    model = Seq2Seq(task.src_vocab, task.tgt_vocab, cfg["embed_dim"], cfg["hidden_dim"], cfg["num_layers"],
                    mode=cfg["mode"], **_model_options(cfg, task))
    return task, model.to(cfg["device"])


@torch.no_grad()
def evaluate_copy(model: Seq2Seq, task: CopyTask, n: int, generator: torch.Generator, device: str) -> dict:
    """Token accuracy (teacher forced, argmax vs gold), attention accuracy (argmax of the
    weights of output step l on source position l) and loss on n fresh samples."""
    was = model.training
    model.eval()
    src, mask, tgt_in, tgt = (t.to(device) for t in task.sample(n, generator))
    out = model(src, mask, tgt_in)
    loss = model.loss(out, tgt).item()
    tok = (out.logits.argmax(-1) == tgt).float().mean().item()
    pos = torch.arange(task.length, device=device)
    att = (out.weights.argmax(-1) == pos).float().mean().item()
    model.train(was)
    return {"token_acc": tok, "attn_acc": att, "loss": loss}


def _fit(model, task: CopyTask, cfg: dict, seed: int, evaluate, metrics: tuple[str, ...],
         losses: list | None = None) -> tuple[dict, int]:
    """Adam on ``cfg["batch"]`` fresh samples a step, for up to ``cfg["steps"]`` steps. Every ``eval_every`` steps
    and at the last, ``evaluate(n, generator)`` (a dict holding ``metrics``, token_acc among them) on
    ``eval_samples`` fresh samples extends the curve; training stops once token_acc reaches ``stop_at`` (when
    set) and, when a ``losses`` list is given (it receives every step's loss), at a non-finite loss.
    Returns (curve {"step": [...], metric: [...]}, the last step run)."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    train_gen = torch.Generator().manual_seed(10_000 + seed)
    eval_gen = torch.Generator().manual_seed(20_000 + seed)
    dev = cfg["device"]
    curve = {"step": [], **{k: [] for k in metrics}}
    step = 0
    for step in range(1, cfg["steps"] + 1):
        src, mask, tgt_in, tgt = (t.to(dev) for t in task.sample(cfg["batch"], train_gen))
        loss = model.loss(model(src, mask, tgt_in), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                break
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            ev = evaluate(cfg["eval_samples"], eval_gen)
            curve["step"].append(step)
            for k in metrics:
                curve[k].append(ev[k])
            if cfg["stop_at"] is not None and ev["token_acc"] >= cfg["stop_at"]:
                break
    return curve, step


def _final_generator(seed: int) -> torch.Generator:
    """The generator of a run's final evaluation samples (seeded apart from its training and evaluation ones)."""
    return torch.Generator().manual_seed(30_000 + seed)


def train_copy(config: dict, seed: int, return_model: bool = False):
    """Trains one copy model; returns its learning curves and final accuracy."""
    cfg = copy_config(**config)
    torch.manual_seed(seed)
    task, model = build_copy_model(cfg)
    dev = cfg["device"]
    losses = []
    curve, step = _fit(model, task, cfg, seed, lambda n, gen: evaluate_copy(model, task, n, gen, dev),
                       ("token_acc", "attn_acc", "loss"), losses)
    final = evaluate_copy(model, task, cfg["final_samples"], _final_generator(seed), dev)
    result = {"final_token_acc": final["token_acc"], "final_attn_acc": final["attn_acc"],
              "final_loss": final["loss"], "success": final["token_acc"] >= cfg["threshold"],
              "steps_run": step, "train_loss": losses, "curve": curve}
    steps_to = [s for s, a in zip(curve["step"], curve["token_acc"], strict=True) if a >= cfg["threshold"]]
    result["first_step_above_threshold"] = steps_to[0] if steps_to else None
    if return_model:
        return result, model
    return result


def initial_state(cfg: dict, seed: int) -> dict:
    """The parameters a copy model of this configuration starts from with this seed
    (train_copy builds its model right after torch.manual_seed(seed))."""
    torch.manual_seed(seed)
    return build_copy_model(copy_config(**cfg))[1].state_dict()


def train_multihead(config: dict, seed: int) -> dict:
    """A MultiHeadSeq2Seq copy model whose heads start from the initial parameters of
    the single-head seeds in config["head_seeds"] (None = a fresh random head).
    Trained as train_copy (fresh samples, Adam); token accuracy curve and success."""
    from attnkern.experiments.models import MultiHeadSeq2Seq

    head_cfg = {k: v for k, v in config.items() if k != "head_seeds"}
    cfg = copy_config(**head_cfg)
    task = CopyTask(cfg["distribution"], cfg["length"], cfg["subset_vocab"])
    states = [initial_state(head_cfg, s) for s in config["head_seeds"] if s is not None]
    torch.manual_seed(seed)
    model = MultiHeadSeq2Seq(len(config["head_seeds"]), task.src_vocab, task.tgt_vocab, cfg["embed_dim"],
                             cfg["hidden_dim"], cfg["num_layers"], **_model_options(cfg, task))
    model = model.to(cfg["device"])
    dev = cfg["device"]
    fresh = [i for i, s in enumerate(config["head_seeds"]) if s is None]
    given = [i for i, s in enumerate(config["head_seeds"]) if s is not None]
    for i, state in zip(given, states, strict=True):
        model.heads[i].load_state_dict(state)

    @torch.no_grad()
    def accuracy(n, gen):
        src, mask, tgt_in, tgt = (x.to(dev) for x in task.sample(n, gen))
        return (model(src, mask, tgt_in).argmax(-1) == tgt).float().mean().item()

    curve, step = _fit(model, task, cfg, seed, lambda n, gen: {"token_acc": accuracy(n, gen)}, ("token_acc",))
    final = accuracy(cfg["final_samples"], _final_generator(seed))
    return {"final_token_acc": final, "success": final >= cfg["threshold"], "curve": curve,
            "fresh_heads": len(fresh), "steps_run": step}
