"""A GPT decoding on a CPU with bf16 weights laid out once for oneDNN: what `generate` runs when
`sample.dtype` resolves to bf16."""

from __future__ import annotations

import copy
import functools
import time
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm.lm.gpt import GPT, KVCache
from mllm.runtime import speed


def available() -> bool:
    """Whether oneDNN's packed bf16 linear runs here (`unavailable` says why not)."""
    return unavailable() is None


@functools.cache
def unavailable() -> str | None:
    """Why bf16 weights cannot decode on this CPU, or None. Every x86 CPU build of torch has
    oneDNN's packed linear, but its bf16 path needs AVX512 (BW, VL and DQ) or AVX-NE-CONVERT: on
    a CPU with AVX2 alone it raises. Tried once, on an 8x8 layer."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN"
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError:
        return "oneDNN's bf16 linear does not run on this CPU (it needs AVX512 or AVX-NE-CONVERT)"
    return None


class PackedLinear(nn.Module):
    """nn.Linear with its weight in bf16, packed for oneDNN once; float32 (or bf16) in.

    gelu: the MLP's GELU (exact, erf) applied inside the same oneDNN call, output left in bf16 for
    the next layer; otherwise the output is float32.
    """

    def __init__(self, linear: nn.Linear, gelu: bool = False):
        super().__init__()
        self.out_features, self.gelu = linear.out_features, gelu
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(torch.bfloat16), 1)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x):
        y = self.flat(x.reshape(-1, x.size(-1)))
        return y.view(*x.shape[:-1], self.out_features)

    def flat(self, x):
        """x [N, in] -> [N, out]."""
        if self.gelu:
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias, "gelu", [], "none")
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias, "none", [], "")
        return y.float()


class Bf16Decoder:
    """A GPT's copy with PackedLinear weights, called as the GPT is (idx, state=...)."""

    def __init__(self, model: GPT):
        with torch.no_grad():
            self.model = copy.deepcopy(model).eval()
            for block in self.model.transformer.h:
                block.mlp.c_fc = PackedLinear(block.mlp.c_fc, gelu=True)
                block.mlp.gelu = nn.Identity()
            for module in list(self.model.modules()):
                for name, child in list(module.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(module, name, PackedLinear(child))
        self.config = model.config
        self.new_state = self.model.new_state
        # The flat step covers SDPA attention; explicit attention (kept for its pictures) takes
        # the module path token by token.
        self.flat = model.config.attention != "explicit"

    def __call__(self, idx, targets=None, state: KVCache | None = None):
        if self.flat and state is not None and idx.size(1) == 1:
            return self.step(idx, state), None, state
        return self.model(idx, state=state)

    def step(self, idx, state: KVCache):
        """One new token's logits [1, 1, V]: GPT.forward for T = 1 with a cache, written flat."""
        m, c = self.model, self.config
        B, C, nh = idx.size(0), c.n_embd, c.n_head
        past = state.length
        if past + 1 > c.block_size:
            raise ValueError(f"{past + 1} positions exceed block_size {c.block_size}: crop the context")
        x = m.transformer.wte(idx[:, 0])
        if c.positions == "sinusoidal":
            x = x * C**0.5
        x = x + m.transformer.wpe(torch.tensor(past))
        for layer, block in enumerate(m.transformer.h):
            h = F.layer_norm(x, (C,), block.ln_1.weight, block.ln_1.bias)
            q, k, v = block.attn.c_attn.flat(h).view(B, 3, nh, 1, C // nh).unbind(1)
            k, v = state.append(layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v)  # one query sees every cached key
            x = x + block.attn.c_proj.flat(y.view(B, C))
            h = F.layer_norm(x, (C,), block.ln_2.weight, block.ln_2.bias)
            x = x + block.mlp.c_proj.flat(block.mlp.c_fc.flat(h))
        x = F.layer_norm(x, (C,), m.transformer.ln_f.weight, m.transformer.ln_f.bias)
        return m.lm_head.flat(x)[:, None]


# model -> (its weights' versions, its decoder): built once for the many prompts and methods a
# run samples, and again if the model trained in between.
_DECODERS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def bf16_decoder(model: GPT) -> Bf16Decoder:
    versions = tuple((p.data_ptr(), p._version) for p in model.parameters())
    hit = _DECODERS.get(model)
    if hit and hit[0] == versions:
        return hit[1]
    decoder = Bf16Decoder(model)
    _DECODERS[model] = (versions, decoder)
    return decoder


def decode_precision(model: nn.Module, dtype: str = "auto", device=None) -> speed.Precision:
    """The precision `generate` decodes `model` in with its KV cache, for sample.dtype = dtype."""
    device = device or next(model.parameters()).device
    if not isinstance(model, GPT) or device.type != "cpu":
        return speed.Precision("float32", "bf16 weights decode a GPT on a CPU only")
    if why := unavailable():
        return speed.Precision("float32", why)
    return speed.choose_decode_precision(dtype, device, model, lambda: _probe(model))


@torch.inference_mode()
def _probe(model: GPT, steps: int = 6) -> dict[str, float]:
    """Milliseconds of the fastest cached decoding step in each precision at half the block's
    context, on the threads the caller decodes with. The two alternate, so that a burst of load
    on a shared machine slows both rather than deciding; the first step of each is a warm-up."""
    was_training = model.training
    model.eval()
    contenders = {"float32": model, "bfloat16": bf16_decoder(model)}
    n = max(1, model.config.block_size // 2)
    context, token = torch.zeros(1, n, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    states = {name: m(context, state=m.new_state(1))[2] for name, m in contenders.items()}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(steps):
        for name, m in contenders.items():
            states[name].length = n  # each step decodes position n again: the same work each time
            start = time.perf_counter()
            m(token, state=states[name])
            times[name].append(time.perf_counter() - start)
    model.train(was_training)
    return {name: round(1000 * min(ts[1:]), 3) for name, ts in times.items()}
