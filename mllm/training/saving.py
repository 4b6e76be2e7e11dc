"""Checkpoints during training: what last.pt and best.pt hold, when last.pt is due, and the step a signal breaks off."""

from __future__ import annotations

from typing import NoReturn

from mllm.config import TrainConfig
from mllm.runtime.checkpoint import rewind, save_checkpoint
from mllm.runtime.distributed import rng_state
from mllm.training.setup import Training
from mllm.training.state import LoopState


def save(tr: Training, st: LoopState, url: str) -> None:
    """The full state at st.step, enough to resume to the same weights (rank 0 writes)."""
    rng = rng_state(tr.batches, tr.device, tr.d)  # a collective: every rank takes part
    if not tr.d.master:
        return
    save_checkpoint(
        url,
        {
            "model": tr.raw.state_dict(),
            "optimizer": tr.optimizer.state_dict(),
            "scheduler": tr.scheduler.state_dict(),
            "step": st.step,
            "rng": rng,
            "config": tr.cfg.to_dict(),
            "vocab": tr.vocab.to_json(),
            "vocab_digest": tr.vocab.digest,
            "tokenizer": tr.tokenizer.to_json(),
            "metrics": {k: float(v) for k, v in st.metrics.items()},
            "data_state": tr.batches.state_dict(),
            **tr.carry,
        },
    )


def last_due(t: TrainConfig, st: LoopState, elapsed: float, signalled: bool) -> bool:
    """Whether last.pt is written after this step: every checkpoint_interval steps, every
    checkpoint_minutes of training, at the end, and when a signal arrived."""
    timed = t.checkpoint_minutes is not None and elapsed - st.saved_at >= 60 * t.checkpoint_minutes
    return st.step % t.checkpoint_interval == 0 or st.stop is not None or timed or signalled


def broken_off(tr: Training, st: LoopState, where: tuple | None) -> NoReturn:
    """A signal broke off a step's forward and backward or an evaluation (Signals.breaking), or
    failed it: one sent to the whole process group (`timeout`, a batch scheduler, Ctrl-C at a
    terminal) also ends the C++ compiler that inductor waits for. The work is lost, not the
    training: last.pt holds the last finished step (a broken step's batches, rewound to `where`,
    are drawn again on resume), then the signal takes its course (this raises)."""
    if where is not None:
        rewind(tr.batches, where, tr.device)
    tr.optimizer.zero_grad(set_to_none=True)
    save(tr, st, tr.last_url)
    tr.signals.deliver(st.step)
