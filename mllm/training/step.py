"""One optimizer step of the loop (forward and backward over grad_accum micro-batches, clip, update),
the choices timed on it (threads, torch.compile), and the training clock all ranks agree on."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as tdist

from mllm.runtime import threads as threading
from mllm.runtime.checkpoint import BrokenOff, signalled_alone, step_position
from mllm.training.saving import broken_off
from mllm.training.setup import Engine, Training
from mllm.training.state import LoopState


def samples(batch: tuple) -> int:
    """What a batch teaches: its targets (tokens of a window, centre words, target tokens of
    pairs, whose padding is -1)."""
    return int((batch[-1] >= 0).sum())


def _forward_backward(tr: Training, en: Engine, st: LoopState) -> None:
    accum, d = tr.cfg.train.grad_accum, tr.d
    for micro in range(accum):
        batch = tr.batches.next()  # tensors of (batch_size, window) ids for a language model
        st.tokens_run += samples(batch) * d.world_size  # each rank's batch is as large, near enough
        if en.pin:
            batch = [x.pin_memory() for x in batch]
        batch = [x.to(tr.device, non_blocking=en.pin) for x in batch]
        if d.world_size > 1:
            # Average gradients across ranks once per step, not after every micro-batch.
            en.model.require_backward_grad_sync = micro == accum - 1
        with en.autocast():
            _, loss, _ = en.model(*batch)  # loss: mean nats a target of this micro-batch
        (loss / accum).backward()
        st.loss_sum += loss.detach()
        st.loss_count += 1


def take_step(tr: Training, en: Engine, st: LoopState) -> torch.Tensor:
    """One optimizer step; st.step counts it. Returns the gradient norm before clipping."""
    alone = tr.d.world_size == 1
    where = step_position(tr.batches, tr.device) if alone else None
    try:
        with tr.signals.breaking(alone):
            _forward_backward(tr, en, st)
    except BrokenOff:
        pass
    except Exception:
        if not signalled_alone(tr.signals, tr.d):
            raise
    else:
        where = None
    if where is not None:  # out of the except block: the signal's course is no follow-up of an error
        broken_off(tr, st, where)
    grad_norm = torch.nn.utils.clip_grad_norm_(tr.raw.parameters(), tr.cfg.train.grad_clip or math.inf)
    tr.optimizer.step()
    tr.scheduler.step()
    tr.optimizer.zero_grad(set_to_none=True)
    st.step += 1
    return grad_norm


def follow_step(tr: Training, en: Engine, st: LoopState, step_start: float, cpu_start: float) -> None:
    """Hand the step's wall and CPU seconds to the choices timed on steps: torch.compile while it
    decides, else the thread count (mllm.runtime.threads), which may say the machine is busy."""
    if en.compiling.deciding and not en.threads.measuring:  # threads first: compile's steps are timed at their count
        now, limits = time.perf_counter(), tr.limits
        minutes = tr.cfg.train.max_minutes
        en.model = en.compiling.after_step(
            now - step_start,
            limits.total_steps - st.step if limits.total_steps is not None else None,
            60 * minutes - (st.elapsed_before + now - st.t0) if minutes else None,
        )
        en.threads.total.add(now - step_start, time.process_time() - cpu_start, en.threads.threads)
    elif said := threading.follow(en.threads, time.perf_counter() - step_start, time.process_time() - cpu_start):
        tr.hooks.notice(said)


def clock(tr: Training, st: LoopState) -> tuple[float, float, bool]:
    """(training seconds of every run so far, the same with evaluations left out, whether a
    signal arrived). Under DDP every rank takes the latest clock and any rank's signal, or they
    would part ways (a checkpoint is a collective); the second figure stays this rank's."""
    elapsed = st.elapsed_before + time.perf_counter() - st.t0
    # A time to a loss should not depend on how often the loss was looked at.
    train_s = elapsed - st.metrics.get("eval_s", 0.0)
    signalled = tr.signals.received is not None
    if tr.d.world_size > 1:
        shared = torch.tensor([elapsed, float(signalled)], dtype=torch.float64, device=tr.device)
        tdist.all_reduce(shared, op=tdist.ReduceOp.MAX)
        elapsed, signalled = shared[0].item(), bool(shared[1].item())
    return elapsed, train_s, signalled
