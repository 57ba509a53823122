"""Train a tiny Llama from scratch on real text with softmax, sparsemax,
entmax15 and learnable-α entmax attention (attnkern in transformers).

    python -m attnkern.experiments data fetch vader      # the Rotten Tomatoes snippets, once
    python examples/transformers_train_rotten.py --out results/transformers/tiny-llama-rotten

Data: the 10,604 Rotten Tomatoes snippets of the vaderSentiment archive, split
90/10 (seed 0) into training and held-out text; a byte-level BPE tokenizer
(vocabulary 2048) trained in code on the training text (nothing comes from a
hub); the token stream cut into blocks of 128. Model: Llama, 4 layers, width
256, 4 heads of 64, MLP 688, random initialisation (seed 0, the same for every
normalizer), AdamW 1e-3 with 20 warm-up steps, batch 16 blocks, 300 steps;
every normalizer sees the same batches. Writes OUT.json (losses per step,
held-out loss every 50 steps, the learned α, provenance), OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import numpy as np
import torch

import attnkern
import attnkern.integrations.transformers as ak_hf

NORMALIZERS = {  # label -> (attn_implementation, configure() settings or None)
    "softmax": ("attnkern_softmax", None),
    "sparsemax": ("attnkern_sparsemax", None),
    "entmax15": ("attnkern_entmax15", None),
    "entmax, learnable α": ("sdpa", dict(normalizer="entmax", alpha="learnable", alpha_init=1.5)),
}
VOCAB, BLOCK, BATCH, WARMUP, LR, EVAL_EVERY, EVAL_BLOCKS = 2048, 128, 16, 20, 1e-3, 50, 64


def texts_split(seed: int = 0):
    from attnkern.experiments.data.rotten import load_rotten_tomatoes

    texts = [r.text for r in load_rotten_tomatoes()]
    order = np.random.default_rng(seed).permutation(len(texts))
    cut = int(0.9 * len(texts))
    return [texts[i] for i in order[:cut]], [texts[i] for i in order[cut:]]


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def blocks(tok, texts) -> torch.Tensor:
    eos = tok.token_to_id("<eos>")
    stream = []
    for enc in tok.encode_batch(texts):
        stream += enc.ids + [eos]
    n = len(stream) // BLOCK
    return torch.tensor(stream[:n * BLOCK]).view(n, BLOCK)


def build(label: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    impl, settings = NORMALIZERS[label]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=BLOCK)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    if settings:
        ak_hf.configure(model, **settings)
    return model


@torch.no_grad()
def held_out_loss(model, held: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=held[i:i + BATCH], labels=held[i:i + BATCH]).loss.item()
              for i in range(0, len(held), BATCH)]
    model.train()
    return float(np.mean(losses))


def train(label: str, train_blocks, held, steps: int) -> dict:
    model = build(label).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    order = torch.randint(0, len(train_blocks), (steps, BATCH), generator=torch.Generator().manual_seed(1))
    losses, evals, t0 = [], [], time.perf_counter()
    for step in range(steps):
        batch = train_blocks[order[step]]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % EVAL_EVERY == 0 or step == steps - 1:
            evals.append([step + 1, held_out_loss(model, held)])
            print(f"{label:22s} step {step + 1:4d}  train {np.mean(losses[-EVAL_EVERY:]):.3f}  "
                  f"held-out {evals[-1][1]:.3f}", flush=True)
    out = {"train_loss": losses, "held_out_loss": evals, "seconds": time.perf_counter() - t0,
           "finite": bool(np.isfinite(losses).all())}
    modules = ak_hf.attention_modules(model)
    if hasattr(modules[0], ak_hf.ALPHA_MODULE):
        out["alpha"] = [getattr(m, ak_hf.ALPHA_MODULE).alpha.detach().tolist() for m in modules]
    return out


def provenance() -> dict:
    import transformers

    from attnkern.experiments.provenance import git_commit, machine

    return dict(git_commit(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=machine(), torch=torch.__version__, transformers=transformers.__version__,
                attnkern=attnkern.__version__, threads=torch.get_num_threads())


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, run) in enumerate(result["runs"].items()):
        loss = np.asarray(run["train_loss"])
        smooth = np.convolve(loss, np.ones(10) / 10, mode="valid")
        ax.plot(np.arange(10, len(loss) + 1), smooth, color=f"C{i}", lw=1.2, label=f"{label} (train, 10-step mean)")
        ev = np.asarray(run["held_out_loss"])
        ax.plot(ev[:, 0], ev[:, 1], "o--", color=f"C{i}", ms=3, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Tiny Llama on Rotten Tomatoes snippets (dots: held-out loss)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict) -> str:
    cfg, prov = result["config"], result["provenance"]
    lines = ["| attention | first 10 steps | last 50 steps | held-out, end | learned α (min–max) | seconds |",
             "|---|---:|---:|---:|---|---:|"]
    for label, run in result["runs"].items():
        loss = run["train_loss"]
        alpha = run.get("alpha")
        a = f"{min(map(min, alpha)):.3f}–{max(map(max, alpha)):.3f}" if alpha else "–"
        lines.append(f"| {label} | {np.mean(loss[:10]):.3f} | {np.mean(loss[-50:]):.3f} | "
                     f"{run['held_out_loss'][-1][1]:.3f} | {a} | {run['seconds']:.0f} |")
    m = prov["machine"]
    commit = (prov["commit"] or "unknown")[:7] + ("+changes" if prov.get("dirty") else "")
    return (f"Training cross-entropy (nats per token) of a tiny Llama ({cfg['layers']} layers, width "
            f"{cfg['width']}, {cfg['heads']} heads, BPE vocabulary {cfg['vocab']}) trained from scratch on "
            f"Rotten Tomatoes snippets for {cfg['steps']} steps of {cfg['batch']} × {cfg['block']} tokens, with "
            f"each attention. Commit {commit}, {prov['date']}; {m.get('processor', '?')}, kernels at "
            f"{m.get('isa_level', '?')}, {prov['threads']} threads; torch {prov['torch']}, transformers "
            f"{prov['transformers']}.\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="prefix of the .json, .md and .png written")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--normalizers", nargs="+", default=list(NORMALIZERS), choices=list(NORMALIZERS))
    args = ap.parse_args()
    ak_hf.register()
    train_texts, held_texts = texts_split()
    tok = train_tokenizer(train_texts)
    train_blocks, held = blocks(tok, train_texts), blocks(tok, held_texts)[:EVAL_BLOCKS]
    print(f"{len(train_blocks)} training blocks, {len(held)} held-out blocks of {BLOCK} tokens", flush=True)
    result = {"config": dict(steps=args.steps, batch=BATCH, block=BLOCK, vocab=VOCAB, layers=4, width=256, heads=4,
                             lr=LR, warmup=WARMUP, train_blocks=len(train_blocks), held_out_blocks=len(held)),
              "provenance": provenance(), "runs": {}}
    for label in args.normalizers:
        result["runs"][label] = train(label, train_blocks, held, args.steps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(render(result))
    plot(result, out.with_suffix(".png"))
    print(render(result))


if __name__ == "__main__":
    main()
