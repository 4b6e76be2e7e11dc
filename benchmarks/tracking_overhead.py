"""What logging metrics to an MLflow server costs a training run.

    python -m benchmarks.tracking_overhead [--quick] [--threads N]

A real `mlflow server` on loopback (tests/servers.py: SQLite backend, artifacts through the
server, so every call is HTTP as it would be to a remote one). The same training run, GPT at
nanoGPT's CPU size on War and Peace for 200 steps (100 with --quick), log_interval 10 and a
validation eval every 100 steps, runs
- untracked (on_metrics=None),
- tracked: inside `RunTracker`, with the train task's own on_metrics
  (`RunTracker.metrics_after_resume`): synchronous log_batch requests, at most one every
  MLLM_METRICS_EVERY_S seconds (default 2) but at once for an evaluation or a checkpoint's step,
- tracked, every log step: the same with MLLM_METRICS_EVERY_S=0, one request per log step (what
  the train task did before the requests were paced),
- tracked with MLflow's asynchronous logging (what-if: the same log_metrics with its client's
  log_batch(synchronous=False), flushed when training returns; the flush counts),
alternating, a few times each, after one warm-up run of each; each figure is the median. The
overhead is given twice: from the wall times (tracked against untracked, noisy by a few percent
on a shared machine) and from the time spent inside on_metrics (direct, what logging cost). Same seed,
same data, same thread count, a fresh checkpoint folder per run. The training wall time is what
the overhead is measured on; creating and closing the MLflow run (params, config.yaml, tags) is a
fixed cost per run, reported on its own.

One thread by default: the figure is a ratio of a few percent, and two threads on two cores that
anything else touches make a small model's step time jump tenfold from one moment to the next.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from benchmarks.common import (
    alternating,
    header,
    load,
    median,
    one_thread_unless_told,
    parse_args,
    run_config,
    save,
    table,
    tracked_war_and_peace,
)

GPT = {
    "recipe": "bench-tracking",
    "model.arch": "gpt",
    "model.n_layer": 4,
    "model.n_head": 4,
    "model.n_embd": 128,
    "model.block_size": 64,
    "model.dropout": 0.0,
    "model.bias": False,
    "train.batch_size": 12,
    "train.window": 64,
    "train.sampling": "random",
    "train.optimizer": "adamw",
    "train.lr": 1e-3,
    "train.grad_clip": 1.0,
    "train.log_interval": 10,
    "train.eval_interval": 100,
    "train.eval_batches": 4,
    "train.checkpoint_interval": 10**9,
    "train.seed": 1337,
}
MODES = ("untracked", "tracked", "tracked, every log step", "tracked, async")


class _AsyncLogging:
    """The tracker's client with log_batch made asynchronous (the what-if variant)."""

    def __init__(self, client):
        self.client, self.pending = client, []

    def log_batch(self, run_id, **kw):
        self.pending.append(self.client.log_batch(run_id, synchronous=False, **kw))

    def flush(self) -> None:
        for op in self.pending:
            op.wait()


