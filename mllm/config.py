"""The one typed configuration tree.

A run is described by a `RunConfig`: data (source, tokenizer, vocabulary, split), model, training
and sampling. Recipes are YAML files of this tree (`mllm/recipes/NAME.yaml`), resolved with the
CLI's `--set key=value` overrides by `mllm.resolve`; the flow parameters, the MLflow params and
the config stored in each checkpoint are this same tree, dumped with `to_dict()`.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator


class _Section(BaseModel):
    # An unknown field is a typo the user wants to hear about, not silently ignore.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TokenizerConfig(_Section):
    # basic_english: torchtext's rules, one token list per paragraph (what CBOW trains on).
    kind: Literal["char", "word", "bpe", "basic_english"] = "char"
    # char: keep only [A-Za-z0-9 \-.;,\n?!], newline runs -> one space, space runs -> one space.
    # False keeps every character as it is (the "raw" mode).
    normalize: bool = True
    bpe_vocab_size: int = Field(2000, ge=64, le=1_000_000)
    strip_gutenberg: bool = True
    # A corpus of many files trains its BPE on a sample of this many bytes (whole files in digest
    # order): the tokenizer, and so every token, stays while the corpus grows outside the sample.
    train_bytes: int = Field(32_000_000, ge=1)


class VocabConfig(_Section):
    min_freq: int = Field(1, ge=1)
    max_size: int | None = Field(None, ge=2)
    # <unk> is always present; these are added on request.
    specials: list[Literal["<pad>", "<bos>", "<eos>"]] = []
    # The order of the ids. frequency: most frequent first. token: in token order, so a corpus
    # that grows keeps its ids while no new token arrives (and a many-file corpus's split is
    # routed again for its new files only). auto: token for a corpus of many files, else frequency.
    order: Literal["auto", "frequency", "token"] = "auto"


class SplitConfig(_Section):
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    test_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # Contiguous: train is the first part of the text, then val, then test (no leakage between
    # neighbouring windows). Otherwise chunks of `shuffle_chunk` tokens are shuffled with `seed`.
    contiguous: bool = True
    shuffle_chunk: int = Field(4096, ge=1)
    seed: int = 1337
    # A corpus of many files: each span (a document, or a piece of about this many characters of
    # a longer one) goes to train, val or test by a digest of its content and the seed, so adding
    # files never moves a span. One file keeps the split above.
    span_bytes: int = Field(16_384, ge=64)

    @model_validator(mode="after")
    def _fractions(self) -> "SplitConfig":
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("val_fraction + test_fraction must be below 1 (train needs some data)")
        return self


class NumbersConfig(_Section):
    """The offline parallel corpus: `count` distinct numbers in [0, max_number] written out in
    English words, paired with the same number in `language` (num2words)."""

    count: int = Field(10_000, ge=2)
    max_number: int = Field(9_999, ge=1)
    seed: int = 0
    language: Literal["de", "fr"] = "de"

    @model_validator(mode="after")
    def _enough(self) -> "NumbersConfig":
        if self.count > self.max_number + 1:
            raise ValueError(f"count {self.count} exceeds the {self.max_number + 1} numbers in [0, max_number]")
        return self


class PairsConfig(_Section):
    """Parallel text for the sequence-to-sequence family: `data.source` is a TSV file of pairs
    (source, target; more columns are ignored), or empty with `numbers` set. `data.tokenizer`
    cuts the source side, `target_tokenizer` the target side; `data.vocab` and `data.split`
    (val/test fraction and seed) apply as for a corpus."""

    numbers: NumbersConfig | None = None
    # False keeps every character: the char tokenizer's normalisation would drop German's umlauts.
    target_tokenizer: TokenizerConfig = TokenizerConfig(kind="char", normalize=False)
    shared_vocab: bool = False  # one vocabulary for both sides
    # sacrebleu's BLEU tokenization: 13a (words, the WMT default), or char for one-word targets
    # (a German number), where word 4-grams do not exist and word BLEU is 0 whatever the output.
    bleu_tokenize: Literal["13a", "char", "intl", "none"] = "13a"


class SequencesConfig(_Section):
    """Generated sequences of the numbers 0..numbers-1 (the seeds' parts IV and V), no corpus:
    `count` predicts the next number of `length` consecutive ones at every position;
    `remember-first` reads the same inputs and must answer the first element at every position
    (the seed's figure); `remember-first-random` asks the same of `count` random sequences, where
    the first element cannot be worked out from the current one and its position. The consecutive
    tasks have only numbers - length distinct sequences: as in the seed, the model is trained and
    scored on all of them."""

    task: Literal["count", "remember-first", "remember-first-random"] = "count"
    length: int = Field(10, ge=2, le=4096)
    numbers: int = Field(128, ge=4, le=1_000_000)
    count: int = Field(2000, ge=2, description="remember-first-random: how many sequences to draw")
    seed: int = 0

    @model_validator(mode="after")
    def _room(self) -> "SequencesConfig":
        if self.task != "remember-first-random" and self.length >= self.numbers:
            raise ValueError(
                f"length {self.length} leaves no sequence of consecutive numbers below {self.numbers}: "
                "lower length or raise numbers"
            )
        return self


class DataConfig(_Section):
    # A file, folder, object-store prefix or glob; several as a list.
    source: str | list[str] = ""
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    tokenizer: TokenizerConfig = TokenizerConfig()
    vocab: VocabConfig = VocabConfig()
    split: SplitConfig = SplitConfig()
    pairs: PairsConfig | None = None  # the seq2seq family: parallel text instead of a corpus
    sequences: SequencesConfig | None = None  # the sequence experiments: data made from this section
    # JSONL and Parquet files: the field that holds each record's text (other fields are ignored).
    text_field: str = "text"
    # A file of a many-file source that is not usable text: fail the run, or skip it (named in
    # the run's record). By default (skip-empty) an empty file of many is left out and counted (it
    # holds no text to lose: a package's __init__.py) and any other bad file fails the run; a
    # source of one file that is empty is always an error.
    bad_files: Literal["skip-empty", "fail", "skip"] = "skip-empty"
    # Where the per-file work of a many-file source runs: processes (one per core), threads, or
    # dask://HOST:PORT (a running Dask scheduler, through prefect-dask).
    task_runner: str = "processes"

    @model_validator(mode="after")
    def _runner(self) -> "DataConfig":
        r = self.task_runner
        if r not in ("processes", "threads") and not (r.startswith("dask://") and ":" in r[len("dask://") :]):
            raise ValueError(f"task_runner {r!r} is none of processes, threads or dask://HOST:PORT")
        return self

    @property
    def sources(self) -> list[str]:
        return [self.source] if isinstance(self.source, str) else list(self.source)


class RecurrentConfig(_Section):
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


class GPTConfig(_Section):
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


class CbowConfig(_Section):
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


class Seq2SeqConfig(_Section):
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


class SequenceModelConfig(_Section):
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
SECTIONS: dict[str, type[_Section]] = {
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


def section_of(tag: str) -> type[_Section] | None:
    return SECTIONS.get(tag)


def archs() -> list[str]:
    return list(
        dict.fromkeys(
            a for section in SECTIONS.values() for a in typing.get_args(section.model_fields["arch"].annotation)
        )
    )


class TrainConfig(_Section):
    batch_size: int = Field(64, ge=1)
    window: int = Field(64, ge=1)  # tokens per training sequence (GPT: at most block_size)
    # "epoch": shuffled passes over every window at `stride` (the reference LSTM recipe).
    # "random": each batch draws random windows (nanoGPT).
    sampling: Literal["epoch", "random"] = "random"
    stride: int = Field(1, ge=1)
    epochs: float | None = Field(None, gt=0)
    max_steps: int | None = Field(None, ge=1)
    max_minutes: float | None = Field(None, gt=0)
    # muon: torch.optim.Muon for a GPT's 2-D hidden weights (attention and MLP matrices), AdamW
    # (lr, betas, weight_decay below) for the embeddings, head, norms and biases.
    optimizer: Literal["adam", "adamw", "muon"] = "adamw"
    muon_lr: float = Field(0.02, gt=0)  # Muon's peak rate; the schedule scales it as it scales lr
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_weight_decay: float = Field(0.0, ge=0)  # decoupled, on the Muon matrices only
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(1e-4, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # linear: to 0, as word2vec
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    grad_clip: float | None = Field(None, gt=0)
    grad_accum: int = Field(1, ge=1)
    eval_interval: int = Field(500, ge=1)
    eval_batches: int = Field(20, ge=1)
    log_interval: int = Field(10, ge=1)
    checkpoint_interval: int = Field(1000, ge=1)
    # Also write last.pt after this many minutes of training since the last write (None: by steps
    # only); SIGINT and SIGTERM write it too, of the last finished step.
    checkpoint_minutes: float | None = Field(5.0, gt=0)
    early_stopping_patience: int | None = Field(None, ge=1)  # evaluations without improvement
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast where faster (mllm.runtime.speed)
    # auto: torch.compile when the training left should win back the compilation, kept only if
    # the compiled steps are faster (mllm.runtime.speed); true/false force it.
    compile: Literal["auto", True, False] = "auto"
    seed: int = 1337
    nproc_per_node: int = Field(1, ge=1)  # >1: the job starts training under torchrun (DDP)

    @model_validator(mode="after")
    def _length(self) -> "TrainConfig":
        if self.max_steps is None and self.epochs is None and self.max_minutes is None:
            raise ValueError("set one of max_steps, epochs or max_minutes: training needs an end")
        if self.epochs is not None and self.sampling != "epoch":
            raise ValueError("epochs needs sampling: epoch (random sampling counts max_steps)")
        return self


SamplingMethod = Literal["greedy", "temperature", "top-k", "top-p", "beam"]
METHODS: tuple[str, ...] = typing.get_args(SamplingMethod)


class SampleConfig(_Section):
    prompts: list[str] = ["The "]
    max_new_tokens: int = Field(200, ge=1)
    methods: list[SamplingMethod] = ["greedy", "top-p"]
    temperature: float = Field(0.8, gt=0)
    top_k: int = Field(40, ge=1)
    top_p: float = Field(0.9, gt=0, le=1)
    beam_width: int = Field(4, ge=1)
    seed: int = 1337
    # A GPT's decoding on a CPU: auto takes bf16 weights where a probe finds them faster (mllm.runtime.speed).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Word embeddings: the nearest neighbours of these words are the family's "sample".
    probes: list[str] = []
    neighbours: int = Field(10, ge=1)


class TrainPaths(_Section):
    """Where a training job finds its inputs and puts its checkpoints (any fsspec URLs).

    Filled in by the pipeline, or by hand for `python -m mllm.train`; not part of what a run
    *is*, so left out of digests.
    """

    train_ids: str
    val_ids: str
    vocab: str
    tokenizer: str | None = None  # BPE: the trained tokenizer's JSON
    train_offsets: str | None = None  # CBOW: where each paragraph starts in the ids
    val_offsets: str | None = None
    # Sequence to sequence: train_ids and val_ids are the pairs' Parquet files, vocab and
    # tokenizer the target side's, these the source side's.
    src_vocab: str | None = None
    src_tokenizer: str | None = None
    checkpoint_dir: str


class RunConfig(_Section):
    recipe: str = "custom"
    data: DataConfig = DataConfig()
    model: ModelConfig = RecurrentConfig()
    train: TrainConfig = TrainConfig(max_steps=1000)
    sample: SampleConfig = SampleConfig()
    paths: TrainPaths | None = None

    def to_dict(self, paths: bool = False) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        if not paths:
            d.pop("paths", None)
        return d

    def to_yaml(self, paths: bool = True) -> str:
        return yaml.safe_dump(self.to_dict(paths=paths), sort_keys=False)
