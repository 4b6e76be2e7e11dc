"""A sequence-to-sequence model as two ONNX graphs, as mllm.seq2seq.translate runs it: the encoder
(once per source) and the decoder step (once per target token), the step's state carried by the
caller: the RNN's hidden state, or the transformer's self-attention keys and values."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn as nn

from mllm.export.onnx import export_module

ENCODER, DECODER = "encoder.onnx", "decoder_step.onnx"


class RnnEncoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, src):
        m = self.model.encode(src)
        return m["outputs"], m["keys"], m["pad"], m["init"]


class RnnStep(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, token, state, outputs, keys, pad):
        logits, state, _ = self.model.step({"outputs": outputs, "keys": keys, "pad": pad}, state, token)
        return logits, state


class TransformerEncoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, src):
        m = self.model.encode(src)
        return m["outputs"], m["pad"]


class TransformerStep(nn.Module):
    """(token [B], memory [B, S, d], pad [B, S], past_keys/values [L, B, h, P, d_head]) -> (logits
    [B, V], keys and values of P + 1 positions): the model's own decoder layers, fed its cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, token, memory, pad, past_keys, past_values):
        m = self.model
        pos = torch.arange(1, device=token.device) + past_keys.size(3)
        x = m.tgt_embedding(token[:, None]) * math.sqrt(m.config.n_embd) + m.pe[pos]
        keys, values = [], []
        for i, layer in enumerate(m.decoder):
            cache = {"self": {"k": past_keys[i], "v": past_values[i]}, "cross": {}}
            x = layer(x, memory, None, None, pad, cache)
            keys.append(cache["self"]["k"])
            values.append(cache["self"]["v"])
        return m.head(m.dec_norm(x))[:, 0], torch.stack(keys), torch.stack(values)


BATCH, SEQ = {0: "batch"}, {0: "batch", 1: "source"}


def _example(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A source, a first target token (<bos>) and the source's memory, to trace with."""
    src = torch.tensor([[4, 5, 6]], dtype=torch.long)
    with torch.no_grad():
        return src, torch.tensor([2], dtype=torch.long), model.encode(src)


def export_rnn(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    m = loaded.model
    src, token, memory = _example(m)
    batch, seq = BATCH, SEQ
    export_module(
        RnnEncoder(m),
        (src,),
        os.path.join(out, ENCODER),
        ["src"],
        ["outputs", "keys", "pad", "init"],
        {"src": seq, "outputs": seq, "keys": seq, "pad": seq, "init": batch},
    )
    args = (token, memory["init"], memory["outputs"], memory["keys"], memory["pad"])
    export_module(
        RnnStep(m),
        args,
        os.path.join(out, DECODER),
        ["token", "state", "outputs", "keys", "pad"],
        ["logits", "state_out"],
        {"token": batch, "state": batch, "outputs": seq, "keys": seq, "pad": seq, "logits": batch, "state_out": batch},
    )
    return [ENCODER, DECODER]


def export_transformer(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    m, c = loaded.model, loaded.model.config
    src, token, memory = _example(m)
    batch, seq = BATCH, SEQ
    export_module(
        TransformerEncoder(m),
        (src,),
        os.path.join(out, ENCODER),
        ["src"],
        ["memory", "pad"],
        {"src": seq, "memory": seq, "pad": seq},
    )
    past = torch.zeros(c.n_layer, 1, c.n_head, 0, c.n_embd // c.n_head)
    cache = {1: "batch", 3: "past"}
    export_module(
        TransformerStep(m),
        (token, memory["outputs"], memory["pad"], past, past),
        os.path.join(out, DECODER),
        ["token", "memory", "pad", "past_keys", "past_values"],
        ["logits", "keys", "values"],
        {
            "token": batch,
            "memory": seq,
            "pad": seq,
            "past_keys": cache,
            "past_values": cache,
            "logits": batch,
            "keys": {1: "batch", 3: "length"},
            "values": {1: "batch", 3: "length"},
        },
    )
    return [ENCODER, DECODER]
