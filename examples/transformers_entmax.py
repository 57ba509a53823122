"""Switch a Hugging Face model's attention to α-entmax, fine-tune it a few
steps, generate.

    python examples/transformers_entmax.py                 # a tiny Llama built from a config
    python examples/transformers_entmax.py --model PATH    # a causal LM saved on disk (config + weights)

Needs `pip install 'attnkern[transformers]'`. Nothing is downloaded: without
--model the model is random and the text it generates is noise; the point is
the three calls marked below.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import attnkern.integrations.transformers as ak_hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="directory of a saved causal LM (default: a tiny random Llama)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save", help="directory to save the fine-tuned model to")
    args = ap.parse_args()

    ak_hf.register()  # 1. make the "attnkern*" attention implementations known to transformers
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        model = AutoModelForCausalLM.from_config(config)
    # 2. entmax with a learnable α per layer and head (or normalizer="entmax15" / "sparsemax", or simply
    #    attn_implementation="attnkern_entmax15" when loading).
    ak_hf.configure(model, normalizer="entmax", alpha="learnable", alpha_init=1.5)

    vocab = model.config.vocab_size
    data = torch.randint(0, vocab, (64, 33), generator=torch.Generator().manual_seed(0))
    data[:, 1::2] = data[:, 0::2][:, :16]  # every second token repeats an earlier one: learnable structure
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built after configure(): it sees the α parameters
    model.train()
    for step in range(args.steps):
        batch = data[(step * 8) % 64:(step * 8) % 64 + 8]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == args.steps - 1:
            alphas = torch.cat([m.attnkern_alpha.alpha.detach() for m in ak_hf.attention_modules(model)])
            print(f"step {step:3d}  loss {loss.item():.3f}  α in [{alphas.min():.3f}, {alphas.max():.3f}]")

    model.eval()
    prompt = data[:2, :8]
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                         do_sample=False, pad_token_id=0)
    print("generated:", out[:, 8:].tolist())
    if args.save:
        model.save_pretrained(args.save)
        # 3. reload with the attnkern settings and the learned α values.
        again = ak_hf.from_pretrained(AutoModelForCausalLM, args.save)
        print("reloaded:", again.config.attnkern)


if __name__ == "__main__":
    main()
