"""ktiw: knowledge to translate individual words (the lexical probe β) vs learned attention.

β_{l,t} = log p(o_l | context = h_t, decoder state d_l): how well the model
would predict the gold output word if it attended only to source position t.
The paper's claim: KTIW is learned before attention, from co-occurrence. A
model trained with attention frozen uniform learns β all the same, and that β
agrees with the attention of a standardly trained model. Each run trains a
standard and a uniform-attention seq2seq model side by side from the same
seed and measures, over training and on held-out pairs, the agreement between
β of the uniform model and the attention of the standard one: top-1 match
(argmax_t β_{l,t} = argmax_t a_{l,t}) and Kendall τ, each beside a shuffled
baseline (β permuted within the row). Data: the copy task (iid and
permutation) and English→German pairs from the system's gettext catalogs.
"""

from __future__ import annotations

import numpy as np
import torch

from attnkern.experiments.common import (
    cell_jobs,
    collect_cells,
    common_config,
    fmt_mean_std,
    forward_eval,
    kendall_tau_rows,
    markdown_end,
    md_table,
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
from attnkern.experiments.data.synthetic import CopyTask
from attnkern.experiments.models import Seq2Seq

NAME = "ktiw"
DATASETS = ("copy-iid", "copy-permutation", "en-de")
QUICK = dict(embed_dim=64, hidden_dim=64, batch=64, steps=400, eval_every=50, probe=100, copy_length=20, seeds=2)
FULL = dict(embed_dim=256, hidden_dim=256, batch=128, steps=5000, eval_every=250, probe=500, copy_length=40,
            seeds=5)
PAPER = ("Even when the attention weights are frozen uniform, probe β strongly agrees with the attention "
         "of a standardly trained model (the paper's section 3.2; no numbers in the material we follow).")


class PairData:
    """Batches of (src, src_mask, tgt_in, tgt, tgt_mask) from a copy task or a fixed set of pairs."""

    def __init__(self, dataset: str, config: dict, seed: int):
        self.dataset = dataset
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        if dataset.startswith("copy-"):
            self.task = CopyTask(dataset.split("-", 1)[1], length=config["copy_length"])
            self.src_vocab, self.tgt_vocab = self.task.src_vocab, self.task.tgt_vocab
            self.bos = self.task.bos_idx
            self.probe = self._copy(config["probe"], torch.Generator().manual_seed(20_000 + seed))
            return
        from attnkern.experiments.data.text import Vocab, pad_batch, split_indices
        from attnkern.experiments.data.translation import load_en_de_pairs

        pairs = load_en_de_pairs()
        train_idx, dev_idx, _ = split_indices(len(pairs), seed=0)
        sv = Vocab([pairs[i][0] for i in train_idx], min_count=2, max_size=config.get("max_vocab", 3000))
        tv = Vocab([pairs[i][1] for i in train_idx], min_count=2, max_size=config.get("max_vocab", 3000))
        self.src_vocab, self.tgt_vocab, self.bos = len(sv), len(tv), tv.bos_idx

        def enc(idx):
            s, sm = pad_batch([sv.encode(pairs[i][0]) for i in idx])
            t, tm = pad_batch([tv.encode(pairs[i][1]) for i in idx])
            t_in = torch.cat([torch.full((len(idx), 1), self.bos), t[:, :-1]], 1)
            return s, sm, t_in, t, tm

        self.train = enc(train_idx)
        self.probe = enc(dev_idx[:config["probe"]])

    def _copy(self, n, gen):
        src, mask, t_in, t = self.task.sample(n, gen)
        return src, mask, t_in, t, torch.ones_like(t, dtype=torch.bool)

    def batch(self, n):
        if self.dataset.startswith("copy-"):
            return self._copy(n, self.gen)
        idx = torch.randint(0, self.train[0].shape[0], (n,), generator=self.gen)
        s, sm, t_in, t, tm = (x[idx] for x in self.train)
        w, lw = int(sm.sum(1).max()), int(tm.sum(1).max())
        return s[:, :w], sm[:, :w], t_in[:, :lw], t[:, :lw], tm[:, :lw]


def row_agreement(x: np.ndarray, y: np.ndarray, src_mask: np.ndarray, tgt_mask: np.ndarray, rng) -> dict:
    """Top-1 match and Kendall τ between rows x[n, l, :] and y[n, l, :] (n, l real output
    steps) over real source positions, with baselines where x is shuffled within the row."""
    m = np.broadcast_to(src_mask[:, None, :], x.shape)
    sh = shuffle_rows(x, m, rng)
    rows = tgt_mask.astype(bool) & (src_mask.sum(1) >= 2)[:, None]
    top = lambda a: ((np.where(m, a, -np.inf).argmax(-1) == np.where(m, y, -np.inf).argmax(-1)) & rows).sum() \
        / max(rows.sum(), 1)
    tau, tau_sh = kendall_tau_rows(x, y, m), kendall_tau_rows(sh, y, m)
    ok = rows & np.isfinite(tau) & np.isfinite(tau_sh)
    mean = lambda v: float(v[ok].mean()) if ok.any() else float("nan")
    return {"top1": float(top(x)), "top1_shuffled": float(top(sh)), "tau": mean(tau), "tau_shuffled": mean(tau_sh)}


def build(config, data, mode):
    normalizer, params = parse_normalizer(config["normalizer"])
    return Seq2Seq(data.src_vocab, data.tgt_vocab, config["embed_dim"], config["hidden_dim"],
                   normalizer=normalizer, **params, mode=mode, backend=config["backend"],
                   bos_idx=data.bos).to(config["device"])


@torch.no_grad()
def measure(std, uni, probe, rng, ibm1_post=None) -> dict:
    dev = next(std.parameters()).device
    s, sm, t_in, t, tm = (x.to(dev) for x in probe)
    o_s, o_u = forward_eval((std, uni), s, sm, t_in)
    beta_u = uni.probe(o_u, t).masked_fill(~sm.unsqueeze(1), -1e9).cpu().numpy()
    beta_s = std.probe(o_s, t).masked_fill(~sm.unsqueeze(1), -1e9).cpu().numpy()
    a_s = o_s.weights.cpu().numpy()
    smn, tmn = sm.cpu().numpy(), tm.cpu().numpy()
    acc = lambda o: ((o.logits.argmax(-1) == t) & tm).sum().item() / tm.sum().item()
    rec = {"acc_standard": acc(o_s), "acc_uniform": acc(o_u)}
    for k, v in row_agreement(beta_u, a_s, smn, tmn, rng).items():
        rec[f"beta_uniform_vs_attention_{k}"] = v
    for k, v in row_agreement(beta_s, a_s, smn, tmn, rng).items():
        rec[f"beta_standard_vs_attention_{k}"] = v
    if ibm1_post is not None:
        for name, x in (("attention", a_s), ("beta_uniform", beta_u)):
            for k, v in row_agreement(ibm1_post, x, smn, tmn, rng).items():
                rec[f"ibm1_vs_{name}_{k}"] = v
    return rec


def train_pair(config: dict, seed: int) -> dict:
    """Trains a standard and a uniform-attention model on the same batches; curves of agreement."""
    data = PairData(config["dataset"], config, seed)
    torch.manual_seed(seed)
    std = build(config, data, "learned")
    uni = build(config, data, "uniform")
    rng = np.random.default_rng(1000 + seed)
    ibm1_post, ibm1_info = None, None
    if config.get("ibm1"):
        from attnkern.experiments.dynamics.ibm1_model import ibm1_posteriors

        ibm1_post, ibm1_info = fit_ibm1(data, config)
        s, sm, _, t, _ = data.probe
        ibm1_post = ibm1_posteriors(ibm1_info.pop("t"), s.numpy(), sm.numpy(), t.numpy())

    def loss(model, batch):
        s, sm, t_in, t, _ = batch
        return model.loss(model(s, sm, t_in), t)

    out = train_side_by_side(std, uni, config, lambda std, uni: measure(std, uni, data.probe, rng, ibm1_post),
                             lambda: tuple(x.to(config["device"]) for x in data.batch(config["batch"])), loss)
    if ibm1_info is not None:
        out["ibm1"] = ibm1_info
    return out


def fit_ibm1(data: PairData, config: dict):
    """IBM Model 1 on the training pairs (a fresh sample of the copy task, or the
    en-de training split); its alignment accuracy on the probe where gold is known."""
    from attnkern.experiments.dynamics.ibm1_model import ibm1_posteriors, train_ibm1

    if data.dataset.startswith("copy-"):
        s, sm, _, t, tm = data._copy(config["ibm1_pairs"], torch.Generator().manual_seed(7))
    else:
        s, sm, _, t, tm = data.train
    t_table, ll = train_ibm1(s.numpy(), sm.numpy(), t.numpy(), tm.numpy(), data.src_vocab, data.tgt_vocab,
                             iterations=config["ibm1_iterations"])
    info = {"t": t_table, "log_likelihood": ll}
    if data.dataset.startswith("copy-"):
        ps, psm, _, pt, _ = data.probe
        post = ibm1_posteriors(t_table, ps.numpy(), psm.numpy(), pt.numpy())
        chosen = np.take_along_axis(ps.numpy(), post.argmax(-1), 1)  # the source token aligned to
        info["alignment_token_accuracy"] = float((chosen + 1 == pt.numpy()).mean())
        uniform = np.take_along_axis(ps.numpy(), np.random.default_rng(0).integers(0, ps.shape[1], pt.shape), 1)
        info["alignment_token_accuracy_random"] = float((uniform + 1 == pt.numpy()).mean())
    return None, info


def add_arguments(p) -> None:
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    p.add_argument("--hidden", type=int, default=None, help="override the embedding/hidden size")
    p.add_argument("--probe", type=int, default=None, help="held-out pairs on which agreement is measured")


# Every run also fits IBM Model 1 (cheap next to the training), so that `ktiw` and `ibm1`
# run the same jobs and share their cache (namespace "seq2seq-pairs").
IBM1_DEFAULTS = dict(ibm1=True, ibm1_iterations=10, ibm1_pairs=2000)
NAMESPACE = "seq2seq-pairs"


def jobs_for(args, extra=None):
    scale, seeds = scale_and_seeds(args, QUICK, FULL, {"steps": ("steps",), "probe": ("probe",),
                                                       "hidden": ("hidden_dim", "embed_dim")})
    extra = {**IBM1_DEFAULTS, **(extra or {})}
    jobs = cell_jobs(args.datasets, args.normalizers, seeds,
                     lambda ds, norm: dict(dataset=ds, normalizer=norm, lr=1e-3, backend=args.backend,
                                           device=args.device, **scale, **extra))
    return jobs, scale, seeds


def collect(args, sweep, seeds, keys) -> dict:
    """{dataset: {normalizer: summary}} (see :func:`common.collect_cells`), with each seed's IBM 1 fit."""
    return collect_cells(sweep, args.datasets, args.normalizers, seeds, keys, per_seed=("ibm1",))


KEYS = ("acc_standard", "acc_uniform", "beta_uniform_vs_attention_top1", "beta_uniform_vs_attention_top1_shuffled",
        "beta_uniform_vs_attention_tau", "beta_uniform_vs_attention_tau_shuffled",
        "beta_standard_vs_attention_top1", "beta_standard_vs_attention_tau")


def plot(out, summary, key, title, name) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, max(len(summary), 1), figsize=(4 * max(len(summary), 1), 3), squeeze=False)
    for ax, (ds, cells) in zip(axes[0], summary.items(), strict=False):
        for norm, cell in cells.items():
            curves = list(cell["curves"].values())
            y = np.nanmean(np.array([c[key] for c in curves], dtype=float), 0)
            ax.plot(curves[0]["step"], y, label=norm)
            if f"{key}_shuffled" in curves[0]:
                ysh = np.nanmean(np.array([c[f"{key}_shuffled"] for c in curves], dtype=float), 0)
                ax.plot(curves[0]["step"], ysh, ls=":", color=ax.lines[-1].get_color())
        ax.set_title(ds, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(title, fontsize=8)
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, out, name, dpi=90)


