"""The training loop, and `python -m mllm.train --config run.yaml`.

nanoGPT's train.py, as a function: AdamW (fused), or Muon with AdamW (mllm.runtime.optim), linear warmup
then cosine decay, gradient clipping and accumulation, bf16 autocast where it is faster
(mllm.runtime.speed), optional torch.compile, DDP under torchrun. Checkpoints hold the full state (model, optimizer, scheduler,
step, RNG states, data position), so a run stopped at any checkpoint resumes to the same weights
it would have reached. last.pt is written every `checkpoint_interval` steps, every
`checkpoint_minutes` of training, at the end, and when SIGINT or SIGTERM arrives (of the last
finished step, before the signal takes its usual course; a one-process training drops the
forward and backward or the evaluation it is in, under DDP the ranks finish their step), so an
interrupt, `docker stop` or a spot reclaim loses no finished step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Callable

import torch
import torch.distributed as tdist

from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.families.base import build_model, family_of, load_inputs
from mllm.resolve import apply_overrides, load_file, validate
from mllm.runtime import speed
from mllm.runtime import threads as threading
from mllm.runtime.checkpoint import (
    BrokenOff,
    Signals,
    check_model,
    check_vocab,
    read_checkpoint,
    rewind,
    save_checkpoint,
    signalled_alone,
    step_position,
)
from mllm.runtime.choices import choose_attention, choose_precision
from mllm.runtime.compiling import Compiler, compile_key
from mllm.runtime.devices import resolve_device
from mllm.runtime.distributed import Dist, gather, join, rng_state, set_rng_state
from mllm.runtime.events import event_log, print_records
from mllm.runtime.optim import build_optimizer, lr_factor
from mllm.runtime.results import TrainResult
from mllm.settings import settings

Records = list[dict]


def _samples(batch: tuple) -> int:
    """What a batch teaches: its targets (tokens of a window, centre words, target tokens of
    pairs, whose padding is -1)."""
    return int((batch[-1] >= 0).sum())


@torch.no_grad()
def _val_loss(model, batches: list[tuple], device, autocast, d: Dist) -> float:
    """Mean loss over the fixed validation batches, each rank scoring its share."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches[d.rank :: d.world_size]:
        with autocast():
            _, loss, _ = model(*(x.to(device) for x in batch))
        total[0] += loss.double() * _samples(batch)
        total[1] += _samples(batch)
    if d.world_size > 1:
        tdist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def train(
    cfg: RunConfig,
    on_metrics: Callable[[Records], None] | None = None,
    on_progress: Callable[[dict], None] | None = None,
    resume: bool = True,
    on_eval: Callable[[int, float], bool] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train per `cfg` (its paths section says where inputs and checkpoints are); see module doc.

    on_metrics gets one list of records per log or eval step; on_progress a dict per log step;
    on_notice a line for the terminal (a resume, a change of threads, a busy machine).
    on_eval gets (step, val loss) at each evaluation and answers whether to stop there: the
    training then ends with stop_reason "pruned", its checkpoint written (a search's pruner).
    Under DDP only rank 0 calls them and writes checkpoints.
    """
    cfg, vocab, tokenizer, train, val, carry = load_inputs(cfg)
    t = cfg.train
    d, device = join(resolve_device(t.device))
    signals, threads_before = Signals(), torch.get_num_threads()
    try:
        return _run(
            cfg,
            vocab,
            tokenizer,
            train,
            val,
            carry,
            d,
            device,
            on_metrics,
            on_progress,
            resume,
            signals,
            on_eval,
            on_notice if d.master and on_notice else lambda line: None,
        )
    finally:
        signals.restore()
        torch.set_num_threads(threads_before)  # what runs next in this process (evaluation) starts as it was
        if d.owns_group:
            tdist.destroy_process_group()


def _run(
    cfg, vocab, tokenizer, train, val, carry, d, device, on_metrics, on_progress, resume, signals, on_eval, notice
) -> TrainResult:
    t = cfg.train
    last_url = storage.join(cfg.paths.checkpoint_dir, "last.pt")
    best_url = storage.join(cfg.paths.checkpoint_dir, "best.pt")
    torch.manual_seed(t.seed + d.rank)
    family = family_of(cfg)
    batches = family.train_batches(cfg, train, d.rank, d.world_size)
    val_batches = family.val_batches(cfg, val)
    if t.max_steps is not None:
        total_steps, end_reason = t.max_steps, "max_steps"
    elif t.epochs is not None:
        total_steps, end_reason = math.ceil(t.epochs * batches.batches_per_epoch / t.grad_accum), "epochs"
    else:
        total_steps, end_reason = None, "max_minutes"
    # Minutes alone: the schedule follows the clock, the share of the budget spent (evaluations
    # in), so it runs out when the minutes do, however fast this machine's steps turn out.
    budget_s = 60 * t.max_minutes if total_steps is None and t.max_minutes is not None else None
    step, elapsed_before = 0, 0.0
    metrics: dict[str, float] = {}  # the training's clock among them (elapsed_s), kept in checkpoints

    def spent() -> float:
        return min(1.0, metrics.get("elapsed_s", 0.0) / budget_s)

    raw = build_model(cfg.model).to(device)
    optimizer = build_optimizer(raw, t, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t, total_steps, spent if budget_s else None))
    if resume and storage.exists(last_url):
        state = read_checkpoint(last_url, "cpu")
        check_vocab(state, vocab, last_url)
        check_model(state["config"], cfg, last_url)
        saved_optimizer = state["config"].get("train", {}).get("optimizer", "adamw")
        if (saved_optimizer == "muon") != (t.optimizer == "muon"):
            raise UserError(
                f"checkpoint {last_url} was trained with train.optimizer {saved_optimizer}, this config "
                f"{t.optimizer}: its optimizer state does not carry over; use another checkpoint_dir "
                "or --no-resume"
            )
        raw.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
        metrics = {k: float(v) for k, v in state.get("metrics", {}).items()}
        elapsed_before = metrics.get("elapsed_s", 0.0)
        # Last: building the model and optimizer above drew from the RNG.
        set_rng_state(state.get("rng", {}), batches, state.get("data_state", {}), device, d)
        del state
        notice(
            f"resumed from {last_url}: step {step} of {total_steps or '?'}"
            + (f" ({elapsed_before / 60:.1f} of {t.max_minutes:g} minutes trained)" if budget_s else "")
        )
    resumed_from, tokens_before, eval_before = step, metrics.get("tokens"), metrics.get("eval_s", 0.0)
    if len(set(gather(step, d))) > 1:
        raise UserError(
            f"the ranks found different checkpoints in {cfg.paths.checkpoint_dir}: "
            "it must be storage that every rank reads (a shared folder or object storage)"
        )
    best = metrics.get("best_val_loss", math.inf)
    evals_since_best = int(metrics.get("evals_since_best", 0))

    attention = choose_attention(device, raw, val_batches[0], d)
    precision = choose_precision(t, device, raw, val_batches[0], metrics, d)
    peak, peak_source = speed.peak_flops(device, precision.dtype)
    peak *= d.world_size
    flops_per_target = speed.flops_per_target(raw, val_batches[0])
    compiling = Compiler(t.compile, raw, device, d.world_size, compile_key(raw, val_batches[0], precision.dtype))
    model = compiling.model
    if d.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(compiling.model, device_ids=[d.local_rank] if device.type == "cuda" else None)
    autocast = precision.autocast(device)
    pin = device.type == "cuda"
    threads = threading.chooser(device, d.world_size)

    def limit_reason(step: int, elapsed: float) -> str | None:
        if total_steps is not None and step >= total_steps:
            return end_reason
        if t.max_minutes is not None and elapsed >= 60 * t.max_minutes:
            return "max_minutes"
        if t.early_stopping_patience and evals_since_best >= t.early_stopping_patience:
            return "early_stopping"
        return None

    def save(url: str) -> None:
        rng = rng_state(batches, device, d)  # a collective: every rank takes part
        if not d.master:
            return
        save_checkpoint(
            url,
            {
                "model": raw.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng": rng,
                "config": cfg.to_dict(),
                "vocab": vocab.to_json(),
                "vocab_digest": vocab.digest,
                "tokenizer": tokenizer.to_json(),
                "metrics": {k: float(v) for k, v in metrics.items()},
                "data_state": batches.state_dict(),
                **carry,
            },
        )

    t0 = time.perf_counter()
    stop = limit_reason(step, elapsed_before)
    loss_sum = torch.zeros((), device=device)
    loss_count, tokens_run, mark, tokens_mark, eval_mark = 0, 0, t0, 0, eval_before
    saved_at = elapsed_before  # training seconds when last.pt was last written

    def broken_off(where: tuple | None) -> None:
        """A signal broke off a step's forward and backward or an evaluation (Signals.breaking),
        or failed it: one sent to the whole process group (`timeout`, a batch scheduler, Ctrl-C at
        a terminal) also ends the C++ compiler that inductor waits for. The work is lost, not the
        training: last.pt holds the last finished step (a broken step's batches are drawn again on
        resume), then the signal takes its course."""
        if where is not None:
            rewind(batches, where, device)
        optimizer.zero_grad(set_to_none=True)
        save(last_url)
        signals.deliver(step)

    while stop is None:
        step_start, cpu_start = time.perf_counter(), time.process_time()
        lr = scheduler.get_last_lr()[0]
        where = step_position(batches, device) if d.world_size == 1 else None
        try:
            with signals.breaking(d.world_size == 1):
                for micro in range(t.grad_accum):
                    batch = batches.next()
                    tokens_run += _samples(batch) * d.world_size  # each rank's batch is as large, near enough
                    if pin:
                        batch = [x.pin_memory() for x in batch]
                    batch = [x.to(device, non_blocking=pin) for x in batch]
                    if d.world_size > 1:
                        # Average gradients across ranks once per step, not after every micro-batch.
                        model.require_backward_grad_sync = micro == t.grad_accum - 1
                    with autocast():
                        _, loss, _ = model(*batch)
                    (loss / t.grad_accum).backward()
                    loss_sum += loss.detach()
                    loss_count += 1
        except BrokenOff:
            pass
        except Exception:
            if not signalled_alone(signals, d):
                raise
        else:
            where = None
        if where is not None:  # out of the except block: the signal's course is no follow-up of an error
            broken_off(where)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), t.grad_clip or math.inf)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if compiling.deciding and not threads.measuring:  # threads first: compile's steps are timed at their count
            now = time.perf_counter()
            model = compiling.after_step(
                now - step_start,
                total_steps - step if total_steps is not None else None,
                60 * t.max_minutes - (elapsed_before + now - t0) if t.max_minutes else None,
            )
            threads.total.add(now - step_start, time.process_time() - cpu_start, threads.threads)
        elif said := threading.follow(threads, time.perf_counter() - step_start, time.process_time() - cpu_start):
            notice(said)

        elapsed = elapsed_before + time.perf_counter() - t0
        # The training seconds up to this step with the evaluations before it left out (a time
        # to a loss should not depend on how often the loss was looked at).
        train_s = elapsed - metrics.get("eval_s", 0.0)
        signalled = signals.received is not None
        if d.world_size > 1:
            # Clocks and signals differ between ranks; every rank takes the latest clock and any
            # rank's signal, or they would part ways (a checkpoint is a collective).
            shared = torch.tensor([elapsed, float(signalled)], dtype=torch.float64, device=device)
            tdist.all_reduce(shared, op=tdist.ReduceOp.MAX)
            elapsed, signalled = shared[0].item(), bool(shared[1].item())
        stop = limit_reason(step, elapsed)
        records: Records = []
        step_end, eval_end = time.perf_counter(), metrics.get("eval_s", 0.0)  # the tokens' rate leaves evaluations out
        improved = False
        if step % t.eval_interval == 0 or stop:
            eval_start = time.perf_counter()
            try:
                with signals.breaking(d.world_size == 1):
                    val = _val_loss(compiling.evaluator, val_batches, device, autocast, d)
            except BrokenOff:
                val = None
            except Exception:
                if not signalled_alone(signals, d):
                    raise
                val = None
            if val is None:
                broken_off(None)
            improved = val < best
            best, evals_since_best = (val, 0) if improved else (best, evals_since_best + 1)
            metrics.update(val_loss=val, best_val_loss=best, evals_since_best=evals_since_best)
            records.append(
                {
                    "step": step,
                    "val_loss": val,
                    "val_perplexity": math.exp(min(val, 700.0)),
                    "val_bits_per_token": val / math.log(2),
                }
            )
            stop = stop or limit_reason(step, elapsed)
            if on_eval is not None and not stop:
                # Rank 0 asks; every rank stops at the same step, or the collectives part ways.
                told = bool(on_eval(step, val)) if d.master else False
                stop = "pruned" if any(gather(told, d)) else None
            metrics["eval_s"] = metrics.get("eval_s", 0.0) + time.perf_counter() - eval_start
        # After the evaluation, which may end the training here (pruned, early stopping): a step the
        # training stops at is logged, whether or not a log interval falls there.
        if step % t.log_interval == 0 or stop:
            metrics["train_loss"] = (loss_sum / loss_count).item()
            # Tokens over training seconds, evaluations left out: the result's figure, over the interval.
            metrics["tokens_per_s"] = (tokens_run - tokens_mark) / max(step_end - mark - eval_end + eval_mark, 1e-9)
            metrics["mfu"] = metrics["tokens_per_s"] * flops_per_target / peak
            records.insert(
                0,
                {
                    "step": step,
                    "train_loss": metrics["train_loss"],
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": metrics["tokens_per_s"],
                    "mfu": metrics["mfu"],
                },
            )
            loss_sum.zero_()
            loss_count, mark, tokens_mark, eval_mark = 0, step_end, tokens_run, eval_end
        metrics["elapsed_s"] = elapsed
        # Tokens trained over every run of this training (a checkpoint from before they were
        # counted: its steps at this run's tokens a step).
        metrics["tokens"] = (
            tokens_before if tokens_before is not None else resumed_from * tokens_run / (step - resumed_from)
        ) + tokens_run
        if records and on_metrics and d.master:
            on_metrics(records)
        if improved:
            save(best_url)
        timed = t.checkpoint_minutes is not None and elapsed - saved_at >= 60 * t.checkpoint_minutes
        if step % t.checkpoint_interval == 0 or stop or timed or signalled:
            save(last_url)
            saved_at = elapsed
        if (step % t.log_interval == 0 or stop) and on_progress and d.master:
            # A budget's steps, estimated from the share spent so far (a log line's); its end is budget_s.
            estimate = round(step * budget_s / elapsed) if budget_s and elapsed > 0 else None
            on_progress(
                {
                    "step": step,
                    "total_steps": total_steps or estimate,
                    "budget_s": budget_s,
                    "epoch": batches.epoch,
                    "elapsed_s": elapsed,
                    "train_s": train_s,
                    "train_loss": metrics.get("train_loss"),
                    "lr": lr,
                    "tokens_per_s": metrics.get("tokens_per_s"),
                }
            )
        if signalled:
            signals.deliver(step)

    if d.world_size > 1:
        tdist.barrier()  # no rank returns before rank 0 has written the checkpoint it names
    # One figure everywhere (the done line, trained.json, MLflow, `runs`): the whole training's
    # tokens over its training seconds, evaluations left out, every resume included.
    train_s = metrics.get("elapsed_s", 0.0) - metrics.get("eval_s", 0.0)
    tokens_per_s = (
        metrics["tokens"] / train_s if metrics.get("tokens") and train_s > 0 else metrics.get("tokens_per_s", 0.0)
    )
    return TrainResult(
        steps=step,
        train_loss=metrics.get("train_loss"),
        val_loss=metrics.get("val_loss"),
        best_val_loss=best if math.isfinite(best) else None,
        checkpoint=last_url,
        best_checkpoint=best_url if math.isfinite(best) else None,
        tokens_per_s=tokens_per_s,
        elapsed_s=metrics.get("elapsed_s", elapsed_before),
        stop_reason=stop,
        resumed_from_step=resumed_from,
        dtype_used=precision.dtype,
        dtype_reason=precision.reason,
        dtype_probe_ms=precision.probe_ms,
        mfu=tokens_per_s * flops_per_target / peak if tokens_per_s else None,
        peak_flops=peak,
        peak_source=peak_source,
        compile_used=compiling.choice.used,
        compile_reason=compiling.choice.reason,
        compile_s=compiling.choice.compile_s,
        attention=attention,
        muon_precision=optimizer.parts["muon"].ns_reason if t.optimizer == "muon" else "",
        **threading.record(threads, step, resumed_from, total_steps),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mllm.train",
        description="Train a model of any family from its data on disk (no Prefect, no MLflow). Writes "
        "{paths.checkpoint_dir}/last.pt (full state, resumable) and best.pt (best validation loss).",
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE.yaml",
        help="a RunConfig as YAML (a recipe's sections plus a paths section: train_ids, "
        "val_ids, vocab, optional tokenizer, checkpoint_dir)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set train.lr=3e-4 (repeatable; values are YAML)",
    )
    parser.add_argument(
        "--no-resume",
        action="store_true",
        help="start from scratch even if checkpoint_dir holds a last.pt (it is overwritten)",
    )
    parser.add_argument(
        "--events",
        metavar="FILE.jsonl",
        help="also append metrics, progress and the result to this local file, one JSON "
        "object a line (how the pipeline follows a torchrun job)",
    )
    args = parser.parse_args(argv)
    try:
        data = apply_overrides(load_file(args.config), args.overrides)
        cfg = validate(data, args.config if not args.overrides else f"{args.config} with --set")
        if cfg.paths is None:
            raise UserError(
                f"{args.config} has no paths section: add paths with train_ids, val_ids, vocab and checkpoint_dir"
            )
        with event_log(args.events) as emit:

            def on_metrics(records: Records) -> None:
                print_records(records)
                emit({"metrics": records})

            result = train(
                cfg,
                on_metrics=on_metrics,
                on_progress=lambda p: emit({"progress": p}),
                resume=not args.no_resume,
                on_notice=lambda line: print(line, flush=True),
            )
            emit({"result": dataclasses.asdict(result)})
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "error: interrupted: last.pt holds the last finished step; run the same command to resume", file=sys.stderr
        )
        return 130
    if settings().rank == 0:
        print(result.done_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
