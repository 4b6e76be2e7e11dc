"""The training loop: steps until a limit, a signal or a pruner ends it, evaluating, logging and
writing checkpoints on the way; its parts are the other modules of mllm.training."""

from __future__ import annotations

import time

import torch.distributed as tdist

from mllm.runtime.results import TrainResult
from mllm.training.evaluation import evaluate
from mllm.training.report import log_record, progress, result, tell
from mllm.training.saving import last_due, save
from mllm.training.setup import Engine, Records, Training
from mllm.training.state import LoopState
from mllm.training.step import clock, follow_step, take_step


def run(tr: Training, en: Engine, st: LoopState) -> TrainResult:
    """Train from st.step (0, or where last.pt left off) to the end; see docs/training.md."""
    t = tr.cfg.train
    st.start(tr.device)
    st.stop = tr.limits.reason(st.step, st.elapsed_before, st.evals_since_best)
    while st.stop is None:
        # The step: t.grad_accum micro-batches of t.batch_size sequences (a language model's:
        # (batch_size, window) token ids and the same shifted by one as targets), one update.
        step_start, cpu_start = time.perf_counter(), time.process_time()
        lr = tr.scheduler.get_last_lr()[0]  # this step's rate, before the schedule moves on
        grad_norm = take_step(tr, en, st)  # st.step += 1; a signal in it writes last.pt and ends here
        follow_step(tr, en, st, step_start, cpu_start)  # threads and torch.compile, timed on steps

        # The clocks, in seconds: training time over every run (elapsed), the same less the
        # evaluations (train_s). Then the limits: steps, minutes (early stopping is decided below).
        elapsed, train_s, signalled = clock(tr, st)
        st.stop = tr.limits.reason(st.step, elapsed, st.evals_since_best)
        step_end, eval_end = time.perf_counter(), st.metrics.get("eval_s", 0.0)  # a rate leaves evaluations out

        # Evaluation every t.eval_interval steps and at the end: it may end the training here
        # (early stopping, a pruner's "pruned").
        records: Records = []
        improved = False
        if st.step % t.eval_interval == 0 or st.stop:
            record, improved = evaluate(tr, en, st, elapsed)
            records.append(record)
        # Logged every t.log_interval steps, and at the step the training stops at.
        logged = st.step % t.log_interval == 0 or st.stop is not None
        if logged:
            records.insert(0, log_record(en, st, lr, grad_norm, step_end, eval_end))
        st.metrics["elapsed_s"] = elapsed
        st.metrics["tokens"] = st.tokens()  # targets over every run
        tell(tr, records)

        # Checkpoints: best.pt at each new best validation loss; last.pt every interval, every
        # checkpoint_minutes, at the end, and when a signal arrived, which then takes its course.
        if improved:
            save(tr, st, tr.best_url)
        if last_due(t, st, elapsed, signalled):
            save(tr, st, tr.last_url)
            st.saved_at = elapsed
        if logged:
            progress(tr, st, lr, elapsed, train_s)
        if signalled:
            tr.signals.deliver(st.step)  # raises

    if tr.d.world_size > 1:
        tdist.barrier()  # no rank returns before rank 0 has written the checkpoint it names
    return result(tr, en, st)
