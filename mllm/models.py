"""One entry point from a model config to a model: every model shares the same forward contract.

forward(*batch) -> (output, loss | None, state), the batch's last tensor being the target. The
language models take (idx [B, T], targets [B, T] | None, state) and return logits [B, T, V] and
state, a recurrent model's hidden state or a GPT's KV cache (None: zeros / no cache); CBOW takes
(context, mask, negatives, centre) and returns no state; an encoder-decoder (mllm.seq2seq) takes
(src, tgt_in, tgt_out) and returns no state.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mllm import UserError
from mllm.cbow import CBOW
from mllm.config import ModelConfig, Seq2SeqConfig
from mllm.gpt import GPT
from mllm.rnn import RecurrentLM
from mllm.seq2seq import build_seq2seq


def build_model(cfg: ModelConfig) -> nn.Module:
    if isinstance(cfg, Seq2SeqConfig):
        return build_seq2seq(cfg)
    if cfg.vocab_size <= 0:
        raise UserError("model.vocab_size is 0: set it to the vocabulary's size before building the model")
    if cfg.arch == "cbow":
        return CBOW(cfg)
    return GPT(cfg) if cfg.arch == "gpt" else RecurrentLM(cfg)


def resolve_device(name: str) -> torch.device:
    """A device name (train.device, --device) as a torch.device: auto picks CUDA, then MPS, then
    the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device {name!r} is not a device: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name} asked for, but no CUDA GPU is visible here: use cpu, or auto "
                        "(which takes a GPU when there is one)")
    return device
