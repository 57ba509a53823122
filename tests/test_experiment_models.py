"""attnkern.experiments.models: seq2seq, multi-head seq2seq and the attention classifiers."""

from __future__ import annotations

import pytest
import torch
from helpers import train_on_keywords

from attnkern.experiments.data.synthetic import CopyTask, KeywordTask
from attnkern.experiments.models import AttentionClassifier, ClassifierOutput, MultiHeadSeq2Seq, Seq2Seq

NORMS = [("softmax", None), ("sparsemax", None), ("entmax15", None), ("entmax", "learnable")]
NORM_IDS = ["softmax", "sparsemax", "entmax15", "entmax-learnable"]


def copy_batch(task, B=8, seed=0):
    return task.sample(B, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("rnn, attention, layers", [("lstm", "general", 1), ("lstm", "dot", 2),
                                                    ("gru", "scaled_dot", 1)])
def test_seq2seq_shapes_probe_greedy(norm, rnn, attention, layers):
    task = CopyTask("iid", length=6)
    m = Seq2Seq(task.src_vocab, task.tgt_vocab, 8, 12, layers, rnn=rnn, attention=attention,
                normalizer=norm[0], alpha=norm[1])
    src, mask, tgt_in, tgt = copy_batch(task)
    mask[0, 4:] = False  # padding at the end of one row
    out = m(src, mask, tgt_in)
    assert out.logits.shape == (8, 6, task.tgt_vocab) and out.weights.shape == (8, 6, 6)
    assert torch.all(out.weights[0, :, 4:] == 0)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(8, 6))
    beta = m.probe(out, tgt)
    assert beta.shape == (8, 6, 6) and torch.all(beta <= 0)
    # β at a position equals the model's log-prob when all attention sits there
    w = torch.zeros(8, 6, 6)
    w[:, :, 2] = 1
    forced = m(src, mask, tgt_in, weights=w)
    lp = torch.log_softmax(forced.logits, -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(beta[:, :, 2], lp, atol=1e-5, rtol=1e-5)
    toks, ws = m.greedy(src, mask, 6)
    assert toks.shape == (8, 6) and ws.shape == (8, 6, 6)
    m.loss(out, tgt).backward()


@pytest.mark.parametrize("norm", NORMS[:3], ids=NORM_IDS[:3])
def test_seq2seq_training_reduces_loss(norm):
    torch.manual_seed(0)
    task = CopyTask("iid", length=5)
    m = Seq2Seq(task.src_vocab, task.tgt_vocab, 16, 32, normalizer=norm[0])
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        src, mask, tgt_in, tgt = task.sample(32, g)
        loss = m.loss(m(src, mask, tgt_in), tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_context_output_sees_the_source_only_through_the_attention():
    # output="context": logits = W_o c. With the attention weights given, the decoder's inputs (and so its
    # states) cannot change the logits; with the default Luong output they do.
    task = CopyTask("permutation", length=6)
    src, mask, tgt_in, _ = copy_batch(task)
    other_in = tgt_in.roll(1, dims=0)
    weights = torch.softmax(torch.randn(src.shape[0], 6, 6, generator=torch.Generator().manual_seed(3)), -1)
    for output, same in (("context", True), ("combined", False)):
        torch.manual_seed(0)
        m = Seq2Seq(task.src_vocab, task.tgt_vocab, 8, 8, output=output)
        a, b = m(src, mask, tgt_in, weights=weights).logits, m(src, mask, other_in, weights=weights).logits
        assert torch.allclose(a, b) == same
        out = m(src, mask, tgt_in)
        assert m.probe(out, tgt_in).shape == (src.shape[0], 6, 6)
    assert not hasattr(Seq2Seq(task.src_vocab, task.tgt_vocab, 8, 8, output="context"), "combine")
    with pytest.raises(ValueError, match="output must be one of"):
        Seq2Seq(task.src_vocab, task.tgt_vocab, 8, 8, output="tanh")


def test_uniform_mode_seq2seq():
    task = CopyTask("permutation", length=5)
    m = Seq2Seq(task.src_vocab, task.tgt_vocab, 8, 8, mode="uniform")
    out = m(*copy_batch(task)[:3])
    torch.testing.assert_close(out.weights, torch.full((8, 5, 5), 0.2))


def test_multihead_sums_heads_and_loads_states():
    task = CopyTask("permutation", length=5)
    kw = dict(embed_dim=8, hidden_dim=8, rnn="gru")
    single = Seq2Seq(task.src_vocab, task.tgt_vocab, **kw)
    mh = MultiHeadSeq2Seq(3, task.src_vocab, task.tgt_vocab, heads_from=[single.state_dict()], **kw)
    src, mask, tgt_in, tgt = copy_batch(task)
    logits = mh(src, mask, tgt_in)
    parts = [h(src, mask, tgt_in).logits for h in mh.heads]
    torch.testing.assert_close(logits, sum(parts))
    torch.testing.assert_close(parts[0], single(src, mask, tgt_in).logits)
    mh.loss(logits, tgt).backward()
    with pytest.raises(ValueError, match="heads_from"):
        MultiHeadSeq2Seq(1, task.src_vocab, task.tgt_vocab, heads_from=[single.state_dict()] * 2, **kw)


@pytest.mark.parametrize("encoder", ["bilstm", "cnn", "average"])
@pytest.mark.parametrize("attention", ["additive", "dot"])
@pytest.mark.parametrize("norm", NORMS, ids=NORM_IDS)
def test_classifier_contract(encoder, attention, norm):
    torch.manual_seed(0)
    m = AttentionClassifier(30, 3, encoder=encoder, attention=attention, normalizer=norm[0], alpha=norm[1],
                            embed_dim=8, hidden_dim=12)
    tokens = torch.randint(1, 30, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, 5:] = False
    tokens[~mask] = 0
    out = m(tokens, mask)
    assert isinstance(out, ClassifierOutput)
    assert out.logits.shape == (4, 3) and out.weights.shape == (4, 9) and out.hidden.shape == (4, 9, 12)
    assert torch.all(out.weights[1, 5:] == 0)
    r = m.relevance(out.hidden)
    assert r.shape == (4, 9, 3)
    torch.testing.assert_close(out.logits, (out.weights.unsqueeze(-1) * r).sum(1) + m.output.bias,
                               atol=1e-5, rtol=1e-5)
    emb = m.embed(tokens).detach().requires_grad_(True)
    out2 = m(tokens, mask, embeddings=emb)
    torch.testing.assert_close(out2.logits, out.logits)
    out2.logits.sum().backward()
    assert emb.grad is not None and emb.grad.shape == (4, 9, 8)
    ctx, w = m.attend(out.hidden, mask, weights=torch.full((4, 9), 1 / 9))
    assert ctx.shape == (4, 12)


def test_classifier_uniform_and_fixed_modes():
    m = AttentionClassifier(20, 2, encoder="average", mode="uniform", embed_dim=4, hidden_dim=8)
    tokens = torch.randint(1, 20, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    out = m(tokens, mask)
    torch.testing.assert_close(out.weights[0], torch.tensor([1 / 3] * 3 + [0, 0]))
    f = AttentionClassifier(20, 2, encoder="cnn", mode="fixed", embed_dim=4, hidden_dim=8)
    with pytest.raises(ValueError, match="weights"):
        f(tokens, mask)


@pytest.mark.parametrize("encoder", ["bilstm", "cnn", "average"])
def test_classifier_training_reduces_loss(encoder):
    torch.manual_seed(0)
    task = KeywordTask(n_filler=30, n_keywords=2, min_len=4, max_len=8)
    m = AttentionClassifier(task.vocab_size, 2, encoder=encoder, embed_dim=16, hidden_dim=16)
    losses = train_on_keywords(m, task, steps=40, batch=32)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


@pytest.mark.parametrize("normalizer", ["sparsemap", "crf"])
def test_chain_attention_does_not_collapse_to_the_empty_labeling(normalizer):
    """A BiLSTM with SparseMAP attention on the keyword task: from scores near
    0 (the pairwise scores at zero make the marginals clamp(score, 0, 1))
    training pushed every position below 0, where no gradient reaches the
    scores: all weights 0, no context, chance accuracy (0.496 before the
    unary bias). With the bias starting at 0.5 it learns the task."""
    torch.manual_seed(0)
    task = KeywordTask(n_filler=30, n_keywords=2, min_len=4, max_len=8)
    m = AttentionClassifier(task.vocab_size, 2, encoder="bilstm", embed_dim=16, hidden_dim=16, normalizer=normalizer)
    train_on_keywords(m, task, steps=150, batch=32)
    tokens, mask, labels, _ = task.sample(512, torch.Generator().manual_seed(99))
    with torch.no_grad():
        out = m(tokens, mask)
    assert (out.logits.argmax(-1) == labels).float().mean() >= 0.9
    assert (out.weights.sum(-1) > 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(encoder="gru"), "encoder"), (dict(attention="general"), "attention"),
    (dict(encoder="cnn", hidden_dim=10), "divisible by 4"), (dict(encoder="bilstm", hidden_dim=7), "even"),
    (dict(vocab_size=0), "vocab_size"), (dict(normalizer="hardmax"), "normalizer"),
])
def test_classifier_bad_arguments(bad, match):
    kw = dict(vocab_size=10, num_classes=2) | bad
    with pytest.raises(ValueError, match=match):
        AttentionClassifier(**kw)


def test_bad_tokens():
    m = AttentionClassifier(10, 2)
    with pytest.raises(TypeError, match="tokens"):
        m(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        m(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))
