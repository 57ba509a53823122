"""The interpretability experiments end to end at a tiny scale (fixture data, one small model per normalizer), and
their building blocks on hand-made cases."""

import json
import math
import os

import numpy as np
import pytest
import torch
from _interpret_data import make_cache
from helpers import run_experiment, train_on_keywords

from attnkern.experiments import cli
from attnkern.experiments.interpret import shared
from attnkern.experiments.interpret.adversarial import adversarial_attention
from attnkern.experiments.interpret.erasure import erase_until_flip
from attnkern.experiments.interpret.metrics import tvd
from attnkern.experiments.interpret.permutation import median_change
from attnkern.experiments.models import AttentionClassifier

COMMON = ["--quick", "--dataset", "tweets", "--encoders", "average", "--normalizers", "softmax", "sparsemax",
          "--instances", "6", "--no-progress"]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    root = make_cache(tmp_path_factory.mktemp("data"))
    old = os.environ.get("ATTNKERN_DATA")
    os.environ["ATTNKERN_DATA"] = str(root)
    yield tmp_path_factory.mktemp("out")
    if old is None:
        os.environ.pop("ATTNKERN_DATA", None)
    else:
        os.environ["ATTNKERN_DATA"] = old


def _run(name, out, *extra):
    result, md = run_experiment(name, out, *COMMON, *extra)
    assert md.startswith("# ")
    return result


def test_importance_end_to_end(out):
    result = _run("importance", out)
    rows = {r["normalizer"]: r for r in result["rows"]}
    assert set(rows) == {"softmax", "sparsemax"}
    required = {"dataset", "encoder", "normalizer", "accuracy", "gradient_tau_mean", "gradient_tau_std",
                "gradient_sig_frac", "loo_tau_mean", "loo_tau_std", "loo_sig_frac"}
    for r in rows.values():
        assert required <= set(r)
        assert r["instances"] == 6
        assert -1 <= r["gradient_tau_mean"] <= 1 and -1 <= r["loo_tau_mean"] <= 1
        assert set(r["gradient_topk"]) == {"1", "2", "3", "4", "5"}
        lo, hi = r["gradient_tau_ci"]
        assert lo <= r["gradient_tau_mean"] <= hi and all(len(c["loo_tau_ci"]) == 2 for c in r["by_class"].values())
        assert sum(c["instances"] for c in r["by_class"].values()) == 6
    # sparsemax against softmax, paired over the same seeds and instances
    (paired,) = result["paired"]
    assert (paired["normalizer"], paired["vs"], paired["seeds"]) == ("sparsemax", "softmax", 1)
    lo, hi = paired["gradient_tau_diff_ci"]
    assert lo <= paired["gradient_tau_diff"] <= hi
    assert "## Sparse against softmax, paired" in (out / "importance.md").read_text()
    # softmax attends to every token; sparsemax to a subset
    assert rows["softmax"]["support_mean"] == rows["softmax"]["length_mean"]
    assert rows["sparsemax"]["support_mean"] <= rows["sparsemax"]["length_mean"]
    assert "ADR Tweets" in (out / "importance.md").read_text()
    # the models are cached for the other experiments
    assert len(list((out / "models").glob("tweets-average-*-learned-s0-*.pt"))) == 2
    first, last = result["sweep"]["provenance"]["started"]
    assert first <= last and first.endswith(" UTC")


def test_permutation_end_to_end(out):
    result = _run("permutation", out, "--permutations", "20")
    for r in result["rows"]:
        assert 0 <= r["median_change_mean"] <= 1
        assert sum(b["instances"] for b in r["by_max_attention"]) == 6
    # one density figure per dataset, under the name the report links
    assert result["plots"] == ["permutation_tweets.png"]


