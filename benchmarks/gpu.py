"""The GPU check: mllm's CUDA paths and its GPU recipes, in one bounded run on one GPU.

    python -m benchmarks.gpu prepare                 # anywhere with ../shared: ids and nanoGPT into .gpu-check/
    python -m benchmarks.gpu run --out DIR [--budget S] [--device cpu --toy]

`prepare` writes what the GPU machine needs beside the repo (it may have no ../shared and no
network): tiny shakespeare's and War and Peace's character ids as the recipes tokenize them, and
a copy of the nanoGPT anchor with tiny shakespeare in its own format. `run` then takes, in order,
each step bounded so that a slow one cannot eat the rest of `--budget` seconds:

1. tests: `pytest -m gpu tests/mllm/test_gpu.py` (bf16 autocast and fused AdamW against float32,
   compiled against eager, cached decoding against recomputation, exact resume, a checkpoint
   written on the GPU and read by a process that sees no GPU).
2. shakespeare-gpt, the whole recipe (nanoGPT's shakespeare_char: val loss 1.4697 published after
   5,000 iterations), stopped by `train.max_minutes` if it runs longer: val loss, time to 1.47,
   tokens/s, MFU against the spec sheet's dense bf16 peak, `train.dtype: auto`'s choice.
3. nanoGPT against mllm, the same model, batch and optimizer (shakespeare-gpt's: 6/6/384, block
   256, batch 64, dropout 0.2; AdamW), 300 iterations each, both compiled and in bf16: tokens/s and MFU from the
   median step after the first 50, with the same FLOPs per token (nanoGPT's estimate) for both.
4. warandpeace-lstm for what is left (90 s at most, or `--lstm-minutes`; 8 is enough for the
   whole recipe on an H200): steps/s, the loss curve, and the time its full seven epochs would
   take at that rate.

Figures and logs go to DIR (gpu.json, one log per step). `--device cpu
--toy` runs the same code paths at toy sizes on a CPU, to check the script before a GPU is paid for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import CORPORA, REPO, median, token_ids
from benchmarks.logged_runs import child_env, flops_per_token, paths_of, run_logged, train_logged
from benchmarks.nanogpt import ANCHOR, nanogpt_data

WORK = REPO / ".gpu-check"
# Spec-sheet dense bf16 peak of an H100 SXM (and of the H200, the same GH100 compute): 989 TFLOP/s
# (NVIDIA's 1,979 is with 2:4 sparsity). mllm.runtime.speed.GPU_PEAKS holds it and the others.
SIDE_BY_SIDE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2)
TOY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, dropout=0.2)


def prepare() -> None:
    for name, folder, normalize, strip in (
        ("tinyshakespeare", "shakespeare", False, False),
        ("warandpeace", "warandpeace", True, True),
    ):
        if not CORPORA[name].is_file():
            sys.exit(f"error: {CORPORA[name]} not found: prepare reads ../shared/data beside the repo")
        paths = token_ids(CORPORA[name], WORK / folder, normalize=normalize, strip_gutenberg=strip)
        print(f"{name}: {paths['n_train']:,} train and {paths['n_val']:,} val ids, vocabulary {paths['vocab_size']}")
    if not (ANCHOR / "train.py").is_file():
        sys.exit(f"error: nanoGPT not found at {ANCHOR}")
    shutil.rmtree(WORK / "nanoGPT", ignore_errors=True)
    shutil.copytree(ANCHOR, WORK / "nanoGPT", ignore=shutil.ignore_patterns("data", "assets", "*.ipynb"))
    nanogpt_data(paths_of(WORK / "shakespeare"), WORK / "nanoGPT", dataset="shakespeare_char")
    print(
        f"written: {WORK.relative_to(REPO)}/ ({sum(p.stat().st_size for p in WORK.rglob('*') if p.is_file()) / 1e6:.1f} MB)"
    )


def tests(out: Path, timeout: float) -> dict:
    log = out / "tests.log"
    run = run_logged(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "tests/mllm/test_gpu.py",
            "--noconftest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-q",
            "--durations=0",
        ],
        log,
        timeout,
    )
    summary = re.findall(r"^[= ]*(\d+ (?:passed|failed|skipped|error).*?)[= ]*$", log.read_text(), re.M)
    return {**run, "summary": summary[-1] if summary else None}


def shakespeare(out: Path, scratch: Path, timeout: float, device: str, toy: bool, extra: dict) -> dict:
    minutes = min(3.5, max(timeout - 30, 30) / 60)
    overrides = {"train.max_minutes": round(minutes, 2), "train.device": device, **extra}
    if toy:
        overrides.update({f"model.{k}": v for k, v in TOY.items() if k != "batch_size"})
        overrides.update(
            {
                "train.batch_size": TOY["batch_size"],
                "train.window": TOY["block_size"],
                "train.max_steps": 60,
                "train.eval_interval": 20,
                "train.eval_batches": 4,
            }
        )
    got = train_logged(
        "shakespeare-gpt", WORK / "shakespeare", scratch, "shakespeare-gpt", overrides, out / "shakespeare.log", timeout
    )
    vals = [(r["step"], r["val_loss"], r.get("elapsed_s")) for r in got.pop("records") if "val_loss" in r]
    reached = next(((s, e) for s, v, e in vals if v <= 1.47), None)
    best = min(vals, key=lambda v: v[1]) if vals else None
    return {
        **got,
        "overrides": extra,
        "max_minutes": overrides["train.max_minutes"],
        "val_curve": vals,
        "best": {"step": best[0], "val_loss": best[1], "elapsed_s": best[2]} if best else None,
        "reached_1_47": {"step": reached[0], "elapsed_s": reached[1]} if reached else None,
    }


def nanogpt_recipe(out: Path, scratch: Path, timeout: float, device: str, toy: bool) -> dict:
    """nanoGPT's own shakespeare_char recipe, whole, on the same GPU: its evaluations with the
    seconds since start at which each was printed (compilation included, as in its README's 3 minutes)."""
    flags = [f"--device={device}", f"--out_dir={scratch / 'nanogpt-recipe'}"]
    if toy:
        flags += [
            "--compile=False",
            "--dtype=float32",
            "--max_iters=40",
            "--lr_decay_iters=40",
            "--eval_interval=20",
            "--eval_iters=2",
        ] + [f"--{k}={v}" for k, v in TOY.items()]
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *flags]
    start, evals = time.monotonic(), []
    with open(out / "nanogpt_recipe.log", "w") as log:
        log.write(f"$ {' '.join(cmd)}  (at most {timeout:.0f} s)\n")
        proc = subprocess.Popen(
            cmd, cwd=WORK / "nanoGPT", env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            for line in proc.stdout:
                t = time.monotonic() - start
                log.write(f"[{t:7.1f}] {line}")
                if m := re.match(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", line):
                    evals.append((int(m[1]), float(m[2]), float(m[3]), round(t, 1)))
                if t > timeout:
                    proc.kill()
            rc = proc.wait(timeout=30)
        finally:
            proc.kill()
    best = min(evals, key=lambda e: e[2]) if evals else None
    reached = next((e for e in evals if e[2] <= 1.47), None)
    return {
        "rc": rc,
        "wall_s": round(time.monotonic() - start, 1),
        "evals": evals,
        "best": {"step": best[0], "val_loss": best[2], "at_s": best[3]} if best else None,
        "reached_1_47": {"step": reached[0], "at_s": reached[3]} if reached else None,
    }


def side_by_side(out: Path, scratch: Path, timeout: float, device: str, toy: bool) -> dict:
    shape, steps, skip = (TOY, 30, 10) if toy else (SIDE_BY_SIDE, 300, 50)
    log = out / "side_by_side.log"
    ng = WORK / "nanoGPT"
    flags = [
        f"--device={device}",
        "--eval_iters=2",
        "--log_interval=1",
        "--eval_interval=100000",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        f"--out_dir={scratch / 'nanogpt-out'}",
    ]
    flags += [f"--{k}={v}" for k, v in shape.items()]
    if device == "cpu":
        flags += ["--compile=False", "--dtype=float32"]
    overrides = {f"model.{k}": v for k, v in shape.items() if k != "batch_size"}
    overrides.update(
        {
            "train.batch_size": shape["batch_size"],
            "train.window": shape["block_size"],
            "train.max_steps": steps,
            "train.log_interval": 1,
            "train.eval_interval": 100000,
            "train.eval_batches": 2,
            "train.checkpoint_interval": 100000,
            "train.device": device,
            "train.compile": device != "cpu",
            "train.checkpoint_minutes": None,
            "train.optimizer": "adamw",
        }
    )  # nanoGPT's optimizer: the same work a step
    # mllm first: its compilation finds step 2's in inductor's cache, nanoGPT's has none to find.
    ours = train_logged("shakespeare-gpt", WORK / "shakespeare", scratch, "mllm-300", overrides, log, timeout / 2)
    nano = run_logged(
        [sys.executable, "train.py", "config/train_shakespeare_char.py", *flags],
        log,
        max(timeout - ours["wall_s"], 30),
        cwd=ng,
    )
    rows = re.findall(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", log.read_text(), re.M)
    nano["step_s"] = median([float(t) / 1000 for i, _, t in rows if int(i) >= skip]) if len(rows) > skip else None
    nano["loss_last50"] = float(np.mean([float(x) for _, x, _ in rows[-50:]])) if rows else None
    records = [r for r in ours.pop("records") if "tokens_per_s" in r and r["step"] > skip]
    tokens = shape["batch_size"] * shape["block_size"]
    ours["step_s"] = median([tokens / r["tokens_per_s"] for r in records]) if records else None
    ours["loss_last50"] = float(np.mean([r["train_loss"] for r in records[-50:]])) if records else None
    from mllm.data.vocab import Vocab

    fpt = flops_per_token(shape, len(Vocab.load(str(WORK / "shakespeare" / "vocab.json"))))
    import torch

    from mllm.runtime.speed import peak_flops

    peak, source = peak_flops(torch.device(device), "bfloat16" if device != "cpu" else "float32")
    for row in (nano, ours):
        if row.get("step_s"):
            row["tokens_per_s"] = tokens / row["step_s"]
            row["mfu"] = row["tokens_per_s"] * fpt / peak
    return {
        "shape": shape,
        "steps": steps,
        "skipped_first": skip,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_source": source,
        "nanoGPT": nano,
        "mllm": ours,
        "mllm_over_nanoGPT": nano["step_s"] / ours["step_s"] if nano.get("step_s") and ours.get("step_s") else None,
    }


def lstm(out: Path, scratch: Path, timeout: float, device: str, toy: bool, cap_minutes: float) -> dict:
    minutes = min(cap_minutes, max(timeout - 25, 15) / 60)
    # A short run evaluates often enough to draw its curve; the whole recipe keeps its own 1,000.
    overrides = {"train.max_minutes": round(minutes, 2), "train.device": device}
    if cap_minutes <= 2:
        overrides["train.eval_interval"] = 250
    if toy:
        overrides.update(
            {"train.batch_size": 64, "train.epochs": 0.002, "train.eval_interval": 10, "train.eval_batches": 2}
        )
    got = train_logged(
        "warandpeace-lstm", WORK / "warandpeace", scratch, "warandpeace-lstm", overrides, out / "lstm.log", timeout
    )
    records = got.pop("records")
    got["loss_curve"] = [
        (r["step"], r.get("train_loss"), r.get("val_loss"), r["elapsed_s"])
        for r in records
        if "val_loss" in r or r["step"] % 100 == 0
    ]
    res = got.get("result")
    if res and res["elapsed_s"]:
        n_train = len(np.load(WORK / "warandpeace" / "train.npy", mmap_mode="r"))
        full_steps = 7 * math.ceil((n_train - 64) / 1024)  # the recipe: every window start, 7 passes
        got["steps_per_s"] = res["steps"] / res["elapsed_s"]
        got["full_recipe_steps"] = full_steps
        got["full_recipe_s"] = full_steps / got["steps_per_s"]
    return got


STEPS = ("tests", "shakespeare_gpt", "side_by_side", "warandpeace_lstm", "nanogpt_recipe")


def run(
    out: Path, budget: float, device: str, toy: bool, steps: list[str], extra: dict, lstm_minutes: float = 1.5
) -> None:
    import torch

    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"mllm-gpu-check-{os.getpid()}"
    scratch.mkdir(parents=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "budget_s": budget,
    }
    # (step, the most seconds it may take, the seconds kept for it while earlier steps run)
    plan = [
        ("tests", 100, 40),
        ("shakespeare_gpt", 240, 90),
        ("side_by_side", 170, 60),
        ("warandpeace_lstm", 60 * lstm_minutes + 25, 45),
        ("nanogpt_recipe", 200, 120),
    ]
    plan = [p for p in plan if p[0] in steps]
    report["steps"] = [p[0] for p in plan]

    def save() -> None:
        (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    for i, (name, cap, floor) in enumerate(plan):
        left = budget - (time.monotonic() - start) - sum(f for _, _, f in plan[i + 1 :])
        allowed = min(cap, left)
        if allowed < floor * 0.5:
            report[name] = {"skipped": f"{allowed:.0f} s left of the budget"}
            continue
        print(f"[{time.monotonic() - start:5.0f} s] {name}: at most {allowed:.0f} s", flush=True)
        if name == "tests":
            report[name] = tests(out, allowed)
        elif name == "shakespeare_gpt":
            report[name] = shakespeare(out, scratch, allowed, device, toy, extra)
        elif name == "nanogpt_recipe":
            report[name] = nanogpt_recipe(out, scratch, allowed, device, toy)
        elif name == "side_by_side":
            report[name] = side_by_side(out, scratch, allowed, device, toy)
        else:
            report[name] = lstm(out, scratch, allowed, device, toy, lstm_minutes)
        save()
    report["wall_s"] = round(time.monotonic() - start, 1)
    save()
    shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(report, indent=1, default=str)[:6000])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("prepare", help="write .gpu-check/ (ids, nanoGPT) from ../shared")
    r = sub.add_parser("run", help="the four steps, on a GPU")
    r.add_argument("--out", type=Path, required=True, help="folder for gpu.json and the logs")
    r.add_argument("--budget", type=float, default=530, help="seconds for all four steps together")
    r.add_argument("--device", default="cuda", help="cuda, or cpu with --toy to check the script")
    r.add_argument("--toy", action="store_true", help="toy sizes: the same code paths in a minute or two")
    r.add_argument(
        "--steps",
        default=",".join(STEPS[:4]),
        help=f"which steps, comma-separated, run in this order: {', '.join(STEPS)} (default: the first four)",
    )
    r.add_argument(
        "--lstm-minutes",
        type=float,
        default=1.5,
        help="the most minutes of training for warandpeace-lstm (default 1.5; 8 for its whole recipe on an H200)",
    )
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the shakespeare-gpt step's recipe (repeatable; values are YAML)",
    )
    args = p.parse_args()
    if args.what == "prepare":
        prepare()
    else:
        if not (WORK / "nanoGPT" / "train.py").is_file():
            sys.exit(f"error: {WORK} is not prepared: run python -m benchmarks.gpu prepare first")
        import yaml

        unknown = [x for x in args.steps.split(",") if x not in STEPS]
        if unknown:
            sys.exit(f"error: unknown step {unknown[0]!r}: choose from {', '.join(STEPS)}")
        extra = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in args.overrides)}
        if args.lstm_minutes <= 0:
            sys.exit(f"error: --lstm-minutes {args.lstm_minutes:g}: give more than 0 minutes")
        run(args.out, args.budget, args.device, args.toy, args.steps.split(","), extra, args.lstm_minutes)


if __name__ == "__main__":
    main()
