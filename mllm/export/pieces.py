"""Which export format takes which of the GPT's pieces: one table that every format checks (and
docs/export.md shows), so a piece a format cannot express is refused by name before anything is
written."""

from __future__ import annotations

from typing import Any

from mllm import UserError

FORMATS = ("hf", "onnx", "gguf")


def gpt_pieces(m: Any) -> list[str]:
    """The GPT config's pieces, each as `field: value`, the ones any format must look at."""
    mlp = "mlp: relu2 with learned positions" if m.mlp == "relu2" and m.positions == "learned" else f"mlp: {m.mlp}"
    out = [f"positions: {m.positions}", mlp, f"norm: {m.norm}"]
    out += [f"{f}: true" for f in ("qk_norm", "value_embeds", "residual_scalars") if getattr(m, f)]
    if m.logit_softcap is not None:
        out.append("logit_softcap: set")
    if m.positions == "rotary" and (m.n_embd // m.n_head) % 2:
        out.append("rotary with an odd head size")
    return out


# The pieces each format takes: hf as GPT-2 (learned positions) or GPT-NeoX (rotary, halves
# rotated as mllm does), both with LayerNorm and an activation by name; gguf as llama.cpp's gpt2
# (GELU only), gptneox (rotary, GELU) and nemotron (rotary, ReLU², LayerNorm); onnx runs the
# model's own layers and takes everything.
TAKES = {
    "hf": {
        "positions: learned",
        "positions: rotary",
        "mlp: gelu",
        "mlp: relu2",
        "mlp: relu2 with learned positions",
        "norm: layernorm",
    },
    "gguf": {"positions: learned", "positions: rotary", "mlp: gelu", "mlp: relu2", "norm: layernorm"},
}


def takers(piece: str) -> list[str]:
    return [f for f in FORMATS if f not in TAKES or piece in TAKES[f]]


def check_gpt(m: Any, fmt: str) -> None:
    """Raise a UserError naming the first piece of GPT config `m` that format `fmt` cannot hold
    exactly, and the formats that can."""
    if fmt not in TAKES:
        return
    for piece in gpt_pieces(m):
        if piece not in TAKES[fmt]:
            others = [f for f in takers(piece) if f != fmt]
            raise UserError(
                f"the GPT's {piece} has no counterpart in --format {fmt} (no architecture it ships has it): "
                f"export with --format {' or '.join(others)}"
            )
