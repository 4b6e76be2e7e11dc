"""Each modern small-GPT piece added alone to the default recipe, side by side on War and Peace.

    python -m benchmarks.ablation [--minutes 2 | --steps N] [--threads 2] [--only NAME ...]
                                  [--seeds 1337 ...] [--target LOSS]

Every contender is the `default` recipe (mllm/recipes/default.yaml) as it was before issue 47
took three of these pieces into it (AdamW alone, learned positions, a GELU MLP: `BASE`), with
one change (a piece of mllm.lm.gpt_pieces, or Muon), trained by `python -m mllm.train` for the SAME number of steps with
the same cosine schedule, on the same ids: so the losses compare at matched steps whatever else
runs on the machine, and the step times say what each piece costs. The step count is --steps,
or what the default does in --minutes (a probe of 30 steps). Each run evaluates a fixed set of
validation batches on a fixed schedule (every tenth of the steps; the evaluations are left out of
the training seconds, `train_s` of mllm.train's progress records), which gives the time to a
target loss: the first evaluation at or below it, by default the default recipe's own last
one. Each model is then scored on the whole validation split (mllm.lm.evaluate). torch.compile
is off for every contender (its minutes of compilation would swamp a short budget); the
precision is train.dtype: auto, the default's. The load average is recorded beside each row:
the machine is shared, so the step times are the least reliable figure here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REPO, corpus, header, load, parse_args, run_config, save, table, token_ids
from benchmarks.nanogpt import env

# The default recipe before issue 47, which the pieces are measured against (Muon, when a piece
# turns it on, at the 0.02 the ablation measured; the default now has 0.01).
BASE = {"train.optimizer": "adamw", "model.positions": "learned", "model.mlp": "gelu", "train.muon_lr": 0.02}
# Each piece alone, on top of BASE (the combination is the last row).
PIECES: dict[str, dict] = {
    "default": {},
    "rotary": {"model.positions": "rotary"},
    "rmsnorm": {"model.norm": "rmsnorm"},
    "qk_norm": {"model.qk_norm": True},
    "relu2": {"model.mlp": "relu2"},
    "untied head": {"model.tie_weights": False},
    "zero_init_proj": {"model.zero_init_proj": True},
    "softcap 15": {"model.logit_softcap": 15.0},
    "muon": {"train.optimizer": "muon"},
}
PIECES["all"] = {k: v for piece in PIECES.values() for k, v in piece.items()}
# Measured after the rest (the "all" row above is the nine before them).
PIECES["value embeds"] = {"model.value_embeds": True}
PIECES["residual scalars"] = {"model.residual_scalars": True}
FIXED = {
    "train.compile": False,
    "train.device": "cpu",
    "train.checkpoint_interval": 10**6,
    "train.checkpoint_minutes": None,
    "train.eval_batches": 20,
}


def run(paths: dict, folder: Path, name: str, overrides: dict, threads: int) -> tuple[list[dict], Path]:
    """`python -m mllm.train` with `overrides` on the default recipe; its event records."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    cfg = run_config("default", paths, folder / slug, {**FIXED, **BASE, **overrides})
    folder.mkdir(parents=True, exist_ok=True)
    config, events = folder / f"{slug}.yaml", folder / f"{slug}.jsonl"
    config.write_text(cfg.to_yaml(paths=True))
    out = subprocess.run(
        [sys.executable, "-m", "mllm.train", "--config", str(config), "--no-resume", "--events", str(events)],
        cwd=REPO,
        env=env(threads),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{name}: mllm.train failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in events.read_text().splitlines()], folder / slug


