"""What a training hands back (TrainResult), and the lines that say it: the same figures in the
terminal, trained.json, MLflow and `runs`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainResult:
    steps: int
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    checkpoint: str  # last.pt
    best_checkpoint: str | None
    tokens_per_s: float
    elapsed_s: float  # training time over every run of this checkpoint_dir, resumes included
    stop_reason: str  # max_steps | epochs | max_minutes | early_stopping | pruned
    resumed_from_step: int
    dtype_used: str = "float32"  # what train.dtype resolved to (mllm.runtime.speed)
    dtype_reason: str = ""
    dtype_probe_ms: dict[str, float] | None = None  # a probe step per precision, when probed
    mfu: float | None = None  # model FLOPs utilisation over this run's training time
    peak_flops: float | None = None  # the device's peak in dtype_used, FLOP/s, all ranks together
    peak_source: str = ""
    compile_used: bool = False  # what train.compile resolved to (mllm.runtime.speed), and why
    compile_reason: str = ""
    compile_s: float | None = None
    attention: str = ""  # a GPT's attention kernel on a CPU per precision, as measured (mllm.runtime.speed)
    muon_precision: str = ""  # train.optimizer muon: its Newton-Schulz precision and why (mllm.runtime.optim)
    # The threads it computed with and why, whether the machine was busy (its threads ran less than
    # cpu_share of the time, cores' load average at the end) and the steps that cost (mllm.runtime.threads).
    threads: int = 1
    threads_reason: str = ""
    busy: bool = False
    cpu_share: float | None = None
    steps_planned: int | None = None
    load_average: float | None = None
    cores: int | None = None

    def done_line(self) -> str:
        """`python -m mllm.train`'s last line: the steps, the losses, the whole training's speed (after
        what a busy machine cost it)."""
        val = f"{self.val_loss:.4f}" if self.val_loss is not None else "-"
        best = f"{self.best_val_loss:.4f}" if self.best_val_loss is not None else "-"
        resumed = f", resumed from step {self.resumed_from_step}" if self.resumed_from_step else ""
        mfu = f", mfu {self.mfu:.1%}" if self.mfu is not None else ""
        busy = f"{self.busy_line()}\n" if self.busy else ""  # the done line last, as scripts read it
        return (
            f"{busy}done: {self.steps} steps ({self.stop_reason}{resumed}), val loss {val}, best {best}, "
            f"{self.tokens_per_s:,.0f} tok/s{mfu} over the training, {self.dtype_used}"
            f"{', compiled' if self.compile_used else ''}, {self.threads} threads, {self.elapsed_s:.1f}s; "
            f"checkpoint {self.checkpoint}"
        )

    def busy_line(self) -> str:
        """What a busy machine cost the training, in a line ("" when it was not busy)."""
        if not self.busy:
            return ""
        load = f" (load average {self.load_average:g} on {self.cores} cores)" if self.load_average is not None else ""
        cost = (
            f": {self.steps} steps done of about {self.steps_planned} with the CPU to itself"
            if self.stop_reason == "max_minutes" and self.steps_planned
            else ": its steps took longer than they would alone"
        )
        return (
            f"the machine was busy: the training's {self.threads} thread{'s' if self.threads > 1 else ''} "
            f"ran {self.cpu_share:.0%} of the time{load}{cost}"
        )
