"""Models for the attention experiments, every attention normalized by attnkern.

- `Seq2Seq`: LSTM (or GRU) encoder–decoder with Luong attention (Luong et al.,
  2015): the decoder state d_l attends over the encoder states h_t, and the
  output is W_o tanh(W_c [c_l; d_l]). Teacher forcing runs the decoder over the
  whole target at once (no input feeding, so attention is one batched call);
  `greedy` decodes step by step. `probe` computes the lexical probe β.
- `MultiHeadSeq2Seq`: several Seq2Seq heads whose output logits are summed
  (the toy of "Approximating How Single Head Attention Learns", section 5.2):
  each head has its own encoder, decoder and attention, so a head can start
  from a separately trained single-head model.
- `AttentionClassifier`: BiLSTM, CNN or averaging encoder, additive or dot
  attention with a learned query, and a linear output whose per-position
  value r_t = W h_t (the output relevance) gives logits = Σ_t a_t r_t + b.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from attnkern.nn.rnn_attention import AdditiveAttention, LuongAttention, ScaledDotAttention


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_tokens(tokens, name: str = "tokens") -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 2:
        what = getattr(tokens, "dtype", type(tokens).__name__)
        raise TypeError(f"{name} must be a (B, T) int64 tensor, got {what} of shape "
                        f"{tuple(getattr(tokens, 'shape', ()))}")


def _check_mask(mask, tokens, name: str = "mask") -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real position)")
    if mask.shape != tokens.shape:
        raise ValueError(f"{name} must have the tokens' shape {tuple(tokens.shape)}, got {tuple(mask.shape)}")


# --- sequence to sequence ------------------------------------------------------


class Seq2SeqOutput(NamedTuple):
    logits: torch.Tensor   # (B, L, V_out)
    weights: torch.Tensor  # (B, L, T) attention of each output step over the source
    encoder: torch.Tensor  # (B, T, H) encoder states h_t
    decoder: torch.Tensor  # (B, L, H) decoder states d_l


class Seq2Seq(nn.Module):
    """Encoder–decoder with Luong attention.

    src_vocab, tgt_vocab: vocabulary sizes (index `pad_idx` is padding in both;
      `bos_idx` of the target vocabulary starts decoding).
    embed_dim, hidden_dim, num_layers: of the embeddings and the RNNs.
    rnn: "lstm" (the paper's model) or "gru" (its multi-head toy).
    attention: "general" or "dot" (Luong), or "scaled_dot".
    normalizer, alpha, lam, mode, backend: of the attention (attnkern.nn.LuongAttention).
    output: "combined" (Luong's W_o tanh(W_c [c; d]), the default) or "context" (W_o c: the source reaches
      the output only through the attention, as in the simplified seq2seq of Snell et al.'s slides, y = W c,
      where the co-occurrence argument is made).
    """

    OUTPUTS = ("combined", "context")

    def __init__(self, src_vocab: int, tgt_vocab: int, embed_dim: int = 256, hidden_dim: int = 256,
                 num_layers: int = 1, rnn: str = "lstm", attention: str = "general", normalizer: str = "softmax",
                 alpha=None, mode: str = "learned", backend: str = "auto", pad_idx: int = 0, bos_idx: int = 1,
                 lam=None, output: str = "combined"):
        super().__init__()
        for name, v in (("src_vocab", src_vocab), ("tgt_vocab", tgt_vocab), ("embed_dim", embed_dim),
                        ("hidden_dim", hidden_dim), ("num_layers", num_layers)):
            _positive_int(v, name)
        if rnn not in ("lstm", "gru"):
            raise ValueError(f"rnn must be 'lstm' or 'gru', got {rnn!r}")
        if attention not in ("general", "dot", "scaled_dot"):
            raise ValueError(f"attention must be 'general', 'dot' or 'scaled_dot', got {attention!r}")
        if output not in self.OUTPUTS:
            raise ValueError(f"output must be one of {self.OUTPUTS}, got {output!r}")
        self.pad_idx, self.bos_idx, self.rnn_kind, self.output_kind = pad_idx, bos_idx, rnn, output
        self.src_embed = nn.Embedding(src_vocab, embed_dim, padding_idx=pad_idx)
        self.tgt_embed = nn.Embedding(tgt_vocab, embed_dim, padding_idx=pad_idx)
        cell = nn.LSTM if rnn == "lstm" else nn.GRU
        self.encoder = cell(embed_dim, hidden_dim, num_layers=num_layers, batch_first=True)
        self.decoder = cell(embed_dim, hidden_dim, num_layers=num_layers, batch_first=True)
        kw = dict(normalizer=normalizer, alpha=alpha, lam=lam, mode=mode, backend=backend)
        if attention == "scaled_dot":
            self.attention = ScaledDotAttention(hidden_dim, hidden_dim, **kw)
        else:
            self.attention = LuongAttention(hidden_dim, hidden_dim, kind=attention, **kw)
        if output == "combined":
            self.combine = nn.Linear(2 * hidden_dim, hidden_dim, bias=False)
        self.out = nn.Linear(hidden_dim, tgt_vocab)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor):
        """Encoder states (B, T, H) and the final RNN state (the decoder's initial
        state). Padding must be at the end of each row."""
        _check_tokens(src, "src")
        _check_mask(src_mask, src, "src_mask")
        emb = self.src_embed(src)
        lengths = src_mask.sum(1)
        if bool((lengths == src.shape[1]).all()):
            return self.encoder(emb)
        packed = nn.utils.rnn.pack_padded_sequence(emb, lengths.clamp_min(1).cpu(), batch_first=True,
                                                   enforce_sorted=False)
        h, state = self.encoder(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=src.shape[1])
        return h, state

    def output_logits(self, context: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
        """W_o tanh(W_c [c; d]) (or W_o c with output="context") for contexts and decoder states of the same
        shape (..., H)."""
        if self.output_kind == "context":
            return self.out(context)
        return self.out(torch.tanh(self.combine(torch.cat([context, dec], -1))))

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor, tgt_in: torch.Tensor,
                weights: torch.Tensor | None = None) -> Seq2SeqOutput:
        """Teacher forcing: tgt_in (B, L) is the target shifted right (BOS first).
        weights (B, L, T), if given, replace the attention's own."""
        _check_tokens(tgt_in, "tgt_in")
        enc, state = self.encode(src, src_mask)
        dec, _ = self.decoder(self.tgt_embed(tgt_in), state)
        context, w = self.attention(dec, enc, mask=src_mask, weights=weights)
        return Seq2SeqOutput(self.output_logits(context, dec), w, enc, dec)

    def loss(self, out: Seq2SeqOutput, tgt: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy against tgt (B, L), ignoring padding."""
        return F.cross_entropy(out.logits.flatten(0, 1), tgt.flatten(), ignore_index=self.pad_idx)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, src_mask: torch.Tensor, max_len: int):
        """Greedy decoding for max_len steps: (tokens (B, max_len), weights (B, max_len, T))."""
        _positive_int(max_len, "max_len")
        enc, state = self.encode(src, src_mask)
        tok = torch.full((src.shape[0], 1), self.bos_idx, dtype=torch.long, device=src.device)
        outs, ws = [], []
        for _ in range(max_len):
            dec, state = self.decoder(self.tgt_embed(tok), state)
            context, w = self.attention(dec[:, 0], enc, mask=src_mask)
            tok = self.output_logits(context, dec[:, 0]).argmax(-1, keepdim=True)
            outs.append(tok)
            ws.append(w)
        return torch.cat(outs, 1), torch.stack(ws, 1)

    def probe(self, out: Seq2SeqOutput, tgt: torch.Tensor) -> torch.Tensor:
        """The lexical probe β (B, L, T): log p(tgt_l | context = h_t, decoder state d_l),
        the log-probability of the gold output token when a single encoder state
        is the whole context (knowledge to translate individual words)."""
        enc, dec = out.encoder, out.decoder
        B, L, T, H = dec.shape[0], dec.shape[1], enc.shape[1], enc.shape[2]
        if self.output_kind == "context":  # W_o h_t, the same for every output step
            logits = self.out(enc).unsqueeze(1).expand(B, L, T, -1)
        else:
            # W_c [h_t; d_l] = W_h h_t + W_d d_l: project each side once, then combine (B, L, T, H)
            w_h, w_d = self.combine.weight[:, :H], self.combine.weight[:, H:]
            hidden = torch.tanh((enc @ w_h.T).unsqueeze(1) + (dec @ w_d.T).unsqueeze(2))
            logits = self.out(hidden)
        gold = logits.gather(-1, tgt.view(B, L, 1, 1).expand(B, L, T, 1)).squeeze(-1)
        return gold - torch.logsumexp(logits, -1)


class MultiHeadSeq2Seq(nn.Module):
    """`heads` independent Seq2Seq models whose output logits are summed. Keyword
    arguments go to every head; `heads_from` (a list of Seq2Seq state dicts,
    at most `heads`) initializes the first heads."""

    def __init__(self, heads: int, *args, heads_from=None, **kwargs):
        super().__init__()
        _positive_int(heads, "heads")
        if heads_from is not None and len(heads_from) > heads:
            raise ValueError(f"heads_from has {len(heads_from)} states for {heads} heads")
        self.heads = nn.ModuleList(Seq2Seq(*args, **kwargs) for _ in range(heads))
        for head, state in zip(self.heads, heads_from or [], strict=False):
            head.load_state_dict(state)
        self.pad_idx = self.heads[0].pad_idx

    def forward(self, src, src_mask, tgt_in) -> torch.Tensor:
        """Logits (B, L, V_out): the sum of the heads' logits."""
        return torch.stack([h(src, src_mask, tgt_in).logits for h in self.heads]).sum(0)

    def loss(self, logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=self.pad_idx)


# --- text classification ---------------------------------------------------------


class ClassifierOutput(NamedTuple):
    logits: torch.Tensor   # (B, C)
    weights: torch.Tensor  # (B, T)
    hidden: torch.Tensor   # (B, T, D)


class AttentionClassifier(nn.Module):
    """Text classifier: embedding, encoder, attention with a learned query, linear output.

    encoder: "bilstm" (hidden_dim // 2 per direction), "cnn" (kernel widths
      1/3/5/7, hidden_dim // 4 channels each, ReLU, concatenated) or "average"
      (Linear + tanh on each embedding); every encoder gives h (B, T, hidden_dim).
    attention: "additive" (v·tanh(W h_t + U q)) or "dot" (q·h_t / sqrt(D)), q a
      learned vector; normalizer, alpha, lam, mode, backend: as attnkern.nn's modules.
    The output layer gives r_t = W h_t (B, T, C) (the output relevance) and
    logits = Σ_t a_t r_t + b.
    """

    ENCODERS = ("bilstm", "cnn", "average")
    ATTENTIONS = ("additive", "dot")
    CNN_WIDTHS = (1, 3, 5, 7)

    def __init__(self, vocab_size: int, num_classes: int, encoder: str = "bilstm", attention: str = "additive",
                 normalizer: str = "softmax", alpha=None, mode: str = "learned", embed_dim: int = 128,
                 hidden_dim: int = 128, padding_idx: int = 0, backend: str = "auto", lam=None):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("num_classes", num_classes), ("embed_dim", embed_dim),
                        ("hidden_dim", hidden_dim)):
            _positive_int(v, name)
        if encoder not in self.ENCODERS:
            raise ValueError(f"encoder must be one of {self.ENCODERS}, got {encoder!r}")
        if attention not in self.ATTENTIONS:
            raise ValueError(f"attention must be one of {self.ATTENTIONS}, got {attention!r}")
        if encoder == "bilstm" and hidden_dim % 2:
            raise ValueError(f"encoder='bilstm' needs an even hidden_dim, got {hidden_dim}")
        if encoder == "cnn" and hidden_dim % 4:
            raise ValueError(f"encoder='cnn' needs hidden_dim divisible by 4, got {hidden_dim}")
        self.encoder_kind, self.hidden_dim, self.padding_idx = encoder, hidden_dim, padding_idx
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx)
        if encoder == "bilstm":
            self.rnn = nn.LSTM(embed_dim, hidden_dim // 2, batch_first=True, bidirectional=True)
        elif encoder == "cnn":
            self.convs = nn.ModuleList(nn.Conv1d(embed_dim, hidden_dim // 4, w, padding=w // 2)
                                       for w in self.CNN_WIDTHS)
        else:
            self.proj = nn.Linear(embed_dim, hidden_dim)
        kw = dict(normalizer=normalizer, alpha=alpha, lam=lam, mode=mode, backend=backend)
        if attention == "additive":
            self.attention = AdditiveAttention(hidden_dim, hidden_dim, hidden_dim, **kw)
        else:
            self.attention = ScaledDotAttention(hidden_dim, hidden_dim, **kw)
        self.query = nn.Parameter(torch.randn(hidden_dim) / hidden_dim ** 0.5)
        self.output = nn.Linear(hidden_dim, num_classes)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, E) embeddings."""
        _check_tokens(tokens)
        return self.embedding(tokens)

    def encode(self, tokens: torch.Tensor, mask: torch.Tensor, embeddings: torch.Tensor | None = None):
        """Hidden states h (B, T, D); `embeddings` (B, T, E), if given, replace the lookup."""
        _check_tokens(tokens)
        _check_mask(mask, tokens)
        emb = self.embedding(tokens) if embeddings is None else embeddings
        emb = emb * mask.unsqueeze(-1).to(emb.dtype)
        if self.encoder_kind == "bilstm":
            lengths = mask.sum(1).clamp_min(1).cpu()
            packed = nn.utils.rnn.pack_padded_sequence(emb, lengths, batch_first=True, enforce_sorted=False)
            h, _ = self.rnn(packed)
            h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=tokens.shape[1])
        elif self.encoder_kind == "cnn":
            x = emb.transpose(1, 2)
            h = torch.cat([F.relu(conv(x)) for conv in self.convs], 1).transpose(1, 2)
        else:
            h = torch.tanh(self.proj(emb))
        return h * mask.unsqueeze(-1).to(h.dtype)

    def attend(self, h: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None):
        """(context (B, D), weights (B, T)) of the learned query over h (B, T, D)."""
        q = self.query.expand(h.shape[0], -1)
        return self.attention(q, h, mask=mask, weights=weights)

    def relevance(self, h: torch.Tensor) -> torch.Tensor:
        """Output relevance r (B, T, C) = W h_t, so that logits = Σ_t a_t r_t + b."""
        return F.linear(h, self.output.weight)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None,
                embeddings: torch.Tensor | None = None) -> ClassifierOutput:
        h = self.encode(tokens, mask, embeddings)
        context, w = self.attend(h, mask, weights)
        return ClassifierOutput(self.output(context), w, h)
