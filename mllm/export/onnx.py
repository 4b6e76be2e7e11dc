"""Every family as ONNX through torch's exporter, for onnxruntime: small modules over the trained
layers, written with tensors only so that one graph serves every length."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm.lm.gpt_pieces import softcap

OPSET = 17


def _rms(x, weight=None, eps: float = 1e-5):
    # torch.rms_norm written out: the TorchScript exporter has no aten::rms_norm below opset 23.
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _norm(module: nn.Module, x):
    return _rms(x, module.weight, module.eps) if isinstance(module, nn.RMSNorm) else module(x)


class GPTStep(nn.Module):
    """(input_ids [B, T], past_keys, past_values [L, B, H, P, D]) -> (logits [B, T, V], the keys
    and values of all P + T positions). P = 0 is a whole prompt."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt, self.c = gpt, gpt.config

    def _attend(self, block, x, layer: int, pos, pk, pv, ve):
        attn, (B, T, C), H = block.attn, x.shape, self.c.n_head
        qkv = attn.c_attn(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if attn.qk_norm:
            q, k = _rms(q), _rms(k)
        if attn.rotary is not None:
            cos, sin, h = attn.rotary.cos[pos], attn.rotary.sin[pos], attn.rotary.half
            q, k = (
                torch.cat(
                    [
                        t[..., :h] * cos - t[..., h : 2 * h] * sin,
                        t[..., h : 2 * h] * cos + t[..., :h] * sin,
                        t[..., 2 * h :],
                    ],
                    dim=-1,
                )
                for t in (q, k)
            )
        if ve is not None:
            v = attn.ve_lambdas[0] * v + attn.ve_lambdas[1] * ve.view(B, T, H, C // H).transpose(1, 2)
        k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        # Query i (position P + i) sees keys 0 .. P + i.
        keys = torch.arange(k.size(2), device=x.device)
        mask = torch.zeros(T, k.size(2)).masked_fill(keys[None, :] > pos[:, None], float("-inf"))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H) + mask
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        return attn.c_proj(y), k, v

    def forward(self, input_ids, past_keys, past_values):
        g, c = self.gpt, self.c
        P, T = past_keys.size(3), input_ids.size(1)
        pos = torch.arange(T, device=input_ids.device) + P
        x = g.transformer.wte(input_ids)
        if c.positions == "sinusoidal":
            x = x * math.sqrt(c.n_embd)
        if c.positions != "rotary":
            x = x + g.transformer.wpe(pos)
        x0, keys, values = x, [], []
        for layer, block in enumerate(g.transformer.h):
            if c.residual_scalars:
                x = g.resid_lambdas[layer] * x + g.x0_lambdas[layer] * x0
            ves = g.value_embeds
            ve = ves[str(layer)](input_ids) if ves is not None and str(layer) in ves else None
            y, k, v = self._attend(block, _norm(block.ln_1, x), layer, pos, past_keys[layer], past_values[layer], ve)
            x = x + y
            x = x + block.mlp(_norm(block.ln_2, x))
            keys.append(k)
            values.append(v)
        logits = g.lm_head(_norm(g.transformer.ln_f, x))
        if c.logit_softcap is not None:
            logits = softcap(logits, c.logit_softcap)
        return logits, torch.stack(keys), torch.stack(values)


def _fused(rnn: nn.Module) -> nn.Module:
    """mllm.lm.rnn's written-out LSTM/RNN as torch's fused module (the same equations and
    parameter names), which the exporter writes as one ONNX LSTM/RNN op for any length."""
    if isinstance(rnn, (nn.LSTM, nn.GRU, nn.RNN)):
        return rnn
    kind = nn.LSTM if type(rnn).__name__ == "LSTM" else nn.RNN
    fused = kind(rnn.input_size, rnn.hidden_size, rnn.num_layers, bias=rnn.bias, batch_first=True)
    fused.load_state_dict(rnn.state_dict())
    return fused


class RecurrentStep(nn.Module):
    """(input_ids [B, T], h [, c] [L, B, H]) -> (logits [B, T, V], h [, c]): a recurrent language
    model or a sequence model (one-hot inputs), its state carried in and out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.rnn = model, _fused(model.rnn)
        self.lstm = isinstance(self.rnn, nn.LSTM)

    def forward(self, input_ids, h, c=None):
        m = self.model
        if hasattr(m, "embedding"):
            x = m.embedding(input_ids)
        else:  # SequenceRNN reads each number one-hot
            x = F.one_hot(input_ids, m.config.vocab_size).float()
        y, state = self.rnn(x, (h, c) if self.lstm else h)
        logits = m.head(y)
        return (logits, *state) if self.lstm else (logits, state)


class CbowEmbed(nn.Module):
    """(context [B, N], mask [B, N]) -> (mean context vector [B, D], scores of every word [B, V]),
    with the input embeddings as a lookup returns them (rows scaled back to max_norm)."""

    def __init__(self, cbow: nn.Module):
        super().__init__()
        self.register_buffer("vectors", cbow.context_vectors())
        self.head = cbow.head

    def forward(self, context, mask):
        m = mask.float()
        weights = m / m.sum(1, keepdim=True).clamp_min(1.0)
        h = (self.vectors[context] * weights[..., None]).sum(1)
        return h, self.head(h)


def export_module(
    module: nn.Module, args: tuple, path: str, inputs: list[str], outputs: list[str], dynamic: dict[str, dict[int, str]]
) -> None:
    """One graph through torch's TorchScript-based exporter (no onnxscript needed), float32."""
    module = module.float().eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's tracer warnings name our own shape arithmetic
        torch.onnx.export(
            module,
            args,
            path,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )


def export_gpt(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    c = loaded.model.config
    L, H, D = c.n_layer, c.n_head, c.n_embd // c.n_head
    ids = torch.zeros(1, 3, dtype=torch.long)
    past = torch.zeros(L, 1, H, 2, D)
    cache = {0: "layer", 1: "batch", 3: "past"}
    export_module(
        GPTStep(loaded.model),
        (ids, past, past),
        os.path.join(out, "model.onnx"),
        ["input_ids", "past_keys", "past_values"],
        ["logits", "keys", "values"],
        {
            "input_ids": {0: "batch", 1: "tokens"},
            "past_keys": cache,
            "past_values": cache,
            "logits": {0: "batch", 1: "tokens"},
            "keys": {1: "batch", 3: "length"},
            "values": {1: "batch", 3: "length"},
        },
    )
    return ["model.onnx"]


def export_recurrent(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    step = RecurrentStep(loaded.model)
    c = loaded.model.config
    h = torch.zeros(c.n_layer, 1, c.hidden_size)
    names = ["h", "c"] if step.lstm else ["h"]
    state = {n: {1: "batch"} for n in names}
    export_module(
        step,
        (torch.zeros(1, 3, dtype=torch.long), *(h for _ in names)),
        os.path.join(out, "model.onnx"),
        ["input_ids", *names],
        ["logits", *(f"{n}_out" for n in names)],
        {
            "input_ids": {0: "batch", 1: "tokens"},
            "logits": {0: "batch", 1: "tokens"},
            **state,
            **{f"{n}_out": {1: "batch"} for n in names},
        },
    )
    return ["model.onnx"]


def export_cbow(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    ctx = torch.zeros(1, 4, dtype=torch.long)
    export_module(
        CbowEmbed(loaded.model),
        (ctx, torch.ones(1, 4, dtype=torch.bool)),
        os.path.join(out, "model.onnx"),
        ["context", "mask"],
        ["vector", "scores"],
        {
            "context": {0: "batch", 1: "words"},
            "mask": {0: "batch", 1: "words"},
            "vector": {0: "batch"},
            "scores": {0: "batch"},
        },
    )
    return ["model.onnx"]