def probe_steps(paths: dict, folder: Path, minutes: float, threads: int) -> tuple[int, float]:
    """How many of the default's steps fit in `minutes` (past its first ten), and the step time."""
    events, _ = run(
        paths,
        folder / "probe",
        "probe",
        {"train.max_steps": 40, "train.log_interval": 10, "train.eval_interval": 10**6},
        threads,
    )
    progress = [e["progress"] for e in events if "progress" in e]
    step_s = (progress[-1]["train_s"] - progress[0]["train_s"]) / (progress[-1]["step"] - progress[0]["step"])
    return max(100, int(60 * minutes / step_s) // 100 * 100), step_s


def step_costs(names: list[str], vocab_size: int, rounds: int, threads: int) -> dict[str, float]:
    """Median ms of a training step (forward, backward, optimizer) of each contender in bf16, timed
    in one process, round-robin, 5 steps a turn: a load that drifts over minutes hits every
    contender alike, which the training runs one after the other cannot promise."""
    import json as _json

    from mllm.families.base import build_model
    from mllm.resolve import apply_overrides, recipe_dict, validate
    from mllm.runtime import speed
    from mllm.runtime.optim import build_optimizer

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    setups = {}
    for name in names:
        data = apply_overrides(
            recipe_dict("default"), [f"{k}={_json.dumps(v)}" for k, v in {**BASE, **PIECES[name]}.items()]
        )
        cfg = validate(data, name)
        model = build_model(cfg.model.model_copy(update={"vocab_size": vocab_size}))
        t = cfg.train
        x = torch.randint(0, vocab_size, (t.batch_size, t.window))
        speed.choose_attention(model, cpu, (x, x))
        setups[name] = (model, build_optimizer(model, t, cpu), x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds + 1):
        for name, (model, opt, x) in setups.items():
            for _ in range(5):
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    _, loss, _ = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if turn:  # the first turn warms up
                    times[name].append(1000 * (time.perf_counter() - t0))
    return {name: float(np.median(ts)) for name, ts in times.items()}


def curve(events: list[dict]) -> list[dict]:
    """[{step, train_s, val_loss}] at each evaluation (the fixed batches), training seconds only."""
    seconds = {e["progress"]["step"]: e["progress"]["train_s"] for e in events if "progress" in e}
    vals = [r for e in events if "metrics" in e for r in e["metrics"] if "val_loss" in r]
    return [{"step": r["step"], "train_s": seconds[r["step"]], "val_loss": r["val_loss"]} for r in vals]


def time_to(points: list[dict], target: float) -> float | None:
    return next((p["train_s"] for p in points if p["val_loss"] <= target), None)


def _args():
    return parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument(
                "--minutes", type=float, default=2.0, help="the default's training time, which sets the steps"
            ),
            p.add_argument("--steps", type=int, help="steps for every contender (instead of --minutes)"),
            p.add_argument("--only", nargs="+", choices=list(PIECES), help="run only these (default first anyway)"),
            p.add_argument("--seeds", nargs="+", type=int, default=[1337], help="train.seed of each run"),
            p.add_argument("--target", type=float, help="the loss for time-to-target (default: the default's last)"),
            p.add_argument(
                "--step-times",
                type=int,
                metavar="ROUNDS",
                help="only time each contender's step, round-robin for ROUNDS turns (no training)",
            ),
        ),
    )


def step_times_only(names: list[str], rounds: int, threads: int, m: dict) -> None:
    """--step-times: each contender's step timed round-robin, no training."""
    ms = step_costs(names, 60, rounds, threads)
    rows = [{"contender": n, "ms_per_step": v, "step_vs_default": v / ms["default"]} for n, v in ms.items()]
    print(
        table(
            rows,
            [
                ("contender", "contender"),
                ("ms_per_step", "median ms a step (bf16)"),
                ("step_vs_default", "/ default's"),
            ],
        )
        + f"\n\nload average now {load()}"
    )
    save(
        "ablation_steps",
        {"machine": m, "threads": threads, "rounds": rounds, "rows": rows, "load_after": load()},
    )


