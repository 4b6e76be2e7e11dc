"""A GPT as a GGUF file for llama.cpp's CPU runtime, written with the `gguf` package in float32:
nanoGPT's pieces as llama.cpp's `gpt2`, rotary ones as `gptneox` (GELU) or `nemotron` (ReLU²);
both rotate halves of each head (rope type NEOX), as mllm does, so no weight is permuted."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from mllm.export.pieces import check_gpt

FILE = "model.gguf"


def runtime_arch(c: Any) -> str:
    """llama.cpp's architecture for the GPT config `c`."""
    if c.positions == "learned":
        return "gpt2"
    return "nemotron" if c.mlp == "relu2" else "gptneox"


def _byte_level(token: str) -> str:
    """A token in GPT-2's byte-to-unicode alphabet, which llama.cpp's BPE vocabulary is written in."""
    return "".join(_BYTES[b] for b in token.encode("utf-8"))


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's table (encoder.py): printable bytes stand for themselves, the rest map from U+0100 on.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTES = _bytes_to_unicode()


def tensors(model: Any) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> the checkpoint's tensor (zeros where mllm's layer has no bias)."""
    c, sd = model.config, model.state_dict()
    E, kind = c.n_embd, runtime_arch(c)
    zeros = lambda n: torch.zeros(n)  # noqa: E731 (a one-line helper, named where it is used)
    out = {
        "token_embd.weight": sd["transformer.wte.weight"],
        "output.weight": sd["lm_head.weight"],
        "output_norm.weight": sd["transformer.ln_f.weight"],
        "output_norm.bias": sd.get("transformer.ln_f.bias", zeros(E)),
    }
    if kind == "gpt2":
        out["position_embd.weight"] = sd["transformer.wpe.weight"]
    for i in range(c.n_layer):
        src, dst = f"transformer.h.{i}.", f"blk.{i}."
        pairs = [
            ("ln_1", "attn_norm", E),
            ("attn.c_proj", "attn_output", E),
            ("ln_2", "ffn_norm", E),
            ("mlp.c_fc", "ffn_up", 4 * E),
            ("mlp.c_proj", "ffn_down", E),
        ]
        if kind == "nemotron":
            w, b = sd[src + "attn.c_attn.weight"], sd.get(src + "attn.c_attn.bias", zeros(3 * E))
            for j, name in enumerate(("attn_q", "attn_k", "attn_v")):
                out[dst + name + ".weight"], out[dst + name + ".bias"] = w[j * E : (j + 1) * E], b[j * E : (j + 1) * E]
        else:
            pairs.append(("attn.c_attn", "attn_qkv", 3 * E))
        for a, name, n in pairs:
            out[dst + name + ".weight"] = sd[src + a + ".weight"]
            out[dst + name + ".bias"] = sd.get(src + a + ".bias", zeros(n))
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in out.items()}


def _vocabulary(w: Any, loaded: Any) -> None:
    import gguf

    itos, stoi = loaded.vocab.itos, loaded.vocab.stoi
    special = {t for t in itos if t.startswith("<") and t.endswith(">") and len(t) > 2}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    bpe = loaded.tokenizer.kind == "bpe"
    # A BPE vocabulary is byte-level already; char and word tokens are spelt in its alphabet.
    w.add_token_list([t if bpe or t in special else _byte_level(t) for t in itos])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in itos])
    if bpe:
        import json

        merges = json.loads(loaded.tokenizer.hf.to_str())["model"]["merges"]
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    else:
        # llama.cpp refuses a vocabulary without merges, and GGUF has no empty array: one pair of
        # control tokens, which never meet (its BPE starts from single characters), changes nothing.
        w.add_token_merges(["<unk> <unk>"])
    for name, add in (
        ("<unk>", w.add_unk_token_id),
        ("<bos>", w.add_bos_token_id),
        ("<eos>", w.add_eos_token_id),
        ("<pad>", w.add_pad_token_id),
    ):
        if name in stoi:
            add(stoi[name])
    w.add_add_bos_token(False)


def export_gpt(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    import gguf

    c = loaded.model.config
    check_gpt(c, "gguf")
    kind = runtime_arch(c)
    w = gguf.GGUFWriter(os.path.join(out, FILE), kind)
    w.add_name(card.get("name") or loaded.config.recipe)
    w.add_context_length(c.block_size)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head)
    w.add_layer_norm_eps(1e-5)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if kind != "gpt2":
        w.add_rope_dimension_count(c.n_embd // c.n_head)
        w.add_rope_freq_base(10000.0)
    if kind == "gptneox":
        w.add_parallel_residual(False)
    _vocabulary(w, loaded)
    for name, t in tensors(loaded.model).items():
        w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [FILE]
