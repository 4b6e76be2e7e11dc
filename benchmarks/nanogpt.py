"""nanoGPT's anchor as the benchmarks run it, and `python -m mllm.train` run the same way beside it.

The anchor is karpathy/nanoGPT as kept in ../shared/anchors/nanoGPT: its train.py as a subprocess
on ids written in its own format, its model.py imported by path.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REPO, median

ANCHOR = REPO.parent / "shared" / "anchors" / "nanoGPT"


def anchor_or_exit() -> Path:
    if not (ANCHOR / "train.py").is_file() or not (ANCHOR / "model.py").is_file():
        print(f"skipped: nanoGPT not found at {ANCHOR} (the anchors folder lies beside the repo, in ../shared)")
        raise SystemExit(0)
    return ANCHOR


def nanogpt_data(paths: dict, folder: Path, dataset: str = "wp") -> Path:
    """A working folder for nanoGPT's train.py: data/<dataset>/{train,val}.bin, meta.pkl, configurator.py."""
    from mllm.data.vocab import Vocab

    data = folder / "data" / dataset
    data.mkdir(parents=True)
    for split in ("train", "val"):
        np.load(paths[f"{split}_ids"]).astype(np.uint16).tofile(data / f"{split}.bin")
    itos = Vocab.load(paths["vocab"]).itos
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump(
            {"vocab_size": len(itos), "itos": dict(enumerate(itos)), "stoi": {s: i for i, s in enumerate(itos)}}, f
        )
    # train.py exec()s configurator.py from its working directory.
    shutil.copy(ANCHOR / "configurator.py", folder / "configurator.py")
    return folder


def env(threads: int) -> dict:
    """The environment of a training subprocess: `threads` for OpenMP and MKL, the repo importable."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    env.pop("WORLD_SIZE", None)
    return env


def train_nanogpt(workdir: Path, shape: dict, steps: int, threads: int) -> tuple[list[float], list[float], str]:
    """Per-step seconds and losses of nanoGPT's own train.py (its README's CPU command), and its precision."""
    cmd = [
        sys.executable,
        str(ANCHOR / "train.py"),
        str(ANCHOR / "config" / "train_shakespeare_char.py"),
        "--device=cpu",
        "--compile=False",
        "--eval_iters=2",
        "--log_interval=1",
        "--dataset=wp",
        f"--block_size={shape['block_size']}",
        f"--batch_size={shape['batch_size']}",
        f"--n_layer={shape['n_layer']}",
        f"--n_head={shape['n_head']}",
        f"--n_embd={shape['n_embd']}",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--dropout=0.0",
        f"--eval_interval={10 * steps}",
        f"--out_dir={workdir / 'out'}",
    ]
    out = subprocess.run(cmd, cwd=workdir, env=env(threads), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"nanoGPT train.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rows = re.findall(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", out.stdout, re.M)
    return [float(t) / 1000 for _, _, t in rows], [float(loss) for _, loss, _ in rows], "float32"


def run_mllm_train(cfg, config: Path, threads: int, what: str = "mllm.train") -> str:
    """`python -m mllm.train` on `cfg` (saved to `config`) from scratch with `threads`: its stdout."""
    config.write_text(cfg.to_yaml(paths=True))
    out = subprocess.run(
        [sys.executable, "-m", "mllm.train", "--config", str(config), "--no-resume"],
        cwd=REPO,
        env=env(threads),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{what} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def model_module():
    """nanoGPT's model.py, imported by its path."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", ANCHOR / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _NanoAdapter(torch.nn.Module):
    """nanoGPT's GPT with mllm's forward signature, for mllm.lm.evaluate and mllm.lm.generate."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = type(
            "Config", (), {"arch": "gpt", "block_size": model.config.block_size, "vocab_size": model.config.vocab_size}
        )()

    def forward(self, idx, targets=None, state=None):
        if targets is None:  # nanoGPT then returns the last position only
            targets = torch.zeros_like(idx)
        logits, loss = self.model(idx, targets)
        return logits, loss, state


CPU_SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12)


def train_for_minutes(paths: dict, folder: Path, minutes: float, threads: int) -> dict:
    """nanoGPT's README CPU command, its iteration count set to fill the budget (benchmarks.quality)."""
    workdir = nanogpt_data(paths, folder / "nanogpt")

    def run(iters: int, eval_interval: int, timeout: float | None) -> str:
        cmd = [
            sys.executable,
            str(ANCHOR / "train.py"),
            str(ANCHOR / "config" / "train_shakespeare_char.py"),
            "--device=cpu",
            "--compile=False",
            "--eval_iters=20",
            "--log_interval=1",
            "--dataset=wp",
            *[f"--{k}={v}" for k, v in CPU_SHAPE.items()],
            f"--max_iters={iters}",
            f"--lr_decay_iters={iters}",
            "--dropout=0.0",
            f"--eval_interval={eval_interval}",
            "--always_save_checkpoint=True",
            f"--out_dir={workdir / 'out'}",
        ]
        try:
            out = subprocess.run(cmd, cwd=workdir, env=env(threads), capture_output=True, text=True, timeout=timeout)
            return out.stdout
        except subprocess.TimeoutExpired as e:  # the budget's hard stop: its last checkpoint counts
            return e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")

    probe = run(30, 10**6, None)
    iter_s = median([float(t) / 1000 for t in re.findall(r"time ([\d.]+)ms", probe)][10:])
    iters = max(40, int(0.97 * 60 * minutes / iter_s) // 4 * 4)
    t0 = time.perf_counter()
    stdout = run(iters, iters // 4, 60 * minutes * 1.5 + 60)
    wall = time.perf_counter() - t0
    times = [float(t) / 1000 for t in re.findall(r"time ([\d.]+)ms", stdout)]
    nano = model_module()
    state = torch.load(workdir / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    model = nano.GPT(nano.GPTConfig(**state["model_args"]))
    model.load_state_dict(state["model"])
    return {
        "model": _NanoAdapter(model),
        "steps": int(state["iter_num"]),
        "planned_steps": iters,
        "stop": "max_steps",
        "train_s": sum(times),
        "wall_s": wall,
        "tokens_per_step": CPU_SHAPE["batch_size"] * CPU_SHAPE["block_size"],
    }
