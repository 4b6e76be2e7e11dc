"""One entry point from a ModelConfig to a model: every model shares the same forward contract.

forward(idx [B, T], targets [B, T] | None, state) -> (logits [B, T, V], loss | None, state), where
state is a recurrent model's hidden state or a GPT's KV cache (None: zeros / no cache).
"""

from __future__ import annotations

import torch.nn as nn

from mllm import UserError
from mllm.config import ModelConfig
from mllm.gpt import GPT
from mllm.rnn import RecurrentLM


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.vocab_size <= 0:
        raise UserError("model.vocab_size is 0: set it to the vocabulary's size before building the model")
    return GPT(cfg) if cfg.arch == "gpt" else RecurrentLM(cfg)
