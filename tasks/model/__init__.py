"""The model stages as Prefect tasks, a module each: train, evaluate (and score the champion),
generate samples; and what the stages hand on."""

from __future__ import annotations

from pydantic import BaseModel

from mllm import storage
from mllm.runtime import speed
from mllm.runtime.results import TrainResult
from tasks.data import SourceSide, Splits, Tokens, Vocabulary


# Prefect keeps a cached result as a pickle that names its class by module: these classes stay at
# `tasks.model.<Name>` for results cached before.
class Prepared(BaseModel):
    """What the data stages hand on to training."""

    raw_sha256: str
    raw_url: str
    raw_bytes: int
    source: str
    tokens: Tokens
    vocab: Vocabulary
    splits: Splits
    source_side: SourceSide | None = None  # parallel text: the source side; vocab is the target's
    # A source of many files: how many, the corpus manifest (tasks/data/download.py), the files left out.
    raw_files: int = 1
    raw_manifest: str | None = None
    raw_skipped: list[str] = []
    raw_duplicates: int = 0  # files of the same bytes as another, read once
    raw_previous: str | None = None  # the corpus digest the same sources gave the run before


class Trained(BaseModel):
    key: str
    run_dir: str
    config: str  # the job's config YAML: `python -m mllm.train --config` runs it again
    checkpoint: str
    best_checkpoint: str | None  # none until a validation has run
    steps: int
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    tokens_per_s: float
    elapsed_s: float
    stop_reason: str
    resumed_from_step: int
    dtype_used: str = "float32"  # what train.dtype resolved to, and why (mllm.runtime.speed)
    dtype_reason: str = ""
    dtype_probe_ms: dict[str, float] | None = None
    mfu: float | None = None  # model FLOPs utilisation over the training
    peak_flops: float | None = None
    peak_source: str = ""
    compile_used: bool = False  # what train.compile resolved to, and why (mllm.runtime.speed)
    compile_reason: str = ""
    compile_s: float | None = None
    attention: str = ""  # a GPT's attention kernel on a CPU per precision, as measured (mllm.runtime.speed)
    muon_precision: str = ""  # train.optimizer muon: its Newton-Schulz precision and why (mllm.runtime.optim)
    # Its threads and why, and whether the machine was busy and what that cost (mllm.runtime.threads).
    threads: int = 1
    threads_reason: str = ""
    busy: bool = False
    cpu_share: float | None = None
    steps_planned: int | None = None
    load_average: float | None = None
    cores: int | None = None

    def busy_line(self) -> str:
        return TrainResult(**self.model_dump(include=set(TrainResult.__dataclass_fields__))).busy_line()

    def precision(self) -> str:
        return speed.Precision(self.dtype_used, self.dtype_reason, self.dtype_probe_ms).describe()

    def samples_url(self, method: str) -> str:
        return storage.join(self.run_dir, "samples", f"{method}.txt")


class Evaluation(BaseModel):
    """A family's evaluation of the trained model on one split (mllm.families.base.Evaluation), with
    where its report lives."""

    split: str
    checkpoint: str
    loss: float  # held-out loss (nats per target)
    tokens: int  # targets scored
    report: str  # URL of the markdown report
    headline: str  # the family's headline metric, which decides the champion
    higher_is_better: bool
    metrics: dict[str, float]  # every measure, the headline among them
    files: list[str] = []  # pictures and exports under the run folder, kept as artifacts

    @property
    def score(self) -> float:
        return self.metrics[self.headline]
