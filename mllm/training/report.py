"""What the loop tells its caller: the records of a log step, the progress dict, and the TrainResult at the end."""

from __future__ import annotations

import math

import torch

from mllm.runtime import threads as threading
from mllm.runtime.results import TrainResult
from mllm.training.setup import Engine, Records, Training
from mllm.training.state import LoopState


def log_record(en: Engine, st: LoopState, lr: float, grad_norm: torch.Tensor, step_end: float, eval_end: float) -> dict:
    """The training figures over the log interval that ends at this step (`step_end`, with the
    eval_s of the metrics then, `eval_end`), which restarts here. The tokens' rate is over the
    interval's training seconds, evaluations left out."""
    st.metrics["train_loss"] = (st.loss_sum / st.loss_count).item()
    seconds = step_end - st.mark - eval_end + st.eval_mark
    st.metrics["tokens_per_s"] = (st.tokens_run - st.tokens_mark) / max(seconds, 1e-9)
    st.metrics["mfu"] = st.metrics["tokens_per_s"] * en.flops_per_target / en.peak
    st.loss_sum.zero_()
    st.loss_count, st.mark, st.tokens_mark, st.eval_mark = 0, step_end, st.tokens_run, eval_end
    return {
        "step": st.step,
        "train_loss": st.metrics["train_loss"],
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens_per_s": st.metrics["tokens_per_s"],
        "mfu": st.metrics["mfu"],
    }


def tell(tr: Training, records: Records) -> None:
    if records and tr.hooks.on_metrics and tr.d.master:
        tr.hooks.on_metrics(records)


def progress(tr: Training, st: LoopState, lr: float, elapsed: float, train_s: float) -> None:
    """The progress dict of a log step (rank 0): step of total, clocks, loss, rate."""
    if not (tr.hooks.on_progress and tr.d.master):
        return
    budget_s = tr.limits.budget_s
    # A budget's steps, estimated from the share spent so far (a log line's); its end is budget_s.
    estimate = round(st.step * budget_s / elapsed) if budget_s and elapsed > 0 else None
    tr.hooks.on_progress(
        {
            "step": st.step,
            "total_steps": tr.limits.total_steps or estimate,
            "budget_s": budget_s,
            "epoch": tr.batches.epoch,
            "elapsed_s": elapsed,
            "train_s": train_s,
            "train_loss": st.metrics.get("train_loss"),
            "lr": lr,
            "tokens_per_s": st.metrics.get("tokens_per_s"),
        }
    )


def result(tr: Training, en: Engine, st: LoopState) -> TrainResult:
    """The whole training's figures: one everywhere (the done line, trained.json, MLflow, `runs`)."""
    m, best = st.metrics, st.best
    # Tokens over training seconds, evaluations left out, every resume included.
    train_s = m.get("elapsed_s", 0.0) - m.get("eval_s", 0.0)
    tokens_per_s = m["tokens"] / train_s if m.get("tokens") and train_s > 0 else m.get("tokens_per_s", 0.0)
    muon = tr.cfg.train.optimizer == "muon"
    return TrainResult(
        steps=st.step,
        train_loss=m.get("train_loss"),
        val_loss=m.get("val_loss"),
        best_val_loss=best if math.isfinite(best) else None,
        checkpoint=tr.last_url,
        best_checkpoint=tr.best_url if math.isfinite(best) else None,
        tokens_per_s=tokens_per_s,
        elapsed_s=m.get("elapsed_s", st.elapsed_before),
        stop_reason=st.stop,
        resumed_from_step=st.resumed_from,
        dtype_used=en.precision.dtype,
        dtype_reason=en.precision.reason,
        dtype_probe_ms=en.precision.probe_ms,
        mfu=tokens_per_s * en.flops_per_target / en.peak if tokens_per_s else None,
        peak_flops=en.peak,
        peak_source=en.peak_source,
        compile_used=en.compiling.choice.used,
        compile_reason=en.compiling.choice.reason,
        compile_s=en.compiling.choice.compile_s,
        attention=en.attention,
        muon_precision=tr.optimizer.parts["muon"].ns_reason if muon else "",
        **threading.record(en.threads, st.step, st.resumed_from, tr.limits.total_steps),
    )