def contender(
    paths: dict, folder: Path, val, name: str, seed: int, steps: int, every: int, threads: int, target: float | None
) -> tuple[dict, float]:
    """One contender trained and scored: its row, and the target (the default's last loss when none
    was given: the default runs first)."""
    from mllm.lm.evaluate import evaluate
    from mllm.runtime.checkpoint import load_checkpoint

    load_before = load()
    t0 = time.perf_counter()
    events, ckpt = run(
        paths,
        folder,
        f"{name}-{seed}",
        {
            **PIECES[name],
            "train.max_steps": steps,
            "train.seed": seed,
            "train.log_interval": 50,
            "train.eval_interval": every,
        },
        threads,
    )
    wall = time.perf_counter() - t0
    result = next(e["result"] for e in events if "result" in e)
    points = curve(events)
    if target is None:
        target = points[-1]["val_loss"]  # the default's, which runs first
    model = load_checkpoint(str(ckpt / "last.pt")).model
    score = evaluate(model, val, model.config.block_size, 64)
    half = next(p for p in points if p["step"] >= steps // 2)
    train_s = points[-1]["train_s"]
    row = {
        "contender": name,
        "seed": seed,
        "steps": result["steps"],
        "train_s": train_s,
        "ms_per_step": 1000 * train_s / result["steps"],
        "tokens_per_s": result["tokens_per_s"],
        "dtype": result["dtype_used"],
        "fixed_val_half": half["val_loss"],
        "fixed_val_end": points[-1]["val_loss"],
        "val_loss": score["loss"],
        "time_to_target": time_to(points, target),
        "curve": points,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": load(),
    }
    print(
        f"{name} (seed {seed}): val loss {row['val_loss']:.4f} (whole split), fixed batches "
        f"{row['fixed_val_half']:.4f} at step {half['step']}, {row['fixed_val_end']:.4f} at {steps}; "
        f"{row['ms_per_step']:.1f} ms a step, {row['tokens_per_s']:,.0f} tok/s, {row['dtype']}; "
        f"load {load_before} -> {row['load_after']}",
        flush=True,
    )
    return row, target


def report(rows: list[dict], target: float) -> None:
    """Each row against the default's mean, and the table."""
    base = [r["val_loss"] for r in rows if r["contender"] == "default"]
    base_ms = [r["ms_per_step"] for r in rows if r["contender"] == "default"]
    for r in rows:
        r["vs_default"] = r["val_loss"] - sum(base) / len(base)
        r["step_vs_default"] = r["ms_per_step"] / (sum(base_ms) / len(base_ms))
    print(f"\ntarget for time-to-target: {target:.4f} (fixed batches)\n")
    print(
        table(
            rows,
            [
                ("contender", "contender"),
                ("seed", "seed"),
                ("steps", "steps"),
                ("train_s", "training s"),
                ("ms_per_step", "ms/step"),
                ("step_vs_default", "step / default's"),
                ("tokens_per_s", "tokens/s"),
                ("fixed_val_half", "fixed-batch val, half"),
                ("fixed_val_end", "fixed-batch val, end"),
                ("val_loss", "val loss (whole split)"),
                ("vs_default", "- default's"),
                ("time_to_target", "s to target"),
                ("load_before", "load before"),
                ("load_after", "load after"),
            ],
        )
    )


def main() -> None:
    args = _args()
    m = header("ablation", args.quick)
    wp = corpus("warandpeace")
    threads = args.threads or torch.get_num_threads()
    names = ["default", *[n for n in (args.only or PIECES) if n != "default"]]
    if args.step_times:
        step_times_only(names, args.step_times, threads, m)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="mllm-bench-ablation-") as tmp:
        folder = Path(tmp)
        paths = token_ids(wp, folder / "wp")
        val = np.load(paths["val_ids"])
        steps, probe_s = (args.steps, None) if args.steps else probe_steps(paths, folder, args.minutes, threads)
        every = max(50, steps // 10 // 50 * 50)
        probed = f" (the default's probe: {probe_s:.3f} s a step)" if probe_s else ""
        print(
            f"{steps} steps for every contender{probed}, an evaluation of 20 fixed batches every {every}; "
            f"{threads} threads\n",
            flush=True,
        )
        target = args.target
        for name in names:
            for seed in args.seeds:
                row, target = contender(paths, folder, val, name, seed, steps, every, threads, target)
                rows.append(row)
    report(rows, target)
    save(
        "ablation",
        {
            "machine": m,
            "steps": steps,
            "eval_every": every,
            "threads": threads,
            "target": target,
            "val_tokens": len(val),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
