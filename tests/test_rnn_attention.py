"""attnkern.nn attention modules for recurrent models: shapes, masks, modes, normalizers."""

from __future__ import annotations

import pytest
import torch

import attnkern
from attnkern.backends import reference as ref
from attnkern.nn import AdditiveAttention, LuongAttention, ScaledDotAttention

NORMS = [("softmax", None), ("sparsemax", None), ("entmax15", None), ("entmax", 1.3), ("entmax", "learnable")]
NORM_IDS = ["softmax", "sparsemax", "entmax15", "entmax1.3", "entmax-learnable"]


def make(kind, normalizer="softmax", alpha=None, mode="learned", backend="auto", d=6):
    kw = dict(normalizer=normalizer, alpha=alpha, mode=mode, backend=backend)
    if kind == "dot":
        return LuongAttention(d, d, kind="dot", **kw)
    if kind == "general":
        return LuongAttention(d, d + 2, kind="general", **kw)
    if kind == "additive":
        return AdditiveAttention(d, d + 2, 5, **kw)
    return ScaledDotAttention(d, d, **kw)


def keydim(kind, d=6):
    return d + 2 if kind in ("general", "additive") else d


KINDS = ["dot", "general", "additive", "scaled"]


def inputs(kind, B=3, T=7, L=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((B, 6) if L is None else (B, L, 6), generator=g, requires_grad=True)
    k = torch.randn(B, T, keydim(kind), generator=g, requires_grad=True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    return q, k, mask


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("steps", [None, 4], ids=["one-step", "four-steps"])
def test_shapes_masks_and_simplex(kind, norm, steps):
    att = make(kind, *norm)
    q, k, mask = inputs(kind, L=steps)
    v = torch.randn(3, 7, 4)
    ctx, w = att(q, k, v, mask=mask)
    lead = (3,) if steps is None else (3, steps)
    assert ctx.shape == (*lead, 4) and w.shape == (*lead, 7)
    wm = w if steps is not None else w.unsqueeze(1)
    assert torch.all(wm[1, :, 4:] == 0) and torch.all(wm[2, :, 1:] == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(lead))
    assert torch.all(w >= 0)
    torch.testing.assert_close(ctx, (w.unsqueeze(-1) * (v if steps is None else v.unsqueeze(1))).sum(-2))
    (ctx.sum() + (w * torch.randn_like(w)).sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("norm", NORMS[:4], ids=NORM_IDS[:4])
def test_normalize_matches_reference_and_kernel_is_used(norm):
    att = make("general", *norm)
    s = torch.randn(4, 9)
    mask = torch.rand(4, 9) > 0.3
    mask[:, 0] = True
    w = att.normalize(s, mask)
    expected = {"softmax": ref.softmax, "sparsemax": ref.sparsemax, "entmax15": ref.entmax15,
                "entmax": lambda x, d: ref.entmax(x, torch.tensor(1.3), d)}[norm[0]]
    # Rows of 9 unit scores: the kernel to a few roundings, tighter than the row-wise rule.
    torch.testing.assert_close(w, expected(s.masked_fill(~mask, float("-inf")), -1), atol=1e-6, rtol=1e-5)
    if norm[0] in ("sparsemax", "entmax15"):
        assert (w == 0).sum() > (~mask).sum()  # sparse beyond the mask


def test_sparsemax_weights_are_sparse_and_softmax_dense():
    s = torch.tensor([[3.0, 1.0, 0.0, -2.0]])
    assert (make("dot", "sparsemax").normalize(s) == 0).sum() == 3
    assert (make("dot", "softmax").normalize(s) > 0).all()


def test_backend_reference_agrees_with_kernel():
    q, k, mask = inputs("general", L=3)
    a = make("general", "entmax15")
    b = make("general", "entmax15", backend="reference")
    b.load_state_dict(a.state_dict())
    # As in test_normalize_matches_reference_and_kernel_is_used: tighter than the row-wise rule.
    torch.testing.assert_close(a(q, k, mask=mask)[1], b(q, k, mask=mask)[1], atol=1e-6, rtol=1e-5)


def test_uniform_mode_has_no_gradient_to_scores():
    att = make("general", mode="uniform")
    q, k, mask = inputs("general")
    ctx, w = att(q, k, mask=mask)
    torch.testing.assert_close(w[1, :4], torch.full((4,), 0.25))
    torch.testing.assert_close(w[2, 0], torch.tensor(1.0))
    ctx.sum().backward()
    assert att.W.weight.grad is None and q.grad is None
    assert k.grad is not None  # values still get gradient


def test_fixed_mode_requires_and_uses_weights():
    att = make("dot", mode="fixed")
    q, k, mask = inputs("dot")
    with pytest.raises(ValueError, match="weights"):
        att(q, k, mask=mask)
    w = torch.zeros(3, 7)
    w[:, 2] = 1
    ctx, w2 = att(q, k, mask=mask, weights=w)
    torch.testing.assert_close(ctx, k[:, 2])
    assert w2 is w
    with pytest.raises(ValueError, match="weights must have shape"):
        att(q, k, mask=mask, weights=torch.zeros(3, 6))


def test_learnable_alpha_gets_gradient_and_stays_in_range():
    att = make("general", "entmax", "learnable")
    assert 1 < float(att.alpha.detach()) < 2
    q, k, mask = inputs("general", L=2)
    ctx, _ = att(q, k, mask=mask)
    (ctx ** 2).sum().backward()
    assert att.alpha_theta.grad is not None and torch.isfinite(att.alpha_theta.grad)


def test_all_masked_row_gives_zeros():
    att = make("dot", "sparsemax")
    q, k, _ = inputs("dot")
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0] = False
    ctx, w = att(q, k, mask=mask)
    assert torch.all(w[0] == 0) and torch.all(ctx[0] == 0) and torch.isfinite(w).all()


@pytest.mark.parametrize("bad, match", [
    (dict(normalizer="relu"), "normalizer"), (dict(mode="hard"), "mode"), (dict(backend="gpu"), "backend"),
    (dict(normalizer="entmax"), "alpha"), (dict(normalizer="entmax", alpha=-1.0), "alpha"),
    (dict(normalizer="softmax", alpha=1.5), "alpha"),
])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        LuongAttention(4, 4, **bad)


def test_bad_shapes_and_kinds():
    with pytest.raises(ValueError, match="kind"):
        LuongAttention(4, 4, kind="concat")
    with pytest.raises(ValueError, match="query_dim == key_dim"):
        LuongAttention(4, 5, kind="dot")
    att = LuongAttention(4, 4)
    with pytest.raises(ValueError, match="keys"):
        att(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="mask"):
        att(torch.randn(2, 4), torch.randn(2, 3, 4), mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        att.normalize(torch.randn(2, 3), torch.ones(2, 3))
    # The feature sizes the module was built for, and tensors for every input.
    with pytest.raises(ValueError, match="Dq=4"):
        att(torch.randn(2, 3, 5), torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="Dk=4"):
        att(torch.randn(2, 4), torch.randn(2, 5, 3))
    with pytest.raises(TypeError, match="values"):
        att(torch.randn(2, 4), torch.randn(2, 5, 4), [1, 2])


@pytest.mark.parametrize("norm", NORMS, ids=NORM_IDS)
def test_training_reduces_loss(norm):
    """Learn to attend to the key that equals the query (a retrieval toy)."""
    torch.manual_seed(0)
    att = LuongAttention(8, 8, kind="general", normalizer=norm[0], alpha=norm[1])
    opt = torch.optim.Adam(att.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(40):
        k = torch.randn(16, 6, 8, generator=g)
        target = torch.randint(0, 6, (16,), generator=g)
        q = k[torch.arange(16), target]
        _, w = att(q, k)
        loss = -(w[torch.arange(16), target] + 1e-6).log().mean() if norm[0] == "softmax" else \
            ((w - torch.nn.functional.one_hot(target, 6).float()) ** 2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])


def test_exported():
    assert attnkern.nn.LuongAttention is LuongAttention


@pytest.mark.parametrize("normalizer", ["crf", "sparsemap"])
@pytest.mark.parametrize("steps", [None, 4], ids=["one-step", "four-steps"])
def test_chain_marginals_as_attention(normalizer, steps):
    """crf / sparsemap: the weights are the chain's marginals of the masked
    scores under the module's learnable pairwise scores, masked positions 0,
    context = Σ μ_i v_i, and the pairwise scores receive a gradient."""
    att = make("general", normalizer)
    assert att.alpha is None and att.pairwise.shape == (2, 2) and torch.all(att.pairwise == 0)
    with torch.no_grad():
        att.pairwise.copy_(torch.tensor([[0.3, -0.7], [-0.2, 1.1]]))
    q, k, mask = inputs("general", L=steps)
    v = torch.randn(3, 7, 4)
    ctx, w = att(q, k, v, mask=mask)
    scores = att.scores(q, k)
    m = mask if steps is None else mask.unsqueeze(1)
    op = attnkern.crf_marginals if normalizer == "crf" else attnkern.sparsemap_chain
    assert att.unary_bias == (0.5 if normalizer == "sparsemap" else 0.0)
    torch.testing.assert_close(w, op(scores.masked_fill(~m, float("-inf")) + att.unary_bias, att.pairwise))
    wm = w if steps is not None else w.unsqueeze(1)
    assert torch.all(wm[1, :, 4:] == 0) and torch.all(wm[2, :, 1:] == 0)
    assert torch.all((w >= 0) & (w <= 1))
    torch.testing.assert_close(ctx, (w.unsqueeze(-1) * (v if steps is None else v.unsqueeze(1))).sum(-2))
    (ctx.sum() + (w * torch.randn_like(w)).sum()).backward()
    assert att.pairwise.grad is not None and att.pairwise.grad.abs().sum() > 0
    assert att.unary_bias.grad is not None and att.unary_bias.grad != 0
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    with pytest.raises(ValueError, match="takes neither alpha nor lam"):
        make("dot", normalizer, alpha=1.5)


def test_crf_attention_from_zero_pairwise_is_the_sigmoid():
    """With the pairwise scores at their start (zeros) the positions are
    independent: P(z_i = 1) = sigmoid(score_i)."""
    att = make("dot", "crf")
    s = torch.randn(2, 6)
    torch.testing.assert_close(att.normalize(s), torch.sigmoid(s))