def test_structured_normalizers_in_importance_and_permutation(out):
    """fusedmax and oscarmax (with λ) and the chain marginals crf and sparsemap
    run where their metrics hold; the experiments whose metrics need
    distributions refuse the marginals with a one-line error."""
    args = [a for a in COMMON if a not in ("softmax", "sparsemax")]
    norms = ["fusedmax0.1", "crf"]
    at = args.index("--normalizers") + 1
    args[at:at] = norms
    own = out / "structured"  # (not the folder the report test gathers)
    result, _ = run_experiment("importance", own, *args)
    rows = {r["normalizer"]: r for r in result["rows"]}
    assert set(rows) == set(norms)
    assert all(r["instances"] == 6 and -1 <= r["gradient_tau_mean"] <= 1 for r in rows.values())
    result, _ = run_experiment("permutation", own, *args, "--permutations", "5")
    assert {r["normalizer"] for r in result["rows"]} == set(norms)
    assert cli.main(["adversarial", "--out", str(own), "--normalizers", "sparsemap"]) == 2


def test_adversarial_end_to_end(out):
    result = _run("adversarial", out, "--steps", "30")
    assert result["start"] == "uniform"  # the authors' start by default
    for r in result["rows"]:
        assert 0 <= r["max_jsd_mean"] <= math.log(2) + 1e-6
        assert 0 <= r["feasible_mean"] <= 5


def test_erasure_end_to_end(out):
    result = _run("erasure", out)
    for r in result["rows"]:
        for order in ("attention", "random", "gradient", "gradient_x_attention"):
            assert 0 <= r[order]["flip_frac"] <= 1


def test_baselines_end_to_end(out):
    result = _run("baselines", out, "--lambdas", "0.1")
    for r in result["rows"]:
        for name in ("learned", "random", "uniform"):
            assert 0 <= r[f"{name}_accuracy"] <= 1
        # JSD for every normalizer; Wiegreffe & Pinter's KL(a_adv ‖ a_base) besides for softmax only
        divergences = ["jsd", "kl"] if r["normalizer"] == "softmax" else ["jsd"]
        assert [(d["lambda"], d["divergence"]) for d in r["deceptive"]] == [(0.1, dv) for dv in divergences]
        # another initialisation on the same split: a different model, so its attention differs somewhat
        assert 0 < r["seed_variance"]["jsd"] <= math.log(2) and 0 <= r["seed_variance"]["accuracy"] <= 1
    assert len(list((out / "models").glob("tweets-average-softmax-learned-s0-i1000-*.pt"))) == 1
    # uniform attention does not depend on the normalizer: one model serves both rows
    assert len(list((out / "models").glob("tweets-average-softmax-uniform-s0-*.pt"))) == 1
    assert not list((out / "models").glob("tweets-average-sparsemax-uniform-*.pt"))
    assert result["deceptive_start"] == "base"  # the quick configuration's default
    assert len(list((out / "models").glob("tweets-average-softmax-learned-s0-*-deceive0.1-kl-base-e1-*.pt"))) == 1


