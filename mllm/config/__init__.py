"""The one typed configuration tree, `RunConfig`: data (mllm.config.data), model (mllm.config.model),
training and sampling sections; recipes, flow parameters and checkpoints hold this tree."""

from __future__ import annotations

import typing
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from mllm.config.data import (
    DataConfig,
    NumbersConfig,
    PairsConfig,
    SequencesConfig,
    SplitConfig,
    TokenizerConfig,
    VocabConfig,
)
from mllm.config.model import (
    DEFAULT_ARCH,
    SECTIONS,
    CbowConfig,
    GPTConfig,
    ModelConfig,
    RecurrentConfig,
    Seq2SeqConfig,
    SequenceModelConfig,
    archs,
    model_config,
    section_of,
)
from mllm.config.section import Section

# The sections are importable from here, as they were when this package was one module.
__all__ = [
    "DEFAULT_ARCH",
    "METHODS",
    "SECTIONS",
    "CbowConfig",
    "DataConfig",
    "GPTConfig",
    "ModelConfig",
    "NumbersConfig",
    "PairsConfig",
    "RecurrentConfig",
    "RunConfig",
    "SampleConfig",
    "SamplingMethod",
    "Section",
    "Seq2SeqConfig",
    "SequenceModelConfig",
    "SequencesConfig",
    "SplitConfig",
    "TokenizerConfig",
    "TrainConfig",
    "TrainPaths",
    "VocabConfig",
    "archs",
    "model_config",
    "section_of",
]


class TrainConfig(Section):
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


class SampleConfig(Section):
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


class TrainPaths(Section):
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


class RunConfig(Section):
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
