"""attnkern as a transformers attention backend: tiny models built from
configurations in code (no weights are downloaded), against transformers'
own "sdpa" backend."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'attnkern[transformers]')")

import attnkern.integrations.transformers as ak_hf  # noqa: E402

ak_hf.register()

VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def _decoder_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama": LlamaConfig(**SIZES, num_key_value_heads=2),
        "qwen2": Qwen2Config(**SIZES, num_key_value_heads=2),
        # A window shorter than the sequences below, so the mask carries it.
        "mistral": MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=5),
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                        bos_token_id=0, eos_token_id=0),
    }


def _build(config, implementation, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.eval()


def _left_padded_batch(seed=1, lengths=(12, 9, 12)):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, n - length:] = 1
    return ids, mask


def _logits_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    # Padding queries attend to nothing: zeros here, something else in sdpa; compare real tokens only.
    (logits[keep].sin().sum()).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return logits[keep].detach(), grads


def _close(a, b, what):
    scale = max(b.abs().max().item(), 1.0)
    assert (a - b).abs().max().item() <= 2e-5 * scale, f"{what}: max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_softmax_matches_sdpa_on_padded_decoder(arch):
    config = _decoder_configs()[arch]
    ids, mask = _left_padded_batch()
    want = _logits_and_grads(_build(config, "sdpa"), ids, mask)
    got = _logits_and_grads(_build(config, "attnkern_softmax"), ids, mask)
    _close(got[0], want[0], f"{arch} logits")
    assert got[1].keys() == want[1].keys()
    for k in want[1]:
        _close(got[1][k], want[1][k], f"{arch} grad {k}")


def test_softmax_matches_sdpa_without_padding():
    # No mask reaches the kernels: causal attention goes as is_causal.
    config = _decoder_configs()["llama"]
    ids, _ = _left_padded_batch(lengths=(10, 10))
    mask = torch.ones_like(ids)
    want = _logits_and_grads(_build(config, "sdpa"), ids, mask)
    got = _logits_and_grads(_build(config, "attnkern_softmax"), ids, mask)
    _close(got[0], want[0], "logits")


def test_softmax_matches_sdpa_on_padded_bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64)
    ids, mask = _left_padded_batch(lengths=(12, 7, 10))
    mask = mask.flip(1)  # right padding, as BERT batches come
    outs = []
    for impl in ("sdpa", "attnkern_softmax"):
        torch.manual_seed(0)
        model = BertModel(config, add_pooling_layer=False)
        model.set_attn_implementation(impl)
        model.eval()
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        h[mask.bool()].sum().backward()
        outs.append((h[mask.bool()].detach(), model.encoder.layer[0].attention.self.query.weight.grad.clone()))
    _close(outs[1][0], outs[0][0], "hidden states")
    _close(outs[1][1], outs[0][1], "query weight grad")


@pytest.mark.parametrize("implementation", ["attnkern_sparsemax", "attnkern_entmax15"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_sparse_training_step(arch, implementation):
    model = _build(_decoder_configs()[arch], implementation).train()
    ids, mask = _left_padded_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert math.isfinite(out.loss.item())


def test_learnable_alpha_gets_gradients_and_moves():
    model = _build(_decoder_configs()["qwen2"], "sdpa").train()
    ak_hf.configure(model, normalizer="entmax", alpha="learnable", alpha_init=1.5)
    thetas = [p for k, p in model.named_parameters() if k.endswith("attnkern_alpha.theta")]
    assert len(thetas) == 2 and all(t.shape == (4,) for t in thetas)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ids, mask = _left_padded_batch()
    before = torch.stack([t.detach().clone() for t in thetas])
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in thetas)
        opt.step()
    assert not torch.equal(before, torch.stack([t.detach() for t in thetas]))


def test_fixed_alpha_is_read_from_config():
    config = _decoder_configs()["llama"]
    ids, mask = _left_padded_batch()
    model = _build(config, "sdpa")
    ak_hf.configure(model, normalizer="entmax", alpha=1.5)
    assert model.config.attnkern == {"normalizer": "entmax", "alpha": 1.5}
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = _build(config, "attnkern_entmax15")(input_ids=ids, attention_mask=mask).logits
    # α = 1.5 through the generic α path against the entmax15 kernels.
    _close(got[mask.bool()], want[mask.bool()], "entmax α=1.5 against entmax15")


@pytest.mark.parametrize("implementation", ["attnkern_softmax", "attnkern_sparsemax", "attnkern_entmax15"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_cached_decoding_matches_recomputation(arch, implementation):
    model = _build(_decoder_configs()[arch], implementation)
    ids, mask = _left_padded_batch(lengths=(8, 6, 8))
    steps = 4
    g = torch.Generator().manual_seed(3)
    new = torch.randint(0, VOCAB, (ids.shape[0], steps), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.cache
        for t in range(steps):
            full_ids = torch.cat([ids, new[:, :t + 1]], 1)
            full_mask = torch.cat([mask, torch.ones(ids.shape[0], t + 1, dtype=mask.dtype)], 1)
            step = model(input_ids=new[:, t:t + 1], attention_mask=full_mask, cache=cache, use_cache=True)
            cache = step.cache
            recomputed = model(input_ids=full_ids, attention_mask=full_mask).logits[:, -1]
            _close(step.logits[:, -1], recomputed, f"step {t}")


def test_generate_with_learnable_alpha():
    model = _build(_decoder_configs()["llama"], "sdpa")
    ak_hf.configure(model, normalizer="entmax", alpha="learnable")
    ids, mask = _left_padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (ids.shape[0], ids.shape[1] + 5)


def test_output_attentions_returns_sparse_weights():
    model = _build(_decoder_configs()["llama"], "attnkern_sparsemax")
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 2
    w = out.attentions[0]
    assert w.shape == (3, 4, 12, 12)
    real = mask.bool()
    sums = w.sum(-1)  # (B, H, L)
    assert torch.allclose(sums.permute(0, 2, 1)[real], torch.ones(()), atol=1e-5)
    assert (w == 0).any()
    assert (w.triu(1) == 0).all()  # causal


def test_save_and_load_round_trip(tmp_path):
    model = _build(_decoder_configs()["llama"], "sdpa")
    ak_hf.configure(model, normalizer="entmax", alpha="learnable", alpha_init=1.3)
    with torch.no_grad():
        for k, p in model.named_parameters():
            if k.endswith("attnkern_alpha.theta"):
                p.copy_(torch.linspace(-1, 1, p.numel()))
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = ak_hf.from_pretrained(AutoModelForCausalLM, tmp_path).eval()
    assert loaded.config.attnkern == {"normalizer": "entmax", "alpha": "learnable", "alpha_init": 1.3}
    assert loaded.config._attn_implementation == "attnkern"
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           loaded(input_ids=ids, attention_mask=mask).logits)


def test_bad_configuration_is_refused():
    model = _build(_decoder_configs()["llama"], "sdpa")
    with pytest.raises(ValueError, match="normalizer"):
        ak_hf.configure(model, normalizer="fancymax")
    with pytest.raises(ValueError, match="alpha"):
        ak_hf.configure(model, normalizer="entmax", alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        ak_hf.configure(model, normalizer="sparsemax", alpha=1.5)
    unconfigured = _build(_decoder_configs()["llama"], "attnkern")
    ids, mask = _left_padded_batch()
    with pytest.raises(ValueError, match="configure"):
        unconfigured(input_ids=ids, attention_mask=mask)


def test_model_outside_the_interface_is_refused():
    from transformers import PretrainedConfig, PreTrainedModel

    class OwnAttentionModel(PreTrainedModel):
        config_class = PretrainedConfig
        _supports_attention_backend = False

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(TypeError, match="OwnAttentionModel"):
        ak_hf.configure(OwnAttentionModel(PretrainedConfig()), normalizer="sparsemax")


@pytest.mark.slow
def test_compiled_model_matches_eager():
    model = _build(_decoder_configs()["llama"], "attnkern_sparsemax")
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(model)
        got = compiled(input_ids=ids, attention_mask=mask).logits
    _close(got[mask.bool()], want[mask.bool()], "compiled logits")