def markdown(result) -> str:
    cfg, s = result["config"], result["summary"]
    lines = ["# ktiw: the lexical probe β of a uniform-attention model vs a standard model's attention", "",
             f"Configuration: {'--quick' if cfg['quick'] else 'full scale'}; LSTM seq2seq, Luong general attention, "
             f"hidden {cfg['scale']['hidden_dim']}, {cfg['scale']['steps']} steps, batch {cfg['scale']['batch']}, "
             f"copy length {cfg['scale']['copy_length']}, {cfg['seeds']} seeds, backend {cfg['backend']}. "
             "Agreement on held-out pairs at the end of training, mean ± std over seeds; 'shuffled' permutes β "
             "within each row (the chance level).", ""]
    rows = []
    for ds, cells in s.items():
        for norm, c in cells.items():
            rows.append([ds, norm, fmt_mean_std(c.get("acc_standard")), fmt_mean_std(c.get("acc_uniform")),
                         fmt_mean_std(c.get("beta_uniform_vs_attention_top1")),
                         fmt_mean_std(c.get("beta_uniform_vs_attention_top1_shuffled")),
                         fmt_mean_std(c.get("beta_uniform_vs_attention_tau")),
                         fmt_mean_std(c.get("beta_uniform_vs_attention_tau_shuffled")),
                         fmt_mean_std(c.get("beta_standard_vs_attention_top1"))])
    lines.append(md_table(["data", "normalizer", "token acc standard", "token acc uniform",
                           "top-1 β(uniform) = a(standard)", "shuffled", "τ(β uniform, a standard)", "shuffled",
                           "top-1 β(standard) = a(standard)"], rows))
    return markdown_end(lines, result, paper=PAPER)


