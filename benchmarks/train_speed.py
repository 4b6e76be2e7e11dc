"""Training tokens/s on this CPU, through `mllm.train.train` on real token ids.

    python -m benchmarks.train_speed [--quick] [--threads N]

Three models:
- the reference War and Peace LSTM (warandpeace-lstm: embedding 32, 4x128 LSTM, dropout 0.2,
  windows of 64, batch 1024, Adam),
- GPT at nanoGPT's CPU size (shakespeare_char's "on a MacBook" line: 4 layers, 4 heads, 128 wide,
  block 64, batch 12, dropout 0) on War and Peace,
- shakespeare-gpt (6 layers, 6 heads, 384 wide, block 256, batch 64) on tiny shakespeare, a few
  steps only: enough to say what its 5,000 iterations would take here.

Steady state: the first steps (allocator, thread pool and autograd warm-up) are left out, and
tokens/s is the tokens of the measured steps over their summed step times, taken from the
per-step records `train` hands to on_metrics (log_interval 1). The validation split is cut to a
few windows so the evaluation `train` always runs at its end costs nothing here; what the
recipes' evaluations would cost is measured on its own (eval-mode forward passes of one batch)
and added to the full-run estimates. Each model trains in its default precision (`train.dtype:
auto`, the precision column), and MFU is the median of the measured steps' `mfu` (against this
CPU's measured matrix-multiply peak in that precision, mllm.runtime.speed).
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import corpus, header, hms, load, median, parse_args, run_config, save, table, token_ids
from mllm.families.base import build_model
from mllm.lm.windows import EpochWindows, windows
from mllm.runtime.epochs import load_ids
from mllm.train import train

# Long enough that neither a scheduled eval nor a checkpoint lands inside the measured steps.
QUIET = {
    "train.log_interval": 1,
    "train.eval_interval": 10**9,
    "train.checkpoint_interval": 10**9,
    "train.eval_batches": 1,
}

NANOGPT_CPU = {
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
    "train.weight_decay": 0.1,
    "train.beta2": 0.99,
    "train.grad_clip": 1.0,
}

_runs = itertools.count()  # a fresh checkpoint folder per measurement: nothing to resume from


def short_val(paths: dict, folder: Path, window: int) -> str:
    """A validation split of a few windows (see the module docstring)."""
    path = folder / f"val-short-{window}.npy"
    np.save(path, np.asarray(load_ids(paths["val_ids"])[: window + 4]))
    return str(path)


def measure(
    name: str,
    recipe: str | None,
    paths: dict,
    folder: Path,
    overrides: dict,
    warmup: int,
    steps: int,
    minutes: float | None = None,
    threads: int | None = None,
) -> dict:
    """Steady-state speed of `train` over `steps` steps after `warmup` (or until `minutes` pass)."""
    length = {"train.max_steps": warmup + steps}
    if minutes:
        length["train.max_minutes"] = minutes
    cfg = run_config(recipe, paths, folder / f"ckpt-{next(_runs)}", {**overrides, **QUIET, **length})
    t = cfg.train
    cfg.paths.val_ids = short_val(paths, folder, t.window)
    tokens_per_step = t.batch_size * t.window
    step_s: dict[int, float] = {}
    mfu: dict[int, float] = {}
    loads: list[float] = []

    def on_metrics(records: list[dict]) -> None:
        for r in records:
            if "tokens_per_s" in r:
                step_s[r["step"]] = tokens_per_step / r["tokens_per_s"]
                mfu[r["step"]] = r["mfu"]
                loads.append(load())

    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        t0 = time.perf_counter()
        result = train(cfg, on_metrics=on_metrics, resume=False)
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(default_threads)
    measured = [s for k, s in step_s.items() if k > warmup]
    # The median step: a burst of another job on these cores moves the mean, hardly the median.
    row = {
        "model": name,
        "threads": threads or default_threads,
        "tokens_per_step": tokens_per_step,
        "warmup_steps": warmup,
        "measured_steps": len(measured),
        "first_step_s": step_s.get(1),
        "step_s": median(measured),
        "tokens_per_s": tokens_per_step / median(measured),
        "tokens_per_s_mean": tokens_per_step * len(measured) / sum(measured),
        "wall_s": wall,
        "load": max(loads[warmup:] or loads),
        "config": cfg.to_dict(),
        "precision": result.dtype_used,
        "mfu": median([v for k, v in mfu.items() if k > warmup]),
    }
    print(
        f"  {name}, {row['threads']} threads, {row['precision']}: {row['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{row['mfu']:.1%} ({row['step_s']:.3f} s/step over {len(measured)} steps, load {row['load']})",
        flush=True,
    )
    return row


@torch.no_grad()
def eval_forward_s(recipe: str, paths: dict, folder: Path, repeats: int) -> float:
    """Seconds per eval-mode forward pass of one batch: what each of the recipe's eval batches costs."""
    cfg = run_config(recipe, paths, folder / "ckpt-eval", {})
    model = build_model(cfg.model.model_copy(update={"vocab_size": paths["vocab_size"]})).eval()
    ids = load_ids(paths["val_ids"])
    starts = np.arange(cfg.train.batch_size) * 7 % (len(ids) - cfg.train.window - 1)
    x, y = windows(ids, starts, cfg.train.window)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(x, y)
        times.append(time.perf_counter() - t0)
    return min(times)  # the first pass allocates; later ones are what an eval loop pays


