"""What the two transformers share, one copy each: sinusoidal positions and attention written out in
tensor code, with its masks."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def sinusoidal_positions(length: int, d: int) -> torch.Tensor:
    """[length, d]: PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same angle)."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.pow(10000.0, -torch.arange(0, d, 2, dtype=torch.float32) / d)
    pe = torch.zeros(length, d)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: d // 2])  # an odd d ends on a sine
    return pe


class SinusoidalPositions(nn.Module):
    """Called like nn.Embedding(length, d) on position ids, but a fixed table: nothing to learn.

    The table is a non-persistent buffer: it follows the model's device and is rebuilt from the
    formula rather than stored, so a checkpoint holds no position weights at all.
    """

    def __init__(self, length: int, d: int):
        super().__init__()
        self.register_buffer("pe", sinusoidal_positions(length, d), persistent=False)

    def forward(self, pos):
        return self.pe[pos]


def causal_mask(T: int, device=None, past: int = 0) -> torch.Tensor:
    """[T, past + T] of 0 where a key may be seen and -inf where it may not.

    Query i is position past + i (the first `past` keys come from a cache): it sees every key up
    to its own position, never a later one. past = 0 is the square mask of a whole sequence.
    """
    return torch.full((T, past + T), float("-inf"), device=device).triu(diagonal=past + 1)


def explicit_attention(q, k, v, mask=None, key_pad=None, dropout_p: float = 0.0):
    """softmax(q k^T / sqrt(d_head) + mask) v over [B, h, T, d_head] heads; returns (y, weights).

    mask: additive [Tq, Tk] (causal_mask); key_pad: [B, Tk], True at padding. What
    F.scaled_dot_product_attention computes, written out so the weights can be read (the
    attention pictures) and every step is plain tensor code.

    The scores come from one batched multiply that adds the mask as it goes (baddbmm), with the
    scale applied to q (T x d_head numbers) rather than to the scores (T x T), and the mask in the
    scores' own dtype: a float32 mask added to bf16 scores would promote the whole T x T softmax
    to float32. On the project's AMD CPUs this is 1.5-4x faster than torch's CPU flash attention
    for a training step's forward and backward (mllm.runtime.speed.choose_attention measures it per machine;
    causal_attention is the GPT's own, for a whole sequence).
    """
    B, h, Tq, d = q.shape
    Tk = k.size(2)
    q3 = (q * (1.0 / math.sqrt(d))).reshape(B * h, Tq, d)
    kt = k.reshape(B * h, Tk, d).transpose(1, 2)
    if mask is None:
        scores = torch.bmm(q3, kt)
    else:
        scores = torch.baddbmm(mask.to(q3.dtype).expand(B * h, Tq, Tk), q3, kt)
    scores = scores.view(B, h, Tq, Tk)
    if key_pad is not None:
        scores = scores.masked_fill(key_pad[:, None, None, :], float("-inf"))
    weights = scores.softmax(dim=-1)
    # Dropout on the weights, as SDPA's dropout_p: a query randomly ignores some keys in training.
    y = F.dropout(weights, dropout_p) @ v if dropout_p > 0 else weights @ v
    return y, weights


def causal_attention(q, k, v, dropout_p: float = 0.0):
    """Causal self-attention over whole sequences ([B, h, T, d_head], no cache) as batched matrix
    multiplies: explicit_attention(q, k, v, causal_mask(T)) without the weights, and from 128
    positions on in two halves of the queries, the first half scoring only the keys it may see,
    which leaves out a quarter of the score matrix (all of it masked). At the shakespeare-gpt shape
    (6 heads of 64, T 256, batch 16, bf16, an AMD EPYC with 2 threads) a forward and backward
    pass took 24 ms against 35 ms in one piece, and 47 ms in torch's CPU flash attention.
    """
    T = q.size(2)
    mask = causal_mask(T, q.device)
    cuts = [0, T // 2, T] if T >= 128 else [0, T]
    parts = [
        explicit_attention(
            q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask[start:end, :end], dropout_p=dropout_p
        )[0]
        for start, end in zip(cuts, cuts[1:])
    ]
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
