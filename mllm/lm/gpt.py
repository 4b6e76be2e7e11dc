"""A decoder-only transformer after nanoGPT's model.py, with a KV cache for generation and the modern
small-GPT pieces as options, off by default."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm.config import ModelConfig
from mllm.lm.gpt_pieces import ReLU2, Rotary, norm, qk_norm, softcap, value_layers
from mllm.runtime.optim import optim_groups
from mllm.transformer import SinusoidalPositions, causal_attention, causal_mask, explicit_attention


class KVCache:
    """Keys and values of every layer for the tokens seen so far, up to `capacity` (block_size).

    Preallocated so a generation step writes in place instead of concatenating; allocated on first
    use so it takes the dtype the model computes in (bfloat16 under autocast). One tensor per
    layer rather than one for all: a decoding step is a few hundred tiny ops, and indexing a
    layer out of a stacked tensor would add two more per layer.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, capacity: int):
        self.n_layer, self.shape = n_layer, (batch_size, n_head, capacity, head_dim)
        self.k: list[torch.Tensor] | None = None
        self.v: list[torch.Tensor] | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def append(self, layer: int, k, v):
        """Store the new tokens' k, v ([B, nh, T, hs]) for `layer`; return the layer's keys and values so far."""
        if self.k is None:
            self.k = [k.new_zeros(self.shape) for _ in range(self.n_layer)]
            self.v = [v.new_zeros(self.shape) for _ in range(self.n_layer)]
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} asked for (crop or reset it)")
        keys, values = self.k[layer], self.v[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        if layer == self.n_layer - 1:
            self.length = end  # every layer has now seen the new tokens
        return keys[:, :, :end], values[:, :, :end]

    def reorder(self, index):
        """Keep batch rows `index` (beam search: each surviving beam takes its parent's cache)."""
        if self.k is not None:
            self.k = [t[index] for t in self.k]
            self.v = [t[index] for t in self.v]
        self.shape = (len(index), *self.shape[1:])


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: dict[torch.dtype, str] | None = None, value_embed: bool = False):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.explicit = config.attention == "explicit"
        # The GPT's own table, shared by its layers: under `attention: sdpa`, the dtypes in which
        # a whole sequence's attention runs as written-out matrix multiplies instead of torch's
        # SDPA kernel, because this machine measured them faster (mllm.runtime.speed.choose_attention).
        # Not a setting: the same attention either way, and nothing of it in a checkpoint.
        self.kernels = {} if kernels is None else kernels
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.qk_norm = config.qk_norm
        self.rotary: Rotary | None = None  # the GPT's one table, set by the GPT (positions: rotary)
        # model.value_embeds: v -> a * v + b * ve; modded-nanogpt starts both at one half.
        self.ve_lambdas = nn.Parameter(torch.tensor([0.5, 0.5])) if value_embed else None

    def forward(self, x, cache: KVCache | None = None, layer: int = 0, ve: torch.Tensor | None = None):
        B, T, C = x.shape
        # One view and one permute for q, k and v together (the same strides as split + 3 views
        # + 3 transposes): fewer ops matter when generating, where each one touches a single token.
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        past = cache.length if cache is not None else 0
        if self.qk_norm or self.rotary is not None:
            # q and k together, one call each instead of two: a step of this small model is
            # counted in ops. Before the cache: cached keys are stored turned by their positions.
            qk = qk_norm(qkv[:2]) if self.qk_norm else qkv[:2]
            qk = self.rotary(qk, past) if self.rotary is not None else qk
            (q, k), v = qk.unbind(0), qkv[2]
        else:
            q, k, v = qkv.unbind(0)
        if ve is not None:  # [B, T, C], the token's value embedding; cached keys hold it already
            ve = ve.to(v.dtype).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = self.ve_lambdas[0] * v + self.ve_lambdas[1] * ve
        if cache is not None:
            k, v = cache.append(layer, k, v)
        dropout_p = self.dropout if self.training else 0.0
        if not self.explicit and not past and T > 1 and self.kernels.get(q.dtype) == "matmul":
            y = causal_attention(q, k, v, dropout_p)
        elif self.explicit:
            # One new token may look at every cached one: no mask to add.
            mask = causal_mask(T, x.device, past) if T > 1 else None
            y, _ = explicit_attention(q, k, v, mask, dropout_p=dropout_p)
        else:
            mask, causal = None, True
            if past and T == 1:
                causal = False  # one new token may look at every cached one
            elif past:
                # SDPA's is_causal aligns the triangle top-left; new token i sits at position past + i.
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
                causal = False
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return self.resid_dropout(y) if self.training else y


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU() if config.mlp == "gelu" else ReLU2()  # the name kept: state_dicts hold none
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        y = self.c_proj(self.gelu(self.c_fc(x)))
        return self.dropout(y) if self.training else y