def reading(summary) -> str:
    parts = []
    for ds, cells in summary.items():
        for norm, c in cells.items():
            t, sh = c.get("beta_uniform_vs_attention_top1"), c.get("beta_uniform_vs_attention_top1_shuffled")
            if t and sh:
                parts.append(f"{ds}/{norm}: top-1 agreement {t[0]:.2f} vs {sh[0]:.2f} shuffled")
    return "; ".join(parts) + "." if parts else "No complete runs."


def run(args) -> dict:
    jobs, scale, seeds = jobs_for(args)
    sweep = run_sweep(args, train_pair, jobs, namespace=NAMESPACE)
    summary = collect(args, sweep, seeds, KEYS)
    config = {**common_config(args), "datasets": list(args.datasets), "seeds": seeds, "scale": scale}
    plots = [plot(args.out, summary, "beta_uniform_vs_attention_top1", "top-1 β(uniform) = a(standard)",
                  f"{NAME}_top1.png"),
             plot(args.out, summary, "beta_uniform_vs_attention_tau", "τ(β uniform, a standard)", f"{NAME}_tau.png")]
    return write_dynamics_result(args, NAME, config, markdown, paper=PAPER, summary=summary, sweep=sweep_block(sweep),
                                 reading=reading(summary), plots=plots)
