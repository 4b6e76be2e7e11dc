"""The model section of the config tree: one section per family of models, told apart by `arch`."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, model_validator

from mllm.config.section import Section


class RecurrentConfig(Section):
    """A recurrent language model: embedding, stacked LSTM/GRU/RNN layers, a linear head."""

    arch: Literal["lstm", "gru", "rnn"] = "lstm"
    vocab_size: int = Field(0, ge=0)  # 0: taken from the vocabulary when training starts
    n_embd: int = Field(32, ge=1)
    n_layer: int = Field(4, ge=1)
    hidden_size: int = Field(128, ge=1)
    from_scratch: bool = False  # our own LSTM/RNN cells instead of torch.nn.LSTM/RNN
    tie_weights: bool = True  # share the embedding with the output layer when n_embd == hidden_size
    dropout: float = Field(0.2, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _cells(self) -> "RecurrentConfig":
        if self.from_scratch and self.arch == "gru":
            raise ValueError("from_scratch cells exist for lstm and rnn, not gru")
        return self


class GPTConfig(Section):
    """A decoder-only transformer (nanoGPT's): learned positions, pre-LayerNorm blocks, by default."""

    arch: Literal["gpt"] = "gpt"
    vocab_size: int = Field(0, ge=0)  # 0: taken from the vocabulary when training starts
    n_embd: int = Field(128, ge=1)
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    block_size: int = Field(64, ge=1)
    bias: bool = True
    tie_weights: bool = True
    dropout: float = Field(0.2, ge=0.0, lt=1.0)
    # sinusoidal: the seq2seq transformer's fixed table (no parameters); explicit: attention
    # written out in tensor code instead of torch's SDPA kernel, the same numbers. The defaults are
    # what a checkpoint from before these fields was trained with.
    # rotary: q and k turned by their position in every layer (no table added to the input).
    positions: Literal["learned", "sinusoidal", "rotary"] = "learned"
    attention: Literal["sdpa", "explicit"] = "sdpa"
    # The modern small-GPT pieces (mllm/lm/gpt_pieces.py, benchmarks/ablation.py); the defaults
    # are nanoGPT's, so a checkpoint from before these fields loads as it was trained.
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # rmsnorm: x / rms(x) * gain, no bias
    qk_norm: bool = False  # RMS-normalise each head's q and k before attention (no gain)
    mlp: Literal["gelu", "relu2"] = "gelu"  # relu2: relu(x)^2, as modded-nanogpt and nanochat
    zero_init_proj: bool = False  # attention and MLP output projections start at zero
    logit_softcap: float | None = Field(None, gt=0)  # logits -> c * tanh(logits / c)
    # Every other layer's values, the last layer's included, mix in a second embedding of the
    # token: v -> a * v + b * ve(token), a and b learned per layer (ResFormer; modded-nanogpt).
    value_embeds: bool = False
    # Before each layer x -> r_i * x + s_i * x0, x0 the embedded input, r_i and s_i learned
    # per layer (nanochat); r = 1, s = 0 at first, so the model starts as the one without them.
    residual_scalars: bool = False

    @model_validator(mode="after")
    def _heads(self) -> "GPTConfig":
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class CbowConfig(Section):
    """The `model:` section of a CBOW recipe."""

    arch: Literal["cbow"] = "cbow"
    vocab_size: int = Field(0, ge=0, description="0: the vocabulary's size, set when the model is built")
    n_embd: int = Field(300, ge=1)
    # nn.Embedding's max_norm: a looked-up row longer than this is scaled back onto the ball.
    max_norm: float | None = Field(1.0, gt=0)
    context: int = Field(4, ge=1, description="words on each side of the centre word")
    objective: Literal["softmax", "negative"] = "softmax"
    n_negative: int = Field(5, ge=1, description="noise words per sample (objective: negative)")
    noise_power: float = Field(0.75, ge=0, description="noise distribution: unigram counts ** this")
    # <unk> is never a centre word nor a context word: predicting "some rare word" teaches nothing.
    skip_unk: bool = True


class Seq2SeqConfig(Section):
    """An encoder-decoder with attention (mllm.seq2seq): Bahdanau's RNN or a transformer."""

    arch: Literal["seq2seq-rnn", "seq2seq-transformer"] = "seq2seq-transformer"
    # 0: taken from the vocabularies when training starts.
    src_vocab_size: int = Field(0, ge=0)
    tgt_vocab_size: int = Field(0, ge=0)
    n_embd: int = Field(128, ge=2)  # embedding size (rnn); model width (transformer)
    hidden_size: int = Field(256, ge=1)  # rnn: encoder per direction and decoder
    n_layer: int = Field(2, ge=1)  # rnn: encoder layers; transformer: encoder and decoder layers
    cell: Literal["gru", "lstm"] = "gru"  # rnn encoder; the decoder is a GRU either way
    n_head: int = Field(4, ge=1)
    d_ff: int = Field(0, ge=0)  # transformer feed-forward width; 0 means 4 * n_embd
    norm: Literal["pre", "post"] = "post"
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    max_src_len: int = Field(64, ge=1)  # tokens, without <eos>; longer pairs are left out
    max_tgt_len: int = Field(64, ge=1)
    tie_weights: bool = False  # transformer: the output layer reuses the target embedding

    @model_validator(mode="after")
    def _shapes(self) -> "Seq2SeqConfig":
        if self.arch == "seq2seq-transformer":
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd {self.n_embd} must be a multiple of n_head {self.n_head}")
            if self.n_embd % 2:
                raise ValueError(f"n_embd {self.n_embd} must be even for sinusoidal positions")
        return self


class SequenceModelConfig(Section):
    """A sequence experiment's network (the seeds' parts IV and V): one-hot inputs of the numbers,
    one recurrent layer of 32, a linear read-out at every position. `family: sequences` tells it
    from a recurrent language model of the same arch."""

    family: Literal["sequences"] = "sequences"
    arch: Literal["rnn", "lstm", "gru"] = "lstm"
    from_scratch: bool = False  # the RNN and LSTM cells written out in mllm/lm/rnn.py
    hidden_size: int = Field(32, ge=1)
    n_layer: int = Field(1, ge=1)
    vocab_size: int = Field(0, ge=0)  # 0: the vocabulary's size (the numbers and <unk>)

    @model_validator(mode="after")
    def _cells(self) -> "SequenceModelConfig":
        if self.from_scratch and self.arch == "gru":
            raise ValueError("from_scratch cells exist for lstm and rnn, not gru")
        return self


# The model sections, told apart by `arch` (and `family` where two share an arch name): a
# section holds its own fields only, so a field of another section is refused and the training
# key digests only what the model uses. mllm.families.base maps each section to its family.
SECTIONS: dict[str, type[Section]] = {
    "recurrent": RecurrentConfig,
    "gpt": GPTConfig,
    "word embeddings": CbowConfig,
    "sequence-to-sequence": Seq2SeqConfig,
    "sequences": SequenceModelConfig,
}


DEFAULT_ARCH = "lstm"  # a model section that names no arch


def _section_tag(value: Any) -> str | None:
    get = value.get if isinstance(value, dict) else lambda k, d=None: getattr(value, k, d)
    if get("family") is not None:
        return str(get("family"))
    arch = get("arch", DEFAULT_ARCH)
    return next(
        (
            tag
            for tag, section in SECTIONS.items()
            if tag != "sequences" and arch in typing.get_args(section.model_fields["arch"].annotation)
        ),
        str(arch),
    )


ModelConfig = Annotated[
    Union[tuple(Annotated[section, Tag(tag)] for tag, section in SECTIONS.items())], Discriminator(_section_tag)
]


_MODEL = TypeAdapter(ModelConfig)


def model_config(**fields: Any) -> Any:
    """The model section that `arch` (default lstm) and `family` name, built from its fields."""
    return _MODEL.validate_python({"arch": DEFAULT_ARCH, **fields})


def section_of(tag: str) -> type[Section] | None:
    return SECTIONS.get(tag)


def archs() -> list[str]:
    return list(
        dict.fromkeys(
            a for section in SECTIONS.values() for a in typing.get_args(section.model_fields["arch"].annotation)
        )
    )
