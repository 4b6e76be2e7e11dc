"""Evaluation during training: the validation loss, the best so far, and the stops it decides
(early stopping, a caller's pruner)."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as tdist

from mllm.runtime.checkpoint import BrokenOff, signalled_alone
from mllm.runtime.distributed import Dist, gather
from mllm.training.saving import broken_off
from mllm.training.setup import Engine, Training
from mllm.training.state import LoopState
from mllm.training.step import samples


@torch.no_grad()
def val_loss(model, batches: list[tuple], device, autocast, d: Dist) -> float:
    """Mean loss (nats a target) over the fixed validation batches, each rank scoring its share."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (summed loss, targets)
    for batch in batches[d.rank :: d.world_size]:
        with autocast():
            _, loss, _ = model(*(x.to(device) for x in batch))
        total[0] += loss.double() * samples(batch)
        total[1] += samples(batch)
    if d.world_size > 1:
        tdist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def _guarded_val_loss(tr: Training, en: Engine, st: LoopState) -> float:
    """val_loss, or last.pt written and the signal delivered when one breaks it off."""
    try:
        with tr.signals.breaking(tr.d.world_size == 1):
            return val_loss(en.compiling.evaluator, tr.val_batches, tr.device, en.autocast, tr.d)
    except BrokenOff:
        pass
    except Exception:
        if not signalled_alone(tr.signals, tr.d):
            raise
    broken_off(tr, st, None)  # last.pt written, the signal takes its course: no return


def evaluate(tr: Training, en: Engine, st: LoopState, elapsed: float) -> tuple[dict, bool]:
    """Score the model after st.step: its record and whether it is the best so far. Sets st.stop
    for early stopping, or "pruned" when the caller's on_eval says stop (every rank stops at the
    same step, or the collectives part ways); the seconds count in metrics' eval_s."""
    start = time.perf_counter()
    val = _guarded_val_loss(tr, en, st)
    improved = val < st.best
    st.best, st.evals_since_best = (val, 0) if improved else (st.best, st.evals_since_best + 1)
    st.metrics.update(val_loss=val, best_val_loss=st.best, evals_since_best=st.evals_since_best)
    record = {
        "step": st.step,
        "val_loss": val,
        "val_perplexity": math.exp(min(val, 700.0)),
        "val_bits_per_token": val / math.log(2),
    }
    st.stop = st.stop or tr.limits.reason(st.step, elapsed, st.evals_since_best)
    if tr.hooks.on_eval is not None and not st.stop:
        told = bool(tr.hooks.on_eval(st.step, val)) if tr.d.master else False  # rank 0 asks
        st.stop = "pruned" if any(gather(told, tr.d)) else None
    st.metrics["eval_s"] = st.metrics.get("eval_s", 0.0) + time.perf_counter() - start
    return record, improved