class Block(nn.Module):
    def __init__(self, config: ModelConfig, kernels: dict[torch.dtype, str] | None = None, value_embed: bool = False):
        super().__init__()
        self.ln_1 = norm(config.norm, config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, kernels, value_embed)
        self.ln_2 = norm(config.norm, config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0, ve=None):
        x = x + self.attn(self.ln_1(x), cache, layer, ve)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.arch == "gpt" and config.vocab_size > 0
        self.config = config
        self.attention_kernels: dict[torch.dtype, str] = {}  # see CausalSelfAttention.kernels
        ve_layers = value_layers(config.n_layer) if config.value_embeds else []
        # A formula could go on past block_size; the tables stop there all the same, because
        # block_size is also the size of the KV cache and of the context sampling keeps.
        wpe = {
            "learned": lambda: nn.Embedding(config.block_size, config.n_embd),
            "sinusoidal": lambda: SinusoidalPositions(config.block_size, config.n_embd),
            "rotary": lambda: None,
        }[config.positions]()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                **({"wpe": wpe} if wpe is not None else {}),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, self.attention_kernels, i in ve_layers) for i in range(config.n_layer)]),
                ln_f=norm(config.norm, config.n_embd, config.bias),
            )
        )
        # One table for every layer (non-persistent buffers: no weights, nothing in a checkpoint).
        rotary = config.positions == "rotary"
        self.rotary = Rotary(config.block_size, config.n_embd // config.n_head) if rotary else None
        for block in self.transformer.h:
            block.attn.rotary = self.rotary
        # model.value_embeds: one table per layer that mixes one in; outside the blocks, so AdamW's
        # (an embedding), not Muon's. model.residual_scalars: r_i and s_i of each layer.
        self.value_embeds = (
            nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, config.n_embd) for i in ve_layers})
            if ve_layers
            else None
        )
        if config.residual_scalars:
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                # GPT-2: each block adds two residual branches; scale them so the stream's variance
                # holds. Zero (modded-nanogpt): each block starts as the identity.
                if config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, state: KVCache | None = None):
        B, T = idx.shape
        past = state.length if state is not None else 0
        if past + T > self.config.block_size:
            raise ValueError(f"{past + T} positions exceed block_size {self.config.block_size}: crop the context")
        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx)
        if self.config.positions == "sinusoidal":
            # sqrt(n_embd), as the seq2seq transformer (and Vaswani et al.): embeddings initialised
            # at std 0.02 would otherwise drown under the table's unit sines, and learn slowly.
            x = x * math.sqrt(self.config.n_embd)
        if self.config.positions != "rotary":
            x = x + self.transformer.wpe(pos)
        if self.training:
            x = self.transformer.drop(x)
        x0, ves = x, self.value_embeds
        for layer, block in enumerate(self.transformer.h):
            if self.config.residual_scalars:
                x = self.resid_lambdas[layer] * x + self.x0_lambdas[layer] * x0
            ve = ves[str(layer)](idx) if ves is not None and str(layer) in ves else None
            x = block(x, state, layer, ve)
        logits = self.lm_head(self.transformer.ln_f(x))
        if self.config.logit_softcap is not None:
            logits = softcap(logits, self.config.logit_softcap)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss, state

    def new_state(self, batch_size: int, device=None) -> KVCache:
        # The cache allocates on the device (and in the dtype) of the first keys written to it.
        c = self.config
        return KVCache(c.n_layer, batch_size, c.n_head, c.n_embd // c.n_head, c.block_size)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, tied ones once; non_embedding leaves out the position table (nanoGPT's count for FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        # A sinusoidal table is a buffer and rotary has none, so this takes nothing off for them.
        wpe = self.transformer["wpe"] if "wpe" in self.transformer else None
        return n - sum(p.numel() for p in wpe.parameters()) if non_embedding and wpe is not None else n

    def flops_per_token(self, T: int) -> int:
        """Training FLOPs per token at context T, as nanoGPT's estimate_mfu (PaLM appendix B)."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * T

    @property
    def speed_variant(self) -> dict:
        """The options away from their defaults that change a step's work but no parameter's
        shape: part of mllm.runtime.speed's probe keys, so a probe of one variant is not reused for another."""
        c, fields = self.config, ("norm", "qk_norm", "mlp", "logit_softcap")
        defaults = type(c).model_fields
        # Sinusoidal positions predate this key (its missing wpe tells it apart); rotary's does not.
        return {f: getattr(c, f) for f in fields if getattr(c, f) != defaults[f].default} | (
            {"positions": "rotary"} if c.positions == "rotary" else {}
        )

    def optim_groups(self, weight_decay: float) -> list[dict]:
        return optim_groups(self, weight_decay)
