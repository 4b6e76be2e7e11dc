"""A GPT as a Hugging Face transformers folder that loads with no custom code: nanoGPT's pieces as
GPT-2, rotary ones as GPT-NeoX (sequential residual, rotary over the whole head, halves rotated as
mllm.lm.gpt_pieces.Rotary does), safetensors weights, the tokenizer and a model card."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

import torch

from mllm.export.pieces import check_gpt
from mllm.export.tokenizer import fast_tokenizer
from mllm.redact import scrub


def _zeros_if_none(t: torch.Tensor | None, n: int) -> torch.Tensor:
    # A layer without a bias is the same layer with a zero one: the shipped architectures always have one.
    return torch.zeros(n) if t is None else t


def _gpt2(model: Any, ids: dict[str, int | None]) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import GPT2Config

    c, sd = model.config, model.state_dict()
    cfg = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function=c.mlp,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=c.tie_weights,
        **ids,
    )
    w = {
        "transformer.wte.weight": sd["transformer.wte.weight"],
        "transformer.wpe.weight": sd["transformer.wpe.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    names = [
        ("ln_1", None),
        ("attn.c_attn", 3 * c.n_embd),
        ("attn.c_proj", c.n_embd),
        ("ln_2", None),
        ("mlp.c_fc", 4 * c.n_embd),
        ("mlp.c_proj", c.n_embd),
    ]
    for prefix in [f"transformer.h.{i}." for i in range(c.n_layer)] + ["transformer."]:
        for name, n_out in names if prefix != "transformer." else [("ln_f", None)]:
            weight = sd[prefix + name + ".weight"]
            # GPT-2's Conv1D stores a linear layer's weight as [in, out].
            w[prefix + name + ".weight"] = weight if n_out is None else weight.t()
            w[prefix + name + ".bias"] = _zeros_if_none(sd.get(prefix + name + ".bias"), weight.shape[0])
    return cfg, w


def _neox_qkv(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """mllm's c_attn rows [q | k | v], each [head][dim], as GPT-NeoX's [head][q | k | v][dim]."""
    return t.view(3, n_head, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _neox(model: Any, ids: dict[str, int | None]) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import GPTNeoXConfig

    c, sd = model.config, model.state_dict()
    cfg = GPTNeoXConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        intermediate_size=4 * c.n_embd,
        hidden_act=c.mlp,
        max_position_embeddings=c.block_size,
        layer_norm_eps=1e-5,
        use_parallel_residual=False,
        tie_word_embeddings=c.tie_weights,
        attention_bias=True,
        rotary_pct=1.0,
        rotary_emb_base=10000.0,
        **ids,
    )
    w = {"gpt_neox.embed_in.weight": sd["transformer.wte.weight"], "lm_head.weight": sd["lm_head.weight"]}
    E = c.n_embd
    for i in range(c.n_layer):
        src, dst = f"transformer.h.{i}.", f"gpt_neox.layers.{i}."
        for a, b, n in [
            ("ln_1", "input_layernorm", E),
            ("ln_2", "post_attention_layernorm", E),
            ("attn.c_attn", "attention.query_key_value", 3 * E),
            ("attn.c_proj", "attention.dense", E),
            ("mlp.c_fc", "mlp.dense_h_to_4h", 4 * E),
            ("mlp.c_proj", "mlp.dense_4h_to_h", E),
        ]:
            weight, bias = sd[src + a + ".weight"], _zeros_if_none(sd.get(src + a + ".bias"), n)
            if a == "attn.c_attn":
                weight, bias = _neox_qkv(weight, c.n_head), _neox_qkv(bias, c.n_head)
            w[dst + b + ".weight"], w[dst + b + ".bias"] = weight, bias
    w["gpt_neox.final_layer_norm.weight"] = sd["transformer.ln_f.weight"]
    w["gpt_neox.final_layer_norm.bias"] = _zeros_if_none(sd.get("transformer.ln_f.bias"), E)
    return cfg, w


def hf_model(model: Any, vocab: Any = None) -> Any:
    """The transformers model (float32, eval mode) that computes what the mllm GPT `model` does;
    `vocab` (a Vocab) names its <bos> and <eos> ids."""
    from transformers import AutoModelForCausalLM

    check_gpt(model.config, "hf")
    stoi = vocab.stoi if vocab is not None else {}
    ids = {"bos_token_id": stoi.get("<bos>"), "eos_token_id": stoi.get("<eos>"), "pad_token_id": stoi.get("<pad>")}
    cfg, weights = (_neox if model.config.positions == "rotary" else _gpt2)(model, ids)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight" or not model.config.tie_weights]:
        raise RuntimeError(f"weights that do not map: missing {missing}, unexpected {unexpected}")
    return hf.eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' progress bars and notices off while exporting: the command says what it did."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def export_gpt(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    """Write the folder into local folder `out`; returns the files written."""
    with _quiet():
        return _export_gpt(loaded, out, card)


def _export_gpt(loaded: Any, out: str, card: dict[str, Any]) -> list[str]:
    from transformers import GenerationConfig

    check_gpt(loaded.model.config, "hf")
    tokenizer = fast_tokenizer(loaded.tokenizer, loaded.vocab)  # refuses before anything is written
    model = hf_model(loaded.model, loaded.vocab)
    eos = loaded.vocab.stoi.get("<eos>")
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=loaded.config.sample.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(loaded, card, type(model.config).model_type))
    return sorted(os.listdir(out))


def model_card(loaded: Any, card: dict[str, Any], arch: str) -> str:
    """README.md: what the model is, how to load it, and where it came from (recipe, corpus, run)."""
    c, cfg = loaded.model.config, loaded.config
    lines = [
        f"# {card.get('name') or cfg.recipe}",
        "",
        f"A {c.n_layer}-layer, {c.n_head}-head, {c.n_embd}-wide GPT trained by mllm-pipeline with recipe "
        f"`{cfg.recipe}`, exported as transformers' `{arch}` architecture (no custom code).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
        "## Lineage",
        "",
        "| | |",
        "|---|---|",
        f"| checkpoint step | {loaded.step} |",
        f"| tokenizer | {loaded.tokenizer.kind} (normalize: {str(loaded.tokenizer.normalize).lower()}) |",
        f"| vocabulary | {len(loaded.vocab)} tokens, sha256 {loaded.vocab.digest} |",
    ]
    lines += [f"| {k} | {scrub(str(v))} |" for k, v in card.items() if k != "name" and v is not None]
    lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.6g} |" for k, v in sorted(loaded.metrics.items()) if isinstance(v, (int, float))]
    lines += [
        "",
        "## Recipe",
        "",
        "```json",
        json.dumps(scrub(cfg.model_dump(mode="json")), indent=1, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(lines)
