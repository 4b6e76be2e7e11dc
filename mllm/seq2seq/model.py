"""Sequence to sequence: Bahdanau's RNN encoder-decoder and the transformer, trained with teacher
forcing and decoded one target token a step."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm import UserError
from mllm.config import Seq2SeqConfig
from mllm.transformer import causal_mask, explicit_attention, sinusoidal_positions

# Every vocabulary of this family starts <unk>, <pad>, <bos>, <eos> (mllm.seq2seq.pairs builds it so).
SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 1, 2, 3


def build_seq2seq(cfg: Seq2SeqConfig) -> nn.Module:
    if cfg.src_vocab_size <= len(SPECIALS) or cfg.tgt_vocab_size <= len(SPECIALS):
        raise UserError(
            "model.src_vocab_size/tgt_vocab_size are unset: set them to the vocabularies' "
            "sizes (mllm.seq2seq.pairs.vocab_sizes) before building the model"
        )
    return Seq2SeqRNN(cfg) if cfg.arch == "seq2seq-rnn" else Seq2SeqTransformer(cfg)


def _loss(logits, tgt_out):
    if tgt_out is None:
        return None
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1), ignore_index=-1)


# ---------------------------------------------------------------------------------------------
# RNN encoder-decoder with additive attention


class AdditiveAttention(nn.Module):
    """Bahdanau's attention: the decoder state asks, every encoder output o_s answers."""

    def __init__(self, query_size: int, key_size: int, size: int):
        super().__init__()
        self.W = nn.Linear(query_size, size, bias=False)
        self.U = nn.Linear(key_size, size)
        self.v = nn.Linear(size, 1, bias=False)

    def keys(self, outputs):
        # U o_s does not depend on the step: computed once per source, not once per target token.
        return self.U(outputs)

    def forward(self, query, keys, outputs, src_pad):
        """query [B, Hq], keys [B, S, A], outputs [B, S, Hk], src_pad [B, S] -> (c [B, Hk], a [B, S])."""
        e = self.v(torch.tanh(self.W(query)[:, None] + keys)).squeeze(-1)
        a = e.masked_fill(src_pad, float("-inf")).softmax(dim=-1)
        return torch.bmm(a[:, None], outputs).squeeze(1), a


