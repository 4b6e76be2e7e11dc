"""What a training is made of, built once before its loop: the model and optimizer (`Training`), and
how its steps run on this device (`Engine`: precision, attention, torch.compile, DDP, threads)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from mllm import storage
from mllm.config import RunConfig
from mllm.families.base import build_model, family_of
from mllm.runtime import speed
from mllm.runtime import threads as threading
from mllm.runtime.checkpoint import Signals
from mllm.runtime.choices import choose_attention, choose_precision
from mllm.runtime.compiling import Compiler, compile_key
from mllm.runtime.distributed import Dist
from mllm.runtime.optim import build_optimizer, lr_factor
from mllm.runtime.speed import Precision
from mllm.training.state import Limits, LoopState

Records = list[dict]


@dataclasses.dataclass
class Hooks:
    """What the caller hears (rank 0 only): records at each log or evaluation step, a progress
    dict at each log step, a line for the terminal, and at each evaluation whether to stop there."""

    on_metrics: Callable[[Records], None] | None = None
    on_progress: Callable[[dict], None] | None = None
    on_eval: Callable[[int, float], bool] | None = None  # (step, val loss) -> stop here (a search's pruner)
    notice: Callable[[str], None] = lambda line: None


@dataclasses.dataclass
class Training:
    """The config, the data, the model and its optimizer: what a checkpoint saves and restores."""

    cfg: RunConfig
    d: Dist
    device: torch.device
    vocab: Any
    tokenizer: Any
    carry: dict  # what else a checkpoint of this family carries (a source vocabulary, ...)
    batches: Any  # the family's training batches: next(), state_dict(), rng_state(), epoch
    val_batches: list[tuple]  # the fixed validation batches
    limits: Limits
    raw: torch.nn.Module  # the model itself (not compiled, not DDP-wrapped): what is saved
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    signals: Signals
    hooks: Hooks

    @property
    def last_url(self) -> str:
        return storage.join(self.cfg.paths.checkpoint_dir, "last.pt")

    @property
    def best_url(self) -> str:
        return storage.join(self.cfg.paths.checkpoint_dir, "best.pt")


def build(inputs: tuple, d: Dist, device: torch.device, signals: Signals, hooks: Hooks, st: LoopState) -> Training:
    """Seed, batches, model, optimizer and learning-rate schedule, as a fresh training starts (the
    RNG draws in this order, which a resume then overwrites)."""
    cfg, vocab, tokenizer, train, val, carry = inputs
    t = cfg.train
    torch.manual_seed(t.seed + d.rank)
    family = family_of(cfg)
    batches = family.train_batches(cfg, train, d.rank, d.world_size)
    val_batches = family.val_batches(cfg, val)
    limits = Limits.of(t, batches.batches_per_epoch if t.epochs is not None else None)
    raw = build_model(cfg.model).to(device)
    optimizer = build_optimizer(raw, t, device)
    budget_s = limits.budget_s
    spent = (lambda: st.spent(budget_s)) if budget_s else None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t, limits.total_steps, spent))
    return Training(
        cfg, d, device, vocab, tokenizer, carry, batches, val_batches, limits, raw, optimizer, scheduler, signals, hooks
    )


@dataclasses.dataclass
class Engine:
    """How the steps run here, each chosen by measuring on this machine (mllm.runtime)."""

    model: torch.nn.Module  # what the steps call: the model, compiled and DDP-wrapped as chosen
    compiling: Compiler
    precision: Precision
    autocast: Callable  # () -> a context manager: bf16 autocast, or nothing
    attention: str
    threads: threading.ThreadChooser
    peak: float  # FLOP/s of every rank together, what MFU is measured against
    peak_source: str
    flops_per_target: float
    pin: bool  # pin batches in memory before the copy to a CUDA device


def engine(tr: Training, st: LoopState) -> Engine:
    """Attention kernel, precision (a resumed training keeps its own, in st.metrics), peak,
    torch.compile and DDP, and the thread chooser."""
    d, device, raw, probe = tr.d, tr.device, tr.raw, tr.val_batches[0]
    attention = choose_attention(device, raw, probe, d)
    precision = choose_precision(tr.cfg.train, device, raw, probe, st.metrics, d)
    peak, peak_source = speed.peak_flops(device, precision.dtype)
    flops_per_target = speed.flops_per_target(raw, probe)
    key = compile_key(raw, probe, precision.dtype)
    compiling = Compiler(tr.cfg.train.compile, raw, device, d.world_size, key)
    model = compiling.model
    if d.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(compiling.model, device_ids=[d.local_rank] if device.type == "cuda" else None)
    return Engine(
        model=model,
        compiling=compiling,
        precision=precision,
        autocast=precision.autocast(device),
        attention=attention,
        threads=threading.chooser(device, d.world_size),
        peak=peak * d.world_size,
        peak_source=peak_source,
        flops_per_target=flops_per_target,
        pin=device.type == "cuda",
    )