def test_report_gathers_every_part(out):
    rc = cli.main(["report", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = (out / "report.md").read_text()
    for part in ("Table 2", "Permuting attention", "Adversarial attention", "Wiegreffe & Pinter", "Serrano & Smith"):
        assert part in text
    summary = json.loads((out / "report.json").read_text())["summary"]
    assert [s["normalizer"] for s in summary] == ["softmax", "sparsemax"]


def test_bad_arguments_give_one_line_errors(tmp_path, capsys):
    # Usage errors (exit 2), found before the output directory is made.
    out = tmp_path / "never-made"
    for argv, name in ((["importance", "--dataset", "imdb"], "--dataset"), (["importance", "--instances", "0"],
                       "--instances"), (["adversarial", "--epsilon", "0"], "--epsilon"),
                       (["permutation", "--permutations", "0"], "--permutations"),
                       (["baselines", "--lambdas", "-1"], "--lambdas")):
        assert cli.main([argv[0], "--out", str(out), *argv[1:]]) == 2
        assert f"argument {name}" in capsys.readouterr().err
        assert not out.exists()
    assert cli.main(["report", "--out", str(tmp_path / "empty")]) == 1
    assert "no interpretability results" in capsys.readouterr().err


def test_missing_data_is_one_line(tmp_path, monkeypatch, capsys):
    # Every run fails for want of the data: one line with the reason, no "results in".
    monkeypatch.setenv("ATTNKERN_DATA", str(tmp_path / "empty-cache"))
    argv = ["importance", "--out", str(tmp_path / "out"), "--quick", "--dataset", "bbc", "--encoders", "average",
            "--normalizers", "softmax", "--no-progress"]
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "attnkern-exp data fetch bbc" in captured.err and "\n" not in captured.err.strip()
    assert "results" not in captured.out


# --- building blocks ------------------------------------------------------------------------------------------------


def _tiny_model(normalizer="softmax", encoder="bilstm"):
    torch.manual_seed(0)
    return AttentionClassifier(30, 2, encoder=encoder, normalizer=normalizer, embed_dim=8, hidden_dim=8).eval()


def _batch():
    tokens = torch.tensor([[3, 5, 7, 9, 11], [4, 6, 8, 0, 0]])
    return tokens, tokens != 0


def test_gradient_importance_matches_autograd():
    model = _tiny_model()
    tokens, mask = _batch()
    enc = shared.encode_batch(model, tokens, mask)
    got = shared.gradient_importance(model, enc)
    for i in range(2):
        emb = model.embed(tokens[i:i + 1]).detach().requires_grad_(True)
        out = model(tokens[i:i + 1], mask[i:i + 1], weights=enc.weights[i:i + 1], embeddings=emb)
        torch.softmax(out.logits, -1)[0, enc.pred[i]].backward()
        want = (emb.grad * emb).sum(-1).abs()[0] * mask[i]
        assert torch.allclose(got[i], want, atol=1e-6)
    assert (got[1, 3:] == 0).all()


def test_leave_one_out_matches_explicit_removal():
    model = _tiny_model()
    tokens, mask = _batch()
    enc = shared.encode_batch(model, tokens, mask)
    loo = shared.leave_one_out_importance(model, enc)
    assert [x.shape[0] for x in loo] == [5, 3]
    x = tokens[1, :3]
    for t in range(3):
        rest = torch.cat([x[:t], x[t + 1:]]).unsqueeze(0)
        p = shared.output_probs(model, rest, torch.ones_like(rest, dtype=torch.bool))
        assert float(loo[1][t]) == pytest.approx(float(tvd(p[0], enc.probs[1])), abs=1e-6)


@pytest.mark.parametrize("normalizer, encoder, exact", [("sparsemax", "average", True),
                                                         ("entmax15", "average", True),
                                                         ("sparsemax", "bilstm", False),
                                                         ("fusedmax", "average", False)])
def test_leave_one_out_is_exactly_zero_where_removal_changes_nothing(normalizer, encoder, exact):
    """Average encoder, entmax family: a token of zero weight is exactly unimportant (its removal changes
    neither the support nor the output), whatever rounding the removal's recomputation gives; a contextual
    encoder or a structured normalizer keeps the computed value, which there is real."""
    torch.manual_seed(3)
    model = AttentionClassifier(30, 2, encoder=encoder, normalizer=normalizer, embed_dim=8, hidden_dim=8).eval()
    with torch.no_grad():
        model.attention.v.weight.mul_(50.0)  # (peaked scores: most weights zero)
    tokens = torch.arange(1, 25).reshape(2, 12)
    mask = tokens != 0
    enc = shared.encode_batch(model, tokens, mask)
    zero = enc.weights == 0
    assert zero.any() and (~zero).any()
    loo = shared.leave_one_out_importance(model, enc)
    for i in range(2):
        x = tokens[i]
        for t in range(12):
            rest = torch.cat([x[:t], x[t + 1:]]).unsqueeze(0)
            p = shared.output_probs(model, rest, torch.ones_like(rest, dtype=torch.bool))
            computed = float(tvd(p[0], enc.probs[i]))
            if exact and zero[i, t]:
                assert float(loo[i][t]) == 0.0 and computed <= 1e-6
            else:
                assert float(loo[i][t]) == pytest.approx(computed, abs=1e-6)


def test_encoded_decode_reproduces_the_model():
    model = _tiny_model("sparsemax", "cnn")
    tokens, mask = _batch()
    enc = shared.encode_batch(model, tokens, mask)
    assert torch.allclose(enc.probs, shared.output_probs(model, tokens, mask), atol=1e-6)
    assert (enc.weights[1, 3:] == 0).all()


def test_permuting_uniform_attention_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    relevance = torch.randn(6, 3)
    bias = torch.zeros(3)
    w = torch.full((6,), 1 / 6)
    probs = shared.decode(w, relevance, bias)
    assert median_change(w, relevance, bias, probs, 50, gen) == pytest.approx(0.0, abs=1e-7)
    # one-hot attention on a decisive item: most permutations move the mass elsewhere
    w = torch.tensor([1.0, 0, 0, 0, 0, 0])
    relevance = torch.zeros(6, 2)
    relevance[0] = torch.tensor([5.0, 0.0])
    probs = shared.decode(w, relevance, torch.zeros(2))
    assert median_change(w, relevance, torch.zeros(2), probs, 50, gen) > 0.4


def _hand_encoded(model, weights, relevance):
    scores = torch.log(weights).unsqueeze(0)
    mask = torch.ones_like(scores, dtype=torch.bool)
    w = weights.unsqueeze(0)
    probs = shared.decode(w, relevance.unsqueeze(0), torch.zeros(relevance.shape[1]))
    return shared.Encoded(torch.ones_like(mask, dtype=torch.long), mask, torch.zeros(1, 3, 8), scores, w,
                          relevance.unsqueeze(0), torch.zeros(relevance.shape[1]), probs, probs.argmax(-1))


def test_erasure_counts_items_and_mass_until_the_flip():
    model = _tiny_model()
    # logits: class 0 = 4·a_0, class 1 = a_1 + a_2; with a = (.5, .3, .2) the decision is class 0
    relevance = torch.tensor([[4.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    enc = _hand_encoded(model, torch.tensor([0.5, 0.3, 0.2]), relevance)
    assert int(enc.pred) == 0
    items, mass = erase_until_flip(model, enc, torch.tensor([[0, 1, 2]]))
    assert items.tolist() == [1] and mass.tolist() == pytest.approx([0.5])
    # removing the two class-1 items never flips it, and the last item is never removed
    items, mass = erase_until_flip(model, enc, torch.tensor([[2, 1, 0]]))
    assert items.tolist() == [0] and mass.tolist() == [0.0]


@pytest.mark.parametrize("start", ["uniform", "scores"])
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_adversarial_candidates_stay_in_the_family(normalizer, start):
    model = _tiny_model(normalizer)
    for p in model.parameters():
        p.requires_grad_(False)
    tokens, mask = _batch()
    enc = shared.encode_batch(model, tokens, mask)
    alpha, change, dist = adversarial_attention(model, enc, k=3, epsilon=0.01, steps=60, penalty=100.0,
                                                start=start)
    assert alpha.shape == (2, 3, 5)
    assert torch.allclose(alpha.sum(-1), torch.ones(2, 3), atol=1e-5)
    assert (alpha[1, :, 3:] == 0).all()  # padding gets nothing
    assert (dist >= 0).all() and (dist <= math.log(2) + 1e-6).all()
    assert change.shape == (2, 3)
    # the search moves away from the original attention
    assert float(dist.max()) > 0.01


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", "entmax1.3"])
def test_start_scores_invert_the_normalizer(normalizer):
    """The adversary's start: scores that the model's own normalizer maps back to the drawn distribution."""
    from attnkern.experiments.common import parse_normalizer
    from attnkern.experiments.interpret.adversarial import scores_for

    name, params = parse_normalizer(normalizer)
    torch.manual_seed(0)
    model = AttentionClassifier(30, 2, encoder="average", normalizer=name, embed_dim=8, hidden_dim=8, **params)
    p = torch.softmax(3 * torch.randn(4, 7, dtype=torch.float64), -1)
    back = model.attention.normalize(scores_for(model.attention, p), torch.ones(4, 7, dtype=torch.bool))
    torch.testing.assert_close(back, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_adversary_moves_far_only_where_the_output_allows_it(normalizer):
    """A known answer for Jain & Wallace's adversary: with the same output relevance at every position the output
    does not depend on the attention, so a candidate far from the model's attention (ε-max JSD > 0.5 of ln 2)
    stays within ε; over two positions that push the output opposite ways every move of the attention moves the
    output, so the candidates that stay within ε (there must be some) stay close (JSD < 0.01)."""
    from dataclasses import replace

    model = _tiny_model(normalizer)
    for p in model.parameters():
        p.requires_grad_(False)
    cases = ((6, torch.tensor([1.0, -1.0]).expand(1, 6, 2), True),
             (2, torch.tensor([[[8.0, -8.0], [-8.0, 8.0]]]), False))
    for n, relevance, far in cases:
        tokens = torch.arange(3, 3 + n).unsqueeze(0)
        enc = shared.encode_batch(model, tokens, tokens != 0)
        # (peaked where the adversary may move far: JSD from the uniform distribution over 6 is at most 0.45)
        weights = torch.tensor([[0.95] + [0.01] * 5]) if far else torch.full((1, n), 1.0 / n)
        case = replace(enc, weights=weights, relevance=relevance, bias=torch.zeros(2))
        case = replace(case, probs=shared.decode(weights, relevance, case.bias))
        _, change, dist = adversarial_attention(model, case, k=5, epsilon=0.01, steps=300)
        ok = change <= 0.01
        assert ok.any(), change
        best = float(torch.where(ok, dist, torch.zeros_like(dist)).max())
        assert (best > 0.5) if far else (best < 0.01), (far, best)


def test_density_panel_is_a_kde_with_enough_spread_points_else_a_histogram():
    from attnkern.experiments.common import pyplot

    plt = pyplot()
    rng = np.random.default_rng(0)
    x, y = rng.uniform(0, 1, 200), rng.uniform(0, 0.3, 200)
    cases = [(x, y, "kde"),
             (x[:shared.KDE_MIN_POINTS - 1], y[:shared.KDE_MIN_POINTS - 1], "histogram"),  # too few instances
             (np.ones(200), y, "histogram"),  # one-hot attention everywhere: no spread in max attention
             (x, 0.2 * x, "histogram")]  # all on one line: no 2-D density
    for xs, ys, kind in cases:
        fig, ax = plt.subplots()
        assert shared.draw_density(ax, xs, ys, (0.0, 1.0), (0.0, 0.3)) == kind
        assert ax.collections, kind
        if kind == "histogram":  # every instance falls in one cell
            assert ax.collections[-1].get_array().sum() == len(xs)
        plt.close(fig)


def test_density_grid_writes_one_figure_per_dataset(tmp_path):
    rng = np.random.default_rng(1)
    per = {"max_attention": rng.uniform(0, 1, 50).tolist(), "median_change": rng.uniform(0, 0.2, 50).tolist()}
    few = {"max_attention": [1.0, 1.0, 0.5], "median_change": [0.0, 0.1, 0.05]}
    merged = {("tweets", "average", "softmax"): per, ("tweets", "average", "sparsemax"): few,
              ("tweets", "cnn", "softmax"): per, ("bbc", "average", "softmax"): per}
    files = shared.density_grid(merged, tmp_path, "permutation", "max_attention", "median_change", "max attention",
                                "median output change", "test")
    assert files == ["permutation_bbc.png", "permutation_tweets.png"]
    for name in files:
        assert (tmp_path / name).stat().st_size > 1000


def _trained_on_planted_keyword(normalizer):
    """(task, a small BiLSTM classifier trained on it, 200 held-out sentences (tokens, mask, labels, keyword
    position)) for data.synthetic.KeywordTask, where one keyword decides the label."""
    from attnkern.experiments.data.synthetic import KeywordTask

    torch.manual_seed(0)
    task = KeywordTask(n_filler=50, n_keywords=3, min_len=6, max_len=12)
    model = AttentionClassifier(task.vocab_size, 2, encoder="bilstm", normalizer=normalizer, embed_dim=16,
                                hidden_dim=16)
    train_on_keywords(model, task, steps=150, batch=64)
    return task, model, task.sample(200, torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_importance_finds_a_planted_token(normalizer):
    """A known answer: one keyword decides the label (data.synthetic.KeywordTask). The
    trained model needs only the positive keywords (no positive keyword: class 0), so the
    check runs on the instances whose decision depends on the planted token (removing it
    moves the output by a TVD of at least 0.25): there gradient and leave-one-out
    importance must rank it first in at least 90% of them, and erasing by gradient must
    flip the decision no later than erasing at random."""
    from attnkern.experiments.interpret.erasure import rankings

    _, model, (tokens, mask, labels, planted) = _trained_on_planted_keyword(normalizer)
    enc = shared.encode_batch(model, tokens, mask)
    assert (enc.pred == labels).float().mean() > 0.95
    grad = shared.gradient_importance(model, enc)
    loo = shared.leave_one_out_importance(model, enc)
    needed = torch.tensor([float(imp[int(p)]) >= 0.25 for imp, p in zip(loo, planted, strict=True)])
    assert needed.sum() >= 40
    assert (grad.argmax(1) == planted)[needed].float().mean() >= 0.9
    loo_first = torch.tensor([int(imp.argmax()) == int(p) for imp, p in zip(loo, planted, strict=True)])
    assert loo_first[needed].float().mean() >= 0.9
    orders = rankings(model, enc, torch.Generator().manual_seed(2))
    by_grad, _ = erase_until_flip(model, enc, orders["gradient"])
    at_random, _ = erase_until_flip(model, enc, orders["random"])
    both = (by_grad > 0) & (at_random > 0)
    assert both.sum() >= 20 and by_grad[both].mean() <= at_random[both].mean()


@pytest.mark.slow
@pytest.mark.parametrize("normalizer,divergence", [("softmax", "kl"), ("softmax", "jsd"), ("sparsemax", "jsd")])
def test_deceptive_training_moves_attention_far_on_a_planted_keyword(normalizer, divergence):
    """A known answer for Wiegreffe & Pinter's deceptive model: on a task where one keyword decides the label, a
    fresh model trained with their protocol (baselines.deceptive_loss and deceptive_optimizer: keep the base
    model's predictions, push the attention away from the base model's) must keep the held-out accuracy within
    0.05 of the base model's while its attention ends far farther from the base model's (JSD) than that of the
    same model trained with λ = 0 (plain distillation of the predictions), and with less of it on the keyword:
    the BiLSTM states around the keyword carry what the decision needs."""
    from attnkern.experiments.interpret.baselines import deceptive_loss, deceptive_optimizer
    from attnkern.experiments.interpret.classifiers import TrainConfig
    from attnkern.experiments.interpret.metrics import jsd

    task, base, (tokens, mask, labels, planted) = _trained_on_planted_keyword(normalizer)
    with torch.no_grad():
        base_weights = base(tokens, mask).weights

    def evaluate(model):
        with torch.no_grad():
            out = model(tokens, mask)
        on_keyword = out.weights[torch.arange(len(planted)), planted]
        return ((out.logits.argmax(-1) == labels).float().mean().item(), on_keyword.mean().item(),
                jsd(base_weights, out.weights).mean().item())

    def train(lam):
        torch.manual_seed(7)
        model = AttentionClassifier(task.vocab_size, 2, encoder="bilstm", normalizer=normalizer, embed_dim=16,
                                    hidden_dim=16)
        opt = deceptive_optimizer(model, TrainConfig("rt", "bilstm", normalizer, 0, lr=1e-2))
        gen = torch.Generator().manual_seed(3)
        for _ in range(200):
            x, m, _, _ = task.sample(64, gen)
            with torch.no_grad():
                target = base(x, m)
            loss = deceptive_loss(model, x, m, torch.softmax(target.logits, -1), target.weights, divergence, lam)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return evaluate(model)

    base_acc, base_on_keyword, _ = evaluate(base)
    assert base_acc > 0.95 and base_on_keyword > 0.5
    acc, on_keyword, moved = train(0.3)
    _, control_on_keyword, control_moved = train(0.0)
    assert acc >= base_acc - 0.05, (acc, base_acc)
    assert moved > control_moved + 0.2, (moved, control_moved)
    assert on_keyword < control_on_keyword - 0.2, (on_keyword, control_on_keyword)


def test_diagnostic_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKERN_DATA", str(make_cache(tmp_path / "data")))
    result, md = run_experiment("diagnostic", tmp_path / "out", "--quick", "--dataset", "tweets", "--encoders",
                                "bilstm", "--normalizers", "softmax", "sparsemax", "--no-progress")
    assert cli.main(["report", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["parts"] == ["diagnostic"]
    assert all(math.isfinite(s["guided_minus_uniform"]) for s in report["summary"])
    assert [(r["guide"], r["normalizer"]) for r in result["rows"]] == [("bilstm", "softmax"),
                                                                      ("bilstm", "sparsemax")]
    for r in result["rows"]:
        for name in ("uniform", "learned", "guided", "guided_deceptive", "guide"):
            assert 0 <= r[f"{name}_accuracy"] <= 1 and 0 <= r[f"{name}_macro_f1"] <= 1
    assert "guide's attention" in md
    # the deceptive guides are the baselines experiment's (quick: fine-tuned from the guide for one epoch)
    assert len(list((tmp_path / "out" / "models").glob("tweets-bilstm-*-learned-s0-*-deceive1-jsd-base-e1-*.pt"))) == 2
    # the guides and the diagnostic models with their own attention are the cached classifiers
    assert len(list((tmp_path / "out" / "models").glob("tweets-average-*-learned-s0-*.pt"))) == 2


def test_diagnostic_refuses_bad_arguments(tmp_path, capsys):
    assert cli.main(["diagnostic", "--quick", "--out", str(tmp_path), "--encoders", "average"]) == 2
    assert "--encoders" in capsys.readouterr().err
    assert cli.main(["diagnostic", "--quick", "--out", str(tmp_path), "--deceptive-lambda", "-1"]) == 2
    assert "--deceptive-lambda" in capsys.readouterr().err


def test_guided_diagnostic_model_uses_the_imposed_weights(tmp_path, monkeypatch):
    """A known answer: in the fixture the label follows the cue words. Weights imposed one-hot on a cue word let
    the diagnostic model classify the test split; one-hot on a filler word leaves it near chance. So the imposed
    weights decide what the model sees, in training and in testing."""
    from _interpret_data import NEGATIVE, POSITIVE

    from attnkern.experiments.interpret.classifiers import load_text_data, train_config
    from attnkern.experiments.interpret.diagnostic import train_guided

    monkeypatch.setenv("ATTNKERN_DATA", str(make_cache(tmp_path / "data", n_rated=400)))
    data = load_text_data("rt", 0, 80)
    cues = {data.vocab.stoi[w] for w in POSITIVE + NEGATIVE if w in data.vocab.stoi}

    def one_hot(seqs, on_cue):
        out = []
        for seq in seqs:
            at = [i for i, t in enumerate(seq) if (t in cues) == on_cue]
            w = torch.zeros(len(seq))
            w[at[0] if at else 0] = 1.0
            out.append(w)
        return out

    cfg = train_config("rt", "average", "softmax", 0, quick=True)
    scores = {}
    for on_cue in (True, False):
        weights = {name: one_hot(getattr(data, name)[0], on_cue) for name in ("train", "dev", "test")}
        scores[on_cue] = train_guided(cfg, data, weights)["accuracy"]
    assert scores[True] >= 0.9 and scores[False] <= 0.75, scores