class Seq2SeqRNN(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.config = cfg
        E, H, L = cfg.n_embd, cfg.hidden_size, cfg.n_layer
        rnn = nn.GRU if cfg.cell == "gru" else nn.LSTM
        self.src_embedding = nn.Embedding(cfg.src_vocab_size, E, padding_idx=PAD_ID)
        self.encoder = rnn(E, H, L, batch_first=True, bidirectional=True, dropout=cfg.dropout if L > 1 else 0.0)
        # The decoder starts from both directions' last states (Bahdanau: from the backward one).
        self.bridge = nn.Linear(2 * H, H)
        self.tgt_embedding = nn.Embedding(cfg.tgt_vocab_size, E, padding_idx=PAD_ID)
        self.attention = AdditiveAttention(H, 2 * H, H)
        self.decoder = nn.GRUCell(E + 2 * H, H)
        # Reads the new state, the context and the previous token (Bahdanau's deep output, linear).
        self.out = nn.Linear(H + 2 * H + E, cfg.tgt_vocab_size)
        self.drop = nn.Dropout(cfg.dropout)

    def encode(self, src) -> dict:
        pad = src == PAD_ID
        lengths = (~pad).sum(1).clamp(min=1).cpu()
        x = self.drop(self.src_embedding(src))
        # Packing lets the backward direction start at each source's last real token, not at padding.
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h = self.encoder(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        h = h[0] if isinstance(h, tuple) else h  # LSTM: (h, c); the decoder starts from h
        last = torch.cat([h[-2], h[-1]], dim=-1)  # top layer, forward and backward
        return {"outputs": out, "keys": self.attention.keys(out), "pad": pad, "init": torch.tanh(self.bridge(last))}

    def start(self, memory: dict):
        return memory["init"]

    def step(self, memory: dict, state, token):
        """One target token [B] in -> (logits [B, V], new state, attention [B, S])."""
        emb = self.drop(self.tgt_embedding(token))
        context, a = self.attention(state, memory["keys"], memory["outputs"], memory["pad"])
        state = self.decoder(torch.cat([emb, context], dim=-1), state)
        logits = self.out(self.drop(torch.cat([state, context, emb], dim=-1)))
        return logits, state, a

    @staticmethod
    def reorder(state, index):
        return state[index]

    def forward(self, src, tgt_in, tgt_out=None):
        memory = self.encode(src)
        state, logits = self.start(memory), []
        for t in range(tgt_in.size(1)):
            step_logits, state, _ = self.step(memory, state, tgt_in[:, t])
            logits.append(step_logits)
        logits = torch.stack(logits, dim=1)
        return logits, _loss(logits, tgt_out), None

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------------------------------
# Transformer encoder-decoder


class MultiHeadAttention(nn.Module):
    """softmax(q k^T / sqrt(d_head) + mask) v in each head, the heads concatenated and projected."""

    def __init__(self, d: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.n_head, self.d_head = n_head, d // n_head
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(dropout)

    def _heads(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # [B, h, T, d_head]

    def forward(self, query, key, value, mask=None, key_pad=None, cache: dict | None = None, static: bool = False):
        """query [B, Tq, d], key/value [B, Tk, d]; mask [Tq, Tk] additive; key_pad [B, Tk] True at padding.

        With a `cache` (decoding token by token) the new keys and values are appended to the cached
        ones; `static` ones (the encoder's, for cross-attention) are projected once and reused.
        Returns the output [B, Tq, d] and each head's weights [B, h, Tq, Tk].
        """
        q = self._heads(self.q(query))
        if cache is not None and static and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self._heads(self.k(key)), self._heads(self.v(value))
            if cache is not None:
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        y, weights = explicit_attention(q, k, v, mask, key_pad, self.drop.p if self.training else 0.0)
        B, _, Tq, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, Tq, -1)), weights


class FeedForward(nn.Module):
    def __init__(self, d: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.linear2(self.drop(F.relu(self.linear1(x))))


class _Block(nn.Module):
    """Residual sublayers; post-norm is x = LN(x + f(x)) (the paper), pre-norm x = x + f(LN(x))."""

    def _sub(self, x, norm, f):
        if self.pre:
            return x + self.drop(f(norm(x)))
        return norm(x + self.drop(f(x)))


class EncoderLayer(_Block):
    def __init__(self, d: int, n_head: int, d_ff: int, dropout: float, pre: bool):
        super().__init__()
        self.pre = pre
        self.self_attn = MultiHeadAttention(d, n_head, dropout)
        self.ff = FeedForward(d, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, src_pad):
        x = self._sub(x, self.norm1, lambda h: self.self_attn(h, h, h, key_pad=src_pad)[0])
        return self._sub(x, self.norm2, self.ff)


class DecoderLayer(_Block):
    def __init__(self, d: int, n_head: int, d_ff: int, dropout: float, pre: bool):
        super().__init__()
        self.pre = pre
        self.self_attn = MultiHeadAttention(d, n_head, dropout)
        self.cross_attn = MultiHeadAttention(d, n_head, dropout)
        self.ff = FeedForward(d, d_ff, dropout)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)
        self.cross_weights = None

    def forward(self, x, memory, mask, tgt_pad, src_pad, cache: dict | None = None):
        """cache: {"self": {}, "cross": {}} of this layer when x is only the next position."""
        self_cache, cross_cache = (cache["self"], cache["cross"]) if cache is not None else (None, None)
        x = self._sub(x, self.norm1, lambda h: self.self_attn(h, h, h, mask, tgt_pad, self_cache)[0])

        def cross(h):
            y, self.cross_weights = self.cross_attn(h, memory, memory, key_pad=src_pad, cache=cross_cache, static=True)
            return y

        x = self._sub(x, self.norm2, cross)
        return self._sub(x, self.norm3, self.ff)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.config = cfg
        d, pre = cfg.n_embd, cfg.norm == "pre"
        d_ff = cfg.d_ff or 4 * d
        self.src_embedding = nn.Embedding(cfg.src_vocab_size, d, padding_idx=PAD_ID)
        self.tgt_embedding = nn.Embedding(cfg.tgt_vocab_size, d, padding_idx=PAD_ID)
        # +1: the target side holds <bos> or <eos> besides max_tgt_len tokens.
        self.register_buffer("pe", sinusoidal_positions(max(cfg.max_src_len, cfg.max_tgt_len) + 1, d), persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(d, cfg.n_head, d_ff, cfg.dropout, pre) for _ in range(cfg.n_layer))
        self.decoder = nn.ModuleList(DecoderLayer(d, cfg.n_head, d_ff, cfg.dropout, pre) for _ in range(cfg.n_layer))
        # Pre-norm leaves the residual stream unnormalised: one LayerNorm after each stack.
        self.enc_norm = nn.LayerNorm(d) if pre else nn.Identity()
        self.dec_norm = nn.LayerNorm(d) if pre else nn.Identity()
        self.head = nn.Linear(d, cfg.tgt_vocab_size)
        self.drop = nn.Dropout(cfg.dropout)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)  # as torch.nn.Transformer and the annotated transformer
        if cfg.tie_weights:
            self.head.weight = self.tgt_embedding.weight

    def _embed(self, table, ids, start: int = 0):
        end = start + ids.size(1)
        if end > self.pe.size(0):
            raise ValueError(f"{end} positions exceed max_src_len/max_tgt_len + 1 = {self.pe.size(0)}")
        # sqrt(d): the embeddings, initialised small, would otherwise drown under the positions.
        return self.drop(table(ids) * math.sqrt(self.config.n_embd) + self.pe[start:end])

    def encode(self, src) -> dict:
        pad = src == PAD_ID
        x = self._embed(self.src_embedding, src)
        for layer in self.encoder:
            x = layer(x, pad)
        return {"outputs": self.enc_norm(x), "pad": pad}

    def decode(self, memory: dict, tgt_in):
        """Logits [B, T, V] for every prefix of tgt_in [B, T]; weights of the last cross-attention."""
        T = tgt_in.size(1)
        x = self._embed(self.tgt_embedding, tgt_in)
        mask, tgt_pad = causal_mask(T, tgt_in.device), tgt_in == PAD_ID
        for layer in self.decoder:
            x = layer(x, memory["outputs"], mask, tgt_pad, memory["pad"])
        return self.head(self.dec_norm(x)), self.decoder[-1].cross_weights

    def start(self, memory: dict):
        """A key/value cache per decoder layer: each step then costs one position, not the prefix."""
        return {"t": 0, "layers": [{"self": {}, "cross": {}} for _ in self.decoder]}

    def step(self, memory: dict, state, token):
        """One target token [B] in -> (logits [B, V], new state, attention [B, S], heads averaged).

        No causal mask: the one new position may see every cached one. Rows that finished early
        feed <pad>; what they compute is never read.
        """
        x = self._embed(self.tgt_embedding, token[:, None], state["t"])
        for layer, cache in zip(self.decoder, state["layers"]):
            x = layer(x, memory["outputs"], None, None, memory["pad"], cache)
        logits = self.head(self.dec_norm(x))[:, 0]
        state["t"] += 1
        return logits, state, self.decoder[-1].cross_weights[:, :, 0].mean(dim=1)

    @staticmethod
    def reorder(state, index):
        layers = [
            {part: {name: t[index] for name, t in kv.items()} for part, kv in layer.items()}
            for layer in state["layers"]
        ]
        return {"t": state["t"], "layers": layers}

    def forward(self, src, tgt_in, tgt_out=None):
        logits, _ = self.decode(self.encode(src), tgt_in)
        return logits, _loss(logits, tgt_out), None

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
