"""What MLflow's system metrics monitor costs a training run.

    python -m benchmarks.system_metrics [--quick] [--threads N]

A real `mlflow server` on loopback (tests/servers.py), so the monitor's requests are HTTP as they
would be to a remote one. The smoke recipe's model (1-layer LSTM, hidden 64) on War and Peace,
600 steps (300 with --quick), tracked as the pipeline's train task tracks it (RunTracker,
log_metrics as on_metrics), runs
- without the monitor,
- with `tasks.tracking.system.system_metrics` at its default interval (MLflow's, 10 s),
- with a 1 s interval (ten times the samples: the what-if of a user who wants finer curves),
alternating, a few times each after one warm-up of each; each figure is a median. Two overheads:
from the wall times (monitored against not, noisy by several percent on a shared machine), and
direct: the time the training waits for the monitor (starting it; stopping it, with the last
flush and the one sample a training shorter than an interval gets), against the training loop.
The sampling itself runs in the monitor's thread, off the loop's path.
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

SMOKE = {
    "recipe": "bench-system-metrics",
    "model.arch": "lstm",
    "model.n_embd": 16,
    "model.n_layer": 1,
    "model.hidden_size": 64,
    "model.dropout": 0.0,
    "train.batch_size": 32,
    "train.window": 32,
    "train.sampling": "random",
    "train.optimizer": "adam",
    "train.lr": 3e-3,
    "train.log_interval": 10,
    "train.eval_interval": 100,
    "train.eval_batches": 4,
    "train.checkpoint_interval": 10**9,
    "train.seed": 1337,
}
MODES = {"no monitor": None, "monitor, 10 s": "10", "monitor, 1 s": "1"}


def timed_run(tmp: Path, paths: dict, run_no: int, mode: str, n_steps: int) -> dict:
    """One tracked training in `mode`: its wall time, the time spent starting and stopping the
    monitor, and the system samples the server got."""
    from mllm.train import train
    from tasks.tracking.system import system_metrics
    from tasks.tracking.tracker import RunTracker

    cfg = run_config(None, paths, tmp / f"ckpt-{run_no}", {**SMOKE, "train.max_steps": n_steps})
    root = str(tmp / "storage")
    interval = MODES[mode]
    with RunTracker(cfg, root, run_name=f"{mode}-{run_no}") as run:
        if interval:
            os.environ["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = interval
        t = time.perf_counter()
        block = system_metrics(run.run_id if interval else None, root)
        block.__enter__()
        start_s = time.perf_counter() - t
        c = time.perf_counter()
        result = train(cfg, on_metrics=run.log_metrics, resume=False)
        loop_s = time.perf_counter() - c
        c = time.perf_counter()
        block.__exit__(None, None, None)
        stop_s = time.perf_counter() - c
        train_s = time.perf_counter() - t
    samples = len(run.client.get_metric_history(run.run_id, "system/cpu_utilization_percentage"))
    # On the training's path: starting the monitor, and stopping it (the join, the
    # last flush, and the one sample a training shorter than an interval gets).
    return {
        "mode": mode,
        "train_s": train_s,
        "loop_s": loop_s,
        "on_path_s": start_s + stop_s,
        "samples": samples,
        "loss": result.train_loss,
        "load": load(),
    }


def summarise(got: dict[str, list[dict]], steps: int) -> list[dict]:
    """A row per mode: medians of its runs, and its overheads against no monitor."""
    base = median([r["train_s"] for r in got["no monitor"]])
    rows = []
    for mode, rs in got.items():
        row = {
            "mode": mode,
            "steps": steps,
            "runs": len(rs),
            "train_s": median([r["train_s"] for r in rs]),
            "all_train_s": [round(r["train_s"], 3) for r in rs],
            "samples": median([r["samples"] for r in rs]),
            "loss": rs[0]["loss"],
            "load": max(r["load"] for r in rs),
        }
        row["overhead_pct"] = 100 * (row["train_s"] - base) / base
        row["on_path_s"] = median([r["on_path_s"] for r in rs])
        row["on_path_pct"] = median([100 * r["on_path_s"] / r["loop_s"] for r in rs])
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    one_thread_unless_told(args)
    m = header("system_metrics", args.quick)
    steps, repeats = (300, 2) if args.quick else (600, 3)
    with tracked_war_and_peace("mllm-bench-sysmetrics-") as (tmp, paths):
        runs = itertools.count(1)
        got = alternating(
            MODES,
            lambda mode, n: timed_run(tmp, paths, next(runs), mode, n),
            steps,
            repeats,
            lambda r: f"{r['train_s']:.2f} s, {r['samples']} samples (load {r['load']})",
        )
    rows = summarise(got, steps)
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
                ("on_path_s", "start+stop s"),
                ("on_path_pct", "start+stop % of training"),
                ("samples", "system samples"),
                ("load", "load avg"),
            ],
        )
    )
    same_loss = len({round(r["loss"], 6) for r in rows}) == 1
    print(f"\nsame final train loss in every mode (same seed, same work): {same_loss}")
    save(
        "system_metrics",
        {
            "machine": m,
            "quick": args.quick,
            "steps": steps,
            "repeats": repeats,
            "config": SMOKE,
            "rows": rows,
            "same_loss": same_loss,
            "samples": got,
        },
    )


if __name__ == "__main__":
    main()