def models(wp_ids: dict, ts_ids: dict, folder: Path, q: bool) -> list[dict]:
    """The three recipes' models timed, the small GPT at each thread count: a row each."""
    rows = []
    lstm = measure(
        "warandpeace-lstm (4x128 LSTM, batch 1024x64)",
        "warandpeace-lstm",
        wp_ids,
        folder,
        {},
        warmup=1,
        steps=1 if q else 3,
    )
    rows.append(lstm)
    # Small models: also on one thread. Two threads on two cores that anything else is using
    # wait on each other at every op, and a small model's ops are all short.
    for threads in sorted({1, torch.get_num_threads()}, reverse=True):
        rows.append(
            measure(
                "nanoGPT CPU (GPT 4x4x128, batch 12x64)",
                None,
                wp_ids,
                folder,
                NANOGPT_CPU,
                warmup=10 if q else 20,
                steps=60 if q else 300,
                minutes=0.25 if q else 0.6,
                threads=threads,
            )
        )
    big = measure(
        "shakespeare-gpt (GPT 6x6x384, batch 64x256)",
        "shakespeare-gpt",
        ts_ids,
        folder,
        {},
        warmup=1,
        steps=1 if q else 2,
    )
    rows.append(big)
    return rows


def full_recipes(lstm: dict, big: dict, wp_ids: dict, ts_ids: dict, folder: Path, q: bool) -> list[dict]:
    """What the full recipes would take here: their training steps plus their evaluations."""
    train_wp = load_ids(wp_ids["train_ids"])
    lstm_steps = math.ceil(7 * EpochWindows(train_wp, 64, 1024, 1, 1337).batches_per_epoch)
    estimates = []
    for row, recipe, ids, steps, published in (
        (lstm, "warandpeace-lstm", wp_ids, lstm_steps, "37 min on a Quadro RTX 4000"),
        (big, "shakespeare-gpt", ts_ids, 5000, "about 3 min on an A100"),
    ):
        t = run_config(recipe, ids, folder / "unused", {}).train
        fwd = eval_forward_s(recipe, ids, folder, 1 if q else 2)
        evals = steps // t.eval_interval + (steps % t.eval_interval > 0)  # and one at the end
        train_s, eval_s = steps * row["step_s"], evals * t.eval_batches * fwd
        estimates.append(
            {
                "recipe": recipe,
                "steps": steps,
                "step_s": row["step_s"],
                "evals": evals,
                "eval_batches": t.eval_batches,
                "eval_forward_s": fwd,
                "train_s": train_s,
                "eval_s": eval_s,
                "total_s": train_s + eval_s,
                "total": hms(train_s + eval_s),
                "published": published,
                "load": load(),
            }
        )
    return estimates


def report(rows: list[dict], estimates: list[dict]) -> None:
    print()
    print(
        table(
            rows,
            [
                ("model", "model"),
                ("threads", "threads"),
                ("tokens_per_step", "tokens/step"),
                ("measured_steps", "steps timed"),
                ("precision", "precision"),
                ("step_s", "s/step (median)"),
                ("tokens_per_s", "tokens/s (median step)"),
                ("mfu", "MFU"),
                ("first_step_s", "first step s"),
                ("load", "load avg"),
            ],
        )
    )
    print()
    print(
        table(
            estimates,
            [
                ("recipe", "full recipe"),
                ("steps", "steps"),
                ("step_s", "s/step"),
                ("evals", "evals"),
                ("eval_batches", "batches/eval"),
                ("eval_forward_s", "s/eval batch"),
                ("total", "estimate here"),
                ("published", "published"),
                ("load", "load avg"),
            ],
        )
    )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    m = header("train_speed", args.quick)
    wp, shakespeare = corpus("warandpeace"), corpus("tinyshakespeare")
    q = args.quick
    with tempfile.TemporaryDirectory(prefix="mllm-bench-train-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        wp_ids = token_ids(wp, folder / "wp")
        ts_ids = token_ids(shakespeare, folder / "ts", normalize=False, strip_gutenberg=False)
        print(
            f"tokenized War and Peace ({wp_ids['n_train']:,} train tokens, vocabulary {wp_ids['vocab_size']}) "
            f"and tiny shakespeare ({ts_ids['n_train']:,}, {ts_ids['vocab_size']}) in "
            f"{time.perf_counter() - t0:.1f} s\n",
            flush=True,
        )

        rows = models(wp_ids, ts_ids, folder, q)
        estimates = full_recipes(rows[0], rows[-1], wp_ids, ts_ids, folder, q)
    report(rows, estimates)
    save("train_speed", {"machine": m, "quick": q, "models": rows, "full_recipe_estimates": estimates})


if __name__ == "__main__":
    main()
