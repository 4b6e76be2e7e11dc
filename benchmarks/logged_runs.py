"""Commands run with their output appended to a log and a time limit, and `python -m mllm.train`
runs read back from their --events file: the plumbing of the GPU check (benchmarks.gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, run_config


def child_env() -> dict[str, str]:
    """This environment with the repo importable and output unbuffered."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def run_logged(cmd: list[str], log: Path, timeout: float, cwd: Path = REPO, env: dict | None = None) -> dict[str, Any]:
    """`cmd` with its output appended to `log`, killed after `timeout` seconds."""
    start = time.monotonic()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}  (at most {timeout:.0f} s)\n")
        f.flush()
        try:
            rc = subprocess.run(
                cmd, cwd=cwd, env=env or child_env(), stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout, 1)
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f.write(f"# exit {rc} after {time.monotonic() - start:.1f} s\n")
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1)}


def read_events(path: Path) -> tuple[list[dict], dict | None]:
    """The metric records of an --events file, each with the training seconds of its step, and the result."""
    records, result, elapsed = [], None, {}
    if path.is_file():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            records += event.get("metrics", [])
            result = event.get("result", result)
            if "progress" in event:
                elapsed[event["progress"]["step"]] = event["progress"]["elapsed_s"]
    for r in records:
        r.setdefault("elapsed_s", elapsed.get(r["step"]))
    return records, result


def paths_of(ids: Path) -> dict[str, str]:
    """The ids `token_ids` wrote in `ids`, as mllm.train's paths."""
    return {k: str(ids / f) for k, f in (("train_ids", "train.npy"), ("val_ids", "val.npy"), ("vocab", "vocab.json"))}


def config_file(recipe: str, ids: Path, ckpt: Path, overrides: dict[str, Any]) -> Path:
    cfg = run_config(recipe, paths_of(ids), ckpt, overrides)
    path = ckpt.parent / f"{ckpt.name}.yaml"
    path.write_text(cfg.to_yaml(paths=True))
    return path


def train_logged(recipe: str, ids: Path, scratch: Path, name: str, overrides: dict, log: Path, timeout: float) -> dict:
    """`python -m mllm.train` on `recipe` with `overrides`, logged to `log`: its run, metric records and result."""
    events = scratch / f"{name}.jsonl"
    config = config_file(recipe, ids, scratch / name, overrides)
    run = run_logged(
        [sys.executable, "-m", "mllm.train", "--config", str(config), "--no-resume", "--events", str(events)],
        log,
        timeout,
    )
    records, result = read_events(events)
    return {**run, "records": records, "result": result}


def flops_per_token(shape: dict, vocab_size: int) -> float:
    """nanoGPT's estimate of a GPT's FLOPs per token at `shape`."""
    from mllm.config import GPTConfig
    from mllm.families.base import build_model

    model = build_model(
        GPTConfig(vocab_size=vocab_size, bias=False, **{k: v for k, v in shape.items() if k != "batch_size"})
    )
    return float(model.flops_per_token(shape["block_size"]))
