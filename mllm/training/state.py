"""What the training loop keeps from step to step (`LoopState`), and when it ends (`Limits`)."""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from mllm.config import TrainConfig


@dataclasses.dataclass
class Limits:
    """The ends a training has: steps (max_steps or epochs), minutes, early stopping."""

    total_steps: int | None  # None: the minutes alone end it
    end_reason: str  # the stop reason when total_steps is reached: max_steps | epochs | max_minutes
    budget_s: float | None  # minutes alone: the budget in seconds, which the schedule follows
    max_minutes: float | None
    patience: int | None  # evaluations without improvement

    @classmethod
    def of(cls, t: TrainConfig, batches_per_epoch: int | None) -> Limits:
        if t.max_steps is not None:
            total, reason = t.max_steps, "max_steps"
        elif t.epochs is not None:
            total, reason = math.ceil(t.epochs * batches_per_epoch / t.grad_accum), "epochs"
        else:
            total, reason = None, "max_minutes"
        # Minutes alone: the schedule follows the clock, the share of the budget spent (evaluations
        # in), so it runs out when the minutes do, however fast this machine's steps turn out.
        budget_s = 60 * t.max_minutes if total is None and t.max_minutes is not None else None
        return cls(total, reason, budget_s, t.max_minutes, t.early_stopping_patience)

    def reason(self, step: int, elapsed_s: float, evals_since_best: int) -> str | None:
        """Why the training ends after `step` at `elapsed_s` training seconds, or None."""
        if self.total_steps is not None and step >= self.total_steps:
            return self.end_reason
        if self.max_minutes is not None and elapsed_s >= 60 * self.max_minutes:
            return "max_minutes"
        if self.patience and evals_since_best >= self.patience:
            return "early_stopping"
        return None


@dataclasses.dataclass
class LoopState:
    """The loop's counters and clocks. `metrics` is what last.pt keeps of them (so a resumed
    training goes on counting); the rest is this run's, seconds from time.perf_counter."""

    step: int = 0  # optimizer steps taken, earlier runs' included
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # elapsed_s, eval_s, tokens, ...
    best: float = math.inf  # the best validation loss so far (nats a target)
    evals_since_best: int = 0
    resumed_from: int = 0  # the step this run started at
    elapsed_before: float = 0.0  # training seconds of the earlier runs
    tokens_before: float | None = None  # their targets; None from a checkpoint that did not count them
    t0: float = 0.0  # when this run's loop started
    tokens_run: int = 0  # targets this run trained on, all ranks
    loss_sum: torch.Tensor | None = None  # micro-batch losses since the last log line, summed on the device
    loss_count: int = 0
    # At the last log line: the clock, tokens_run and eval_s (a log line's rate is over its interval).
    mark: float = 0.0
    tokens_mark: int = 0
    eval_mark: float = 0.0
    saved_at: float = 0.0  # training seconds when last.pt was last written
    stop: str | None = None  # why the loop ends, once it does

    def resumed(self) -> None:
        """Take what the checkpoint's metrics say of the earlier runs."""
        self.resumed_from, self.tokens_before = self.step, self.metrics.get("tokens")
        self.elapsed_before = self.metrics.get("elapsed_s", 0.0)
        self.best = self.metrics.get("best_val_loss", math.inf)
        self.evals_since_best = int(self.metrics.get("evals_since_best", 0))

    def start(self, device: torch.device) -> None:
        """The loop starts now: this run's clocks and counters from zero."""
        self.t0 = self.mark = time.perf_counter()
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count, self.tokens_run, self.tokens_mark = 0, 0, 0
        self.eval_mark = self.metrics.get("eval_s", 0.0)
        self.saved_at = self.elapsed_before

    def tokens(self) -> float:
        """Targets trained over every run of this training (a checkpoint from before they were
        counted: its steps at this run's tokens a step)."""
        before = self.tokens_before
        if before is None:
            before = self.resumed_from * self.tokens_run / (self.step - self.resumed_from)
        return before + self.tokens_run

    def spent(self, budget_s: float) -> float:
        """The share of a time budget spent: what the learning-rate schedule follows."""
        return min(1.0, self.metrics.get("elapsed_s", 0.0) / budget_s)
