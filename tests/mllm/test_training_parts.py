"""The training loop's parts on their own (mllm.training): when a training ends, when last.pt is
written, and the tokens a resumed training counts."""

from __future__ import annotations

import math

from mllm.config import TrainConfig
from mllm.training.saving import last_due
from mllm.training.state import Limits, LoopState


def test_a_training_ends_at_its_steps_epochs_minutes_or_patience() -> None:
    steps = Limits.of(TrainConfig(max_steps=10, max_minutes=1), batches_per_epoch=None)
    assert (steps.total_steps, steps.budget_s) == (10, None)  # steps set: the schedule follows them
    assert steps.reason(9, 59.0, 0) is None
    assert steps.reason(10, 0.0, 0) == "max_steps"
    assert steps.reason(3, 60.0, 0) == "max_minutes"  # whichever comes first

    epochs = Limits.of(TrainConfig(epochs=1.5, sampling="epoch", grad_accum=2), batches_per_epoch=7)
    assert epochs.total_steps == math.ceil(1.5 * 7 / 2) and epochs.reason(6, 0.0, 0) == "epochs"

    minutes = Limits.of(TrainConfig(max_minutes=2), batches_per_epoch=None)
    assert (minutes.total_steps, minutes.budget_s) == (None, 120.0)  # minutes alone: a budget
    assert minutes.reason(10**6, 119.9, 0) is None and minutes.reason(1, 120.0, 0) == "max_minutes"

    patient = Limits.of(TrainConfig(max_steps=100, early_stopping_patience=3), batches_per_epoch=None)
    assert patient.reason(5, 0.0, 2) is None and patient.reason(5, 0.0, 3) == "early_stopping"


def test_last_pt_is_due_every_interval_every_few_minutes_at_the_end_and_on_a_signal() -> None:
    t = TrainConfig(max_steps=100, checkpoint_interval=50, checkpoint_minutes=1)
    st = LoopState(step=7, saved_at=100.0)
    assert not last_due(t, st, elapsed=159.0, signalled=False)
    assert last_due(t, st, elapsed=160.0, signalled=False)  # a minute of training since the last
    assert last_due(t, st, elapsed=101.0, signalled=True)
    assert last_due(t, LoopState(step=50, saved_at=100.0), elapsed=101.0, signalled=False)
    assert last_due(t, LoopState(step=7, saved_at=100.0, stop="pruned"), elapsed=101.0, signalled=False)
    by_steps = TrainConfig(max_steps=100, checkpoint_interval=50, checkpoint_minutes=None)
    assert not last_due(by_steps, st, elapsed=10**6, signalled=False)


def test_a_resumed_training_counts_every_runs_tokens() -> None:
    st = LoopState(step=30, metrics={"tokens": 2000.0, "elapsed_s": 12.0, "best_val_loss": 1.5})
    st.resumed()
    assert (st.resumed_from, st.elapsed_before, st.best, st.evals_since_best) == (30, 12.0, 1.5, 0)
    st.tokens_run, st.step = 500, 35
    assert st.tokens() == 2500.0
    # A checkpoint from before tokens were counted: its 30 steps at this run's 100 tokens a step.
    old = LoopState(step=30, metrics={"elapsed_s": 12.0})
    old.resumed()
    old.tokens_run, old.step = 500, 35
    assert old.tokens() == 30 * 100 + 500
    fresh = LoopState()
    fresh.resumed()
    assert (fresh.best, fresh.resumed_from, fresh.elapsed_before) == (math.inf, 0, 0.0)