def timed_run(tmp: Path, paths: dict, run_no: int, mode: str, n_steps: int) -> dict:
    """One training in `mode`: its wall time and, tracked, the time spent in on_metrics and in
    starting and closing the MLflow run."""
    from mllm.train import train
    from tasks.tracking.tracker import RunTracker

    cfg = run_config(None, paths, tmp / f"ckpt-{run_no}", {**GPT, "train.max_steps": n_steps})
    calls: list[float] = []
    if mode == "untracked":
        t = time.perf_counter()
        result = train(cfg, resume=False)
        return {"mode": mode, "train_s": time.perf_counter() - t, "loss": result.train_loss, "load": load()}
    t = time.perf_counter()
    with RunTracker(cfg, str(tmp / "storage"), run_name=f"{mode}-{run_no}") as run:
        setup_s = time.perf_counter() - t
        os.environ["MLLM_METRICS_EVERY_S"] = "2" if mode == "tracked" else "0"
        held = run.metrics_after_resume()  # (it reads the run's history: before the shim)
        shim = _AsyncLogging(run.client) if mode == "tracked, async" else None
        if shim:
            run.client = shim

        def on_metrics(records):
            c = time.perf_counter()
            held(records)
            calls.append(time.perf_counter() - c)

        t = time.perf_counter()
        result = train(cfg, on_metrics=on_metrics, resume=False)
        c = time.perf_counter()
        held.flush()
        calls.append(time.perf_counter() - c)
        if shim:
            shim.flush()
            run.client = shim.client
        train_s = time.perf_counter() - t
        t = time.perf_counter()
    logged = run.client.get_metric_history(run.run_id, "train_loss")
    return {
        "mode": mode,
        "train_s": train_s,
        "setup_s": setup_s,
        "close_s": time.perf_counter() - t,
        "calls": len(calls),
        "call_ms": 1000 * median(calls),
        "logging_s": sum(calls),
        "logged": len(logged),
        "loss": result.train_loss,
        "load": load(),
    }


def summarise(samples: dict[str, list[dict]], steps: int) -> list[dict]:
    """A row per mode: medians of its runs, and its overheads against the untracked run."""
    base = median([r["train_s"] for r in samples["untracked"]])
    rows = []
    for mode, rs in samples.items():
        row = {
            "mode": mode,
            "steps": steps,
            "runs": len(rs),
            "train_s": median([r["train_s"] for r in rs]),
            "all_train_s": [round(r["train_s"], 3) for r in rs],
            "loss": rs[0]["loss"],
            "load": max(r["load"] for r in rs),
        }
        row["overhead_pct"] = 100 * (row["train_s"] - base) / base
        if mode != "untracked":
            # The time on_metrics itself took: the overhead measured directly, free of the noise
            # between two runs' wall times.
            logging_pct = median([100 * r["logging_s"] / (r["train_s"] - r["logging_s"]) for r in rs])
            row.update(
                calls=rs[0]["calls"],
                call_ms=median([r["call_ms"] for r in rs]),
                logging_pct=logging_pct,
                logged=rs[0]["logged"],
                setup_s=median([r["setup_s"] for r in rs]),
                close_s=median([r["close_s"] for r in rs]),
            )
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    one_thread_unless_told(args)
    m = header("tracking_overhead", args.quick)
    steps, repeats = (100, 2) if args.quick else (200, 3)
    with tracked_war_and_peace("mllm-bench-tracking-") as (tmp, paths):
        runs = itertools.count(1)
        samples = alternating(
            MODES,
            lambda mode, n: timed_run(tmp, paths, next(runs), mode, n),
            steps,
            repeats,
            lambda r: f"{r['train_s']:.2f} s (load {r['load']})",
        )
    rows = summarise(samples, steps)
    same_loss = len({round(r["loss"], 6) for r in rows}) == 1

    print()
    print(
        table(
            rows,
            [
                ("mode", "run"),
                ("steps", "steps"),
                ("runs", "runs"),
                ("train_s", "train s (median)"),
                ("overhead_pct", "overhead % (wall)"),
                ("logging_pct", "overhead % (in on_metrics)"),
                ("calls", "log calls"),
                ("call_ms", "ms/call"),
                ("logged", "train_loss points on server"),
                ("setup_s", "run start s"),
                ("close_s", "run end s"),
                ("load", "load avg"),
            ],
        )
    )
    print(f"\nsame final train loss in every mode (same seed, same work): {same_loss}")
    save(
        "tracking_overhead",
        {
            "machine": m,
            "quick": args.quick,
            "steps": steps,
            "repeats": repeats,
            "config": GPT,
            "rows": rows,
            "same_loss": same_loss,
            "samples": samples,
        },
    )


if __name__ == "__main__":
    main()
