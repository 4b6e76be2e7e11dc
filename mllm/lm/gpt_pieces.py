"""The GPT's optional modern pieces (rotary positions, RMSNorm, QK-norm, ReLU^2, a logit softcap),
after modded-nanogpt and nanochat, each off by default."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotary_tables(length: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of [length, head_dim // 2]: position p turns pair i by p * base^(-2i / head_dim)."""
    freq = base ** (-torch.arange(0, head_dim // 2, dtype=torch.float32) * 2 / head_dim)
    angle = torch.arange(length, dtype=torch.float32)[:, None] * freq
    return angle.cos(), angle.sin()


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021) of q and k ([B, h, T, head_dim]).

    Pair i is the coordinates (i, i + head_dim/2) (GPT-NeoX's layout, one slice instead of an
    interleave), turned by its angle at the token's position. The tables are non-persistent
    buffers, as the sinusoidal ones: nothing to learn, nothing in a checkpoint. An odd head_dim
    leaves its last coordinate as it is.
    """

    def __init__(self, length: int, head_dim: int):
        super().__init__()
        cos, sin = rotary_tables(length, head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.half = head_dim // 2

    def forward(self, x: torch.Tensor, past: int = 0) -> torch.Tensor:
        T, h = x.size(-2), self.half
        cos, sin = self.cos[past : past + T].to(x.dtype), self.sin[past : past + T].to(x.dtype)
        x1, x2, rest = x[..., :h], x[..., h : 2 * h], x[..., 2 * h :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def norm(kind: str, n: int, bias: bool) -> nn.Module:
    """layernorm (nanoGPT's, with or without its bias) or rmsnorm (x / rms(x) * gain, no bias)."""
    return nn.LayerNorm(n, bias=bias) if kind == "layernorm" else nn.RMSNorm(n, eps=1e-5)


def qk_norm(x: torch.Tensor) -> torch.Tensor:
    """RMS-normalise each head's query or key, without a gain (modded-nanogpt's QK-norm)."""
    return F.rms_norm(x, (x.size(-1),), eps=1e-5)


class ReLU2(nn.Module):
    """relu(x)^2 (So et al. 2021, Primer): the MLP's activation in modded-nanogpt and nanochat."""

    def forward(self, x):
        return F.relu(x).square()


def value_layers(n_layer: int) -> list[int]:
    """The layers that mix in a value embedding (`model.value_embeds`): every other one, counted
    back from the last, which always does (nanochat's choice)."""
    return [i for i in range(n_layer) if i % 2 == (n_layer - 1) % 2]


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): the logits stay in (-cap, cap), near-identity well inside."""
    return cap * torch.tanh(logits / cap)
