"""How fast this machine is for a model: the precision to train in, the attention kernel, and the
peak FLOP/s that MFU is measured against, each measured once per machine and model shape and cached
in `speed.json` (docs/speed.md says how each is decided and why)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from mllm.runtime.machine import cpu_env, cpu_flags, cpu_model, fast_bf16, matmul_flags
from mllm.settings import settings
from mllm.transformer import causal_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# bf16 is chosen when its probe step is at least this much shorter: within it, the two are
# equal as far as a shared machine can tell, and float32 does not round.
MARGIN = 0.10
PROBE_TARGETS = 512  # targets (tokens) per probe step: enough rows for the matmuls to dominate
PROBE_REPS = 2  # timed passes per precision, after a warm-up; the fastest counts
# A model with fewer training FLOPs in a probe step (about 10 ms of one core's float32 matrix
# multiply) stays in float32 unprobed: what bf16 could save there is within a shared machine's
# timing noise, it would round for nothing, and a count, unlike a timing, decides the same way
# under any load.
SMALL_FLOPS = 1e9
# Float32 weights under this many MB decode as fast as bf16 ones: they stay in the caches (2 MB of
# L2 a core and a shared L3 on the project's machines) between tokens, and at 4/4/128 (3.2 MB)
# bf16 measured no faster. Above it a decoding step streams its weights from memory.
SMALL_DECODE_MB = 8.0

# The written-out attention takes over from torch's SDPA kernel where it is at least this much
# faster (a whole sequence's forward and backward, timed alone: milliseconds, not seconds).
ATTENTION_MARGIN = 0.05
ATTENTION_ROWS = 16  # at most this many sequences a probe: enough to fill the cores
ATTENTION_REPS = 3

PEAK_FRESH_S = 3600.0  # a measured peak this recent is used as it is (see peak_flops)

# Dense peaks from the spec sheets, FLOP/s: (bf16, tf32, fp32 without tensor cores). The first
# name found in torch.cuda.get_device_name wins, so the longer names come first.
GPU_PEAKS = (
    ("H100 PCIe", (756e12, 378e12, 51.2e12)),
    ("H100", (989e12, 494e12, 66.9e12)),
    ("H200", (989e12, 494e12, 66.9e12)),
    ("A100", (312e12, 156e12, 19.5e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L4", (121e12, 60e12, 30.3e12)),
    ("A10", (125e12, 62.5e12, 31.2e12)),
    ("RTX 4090", (165e12, 82.6e12, 82.6e12)),
    ("V100", (None, None, 15.7e12)),
    ("T4", (None, None, 8.1e12)),
)


@dataclass
class Precision:
    """The precision a training runs in, and why."""

    dtype: str  # float32 | bfloat16
    reason: str  # in a few words: forced, cuda, probe, ...
    probe_ms: dict[str, float] | None = None  # one training step per precision, when probed

    def autocast(self, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
        if self.dtype == "bfloat16":
            return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext

    def describe(self) -> str:
        if not self.probe_ms:
            return f"{self.dtype} ({self.reason})"
        times = ", ".join(f"{k} {v:.0f} ms" for k, v in self.probe_ms.items())
        return f"{self.dtype} ({self.reason}; a probe step: {times})"


# --- the machine ---------------------------------------------------------------------------


def machine(device: torch.device) -> str:
    """The device in a line, as figures are reported beside it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({' '.join(matmul_flags()) or 'no AVX2'}), {torch.get_num_threads()} threads"


# --- the cache ------------------------------------------------------------------------------


def cache_file() -> Path:
    s = settings()
    root = s.cache_dir or os.path.join(s.xdg_cache_home or os.path.expanduser("~/.cache"), "mllm")
    return Path(root) / "speed.json"


def _cached(key: list, measure: Callable[[], dict]) -> dict:
    """measure(), or what it returned before for the same key on this machine.

    A figure measured while the machine was busy (a load average above its core count: other
    jobs took the cores it timed) is used, and measured again at the first quiet moment.
    """
    busy = _busy()
    hit = _recall(key)
    if hit is not None and (busy or not hit.get("busy")):
        return hit["value"]
    value = measure()
    _remember(key, value, busy)
    return value


def _busy() -> bool:
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def _digest(key: list) -> str:
    machine_key = [
        cpu_model(),
        sorted(cpu_flags()),
        torch.__version__,
        torch.get_num_threads(),
        torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    ]
    if env := cpu_env():  # what the CPU computes with, as the environment limits it (mllm.settings.CPU_ENV)
        machine_key.append(env)
    return hashlib.sha256(json.dumps([machine_key, key], sort_keys=True, default=str).encode()).hexdigest()[:24]


def _recall(key: list) -> dict | None:
    """The cache's entry for `key` on this machine ({"value", "busy", "when"}), or None."""
    hit = _read(cache_file()).get(_digest(key))
    return hit if isinstance(hit, dict) and "value" in hit else None


def _remember(key: list, value: dict, busy: bool) -> None:
    path = cache_file()
    with contextlib.suppress(OSError):  # a read-only home costs a probe per run, nothing more
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"value": value, "busy": busy, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "at": time.time()}
        entries = {**_read(path), _digest(key): entry}  # read again: another process may have added some
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(entries, f)
        os.replace(f.name, path)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- precision ------------------------------------------------------------------------------


def choose_precision(requested: str, device: torch.device, model: nn.Module, batch: tuple) -> Precision:
    """The precision for `train.dtype` = requested, probing `model` on `batch` where it must."""
    if requested != "auto":
        return Precision(requested, "forced by train.dtype")
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        return Precision("bfloat16" if bf16 else "float32", "CUDA" if bf16 else "this GPU has no bf16")
    if device.type != "cpu":
        return Precision("float32", f"no bf16 autocast probe on {device.type}")
    if not fast_bf16():
        return Precision("float32", "this CPU has neither AMX nor AVX512-BF16")
    sample = _slice(batch, PROBE_TARGETS)
    flops = flops_per_target(model, sample) * int((sample[-1] >= 0).sum())
    if flops < SMALL_FLOPS:
        return Precision(
            "float32", f"a model this small ({flops / 1e6:,.0f} MFLOP a probe step) gains nothing from bf16"
        )
    shape = [type(model).__name__, _shape(model), [list(x.shape) for x in sample]]

    def measure() -> dict[str, float]:
        return _probe(model, tuple(x.to(device) for x in sample), Precision("bfloat16", "").autocast(device))

    return _probed(_cached(["precision", shape], measure), "bf16")


def choose_decode_precision(
    requested: str, device: torch.device, model: nn.Module, probe: Callable[[], dict[str, float]]
) -> Precision:
    """The precision of a language model's weights when it decodes one token at a time.

    Each decoding step multiplies every weight matrix by one vector: the step streams all the
    weights from memory and does two FLOPs per weight, so halving their bytes matters more than
    the arithmetic. Models whose float32 weights stay in the CPU's caches gain nothing and keep
    float32 unprobed (a count decides as the same under any load); larger ones are probed with
    `probe` (milliseconds of a decoding step per precision) and take bf16 past MARGIN.
    """
    if requested != "auto":
        return Precision(requested, "forced by sample.dtype")
    if device.type != "cpu":
        return Precision("float32", f"no bf16 decoding probe on {device.type}")
    if not fast_bf16():
        return Precision("float32", "this CPU has neither AMX nor AVX512-BF16")
    weight_mb = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    if weight_mb < SMALL_DECODE_MB:
        return Precision("float32", f"weights this small ({weight_mb:.1f} MB) stay in the CPU's caches")
    return _probed(_cached(["decode", type(model).__name__, _shape(model)], probe), "bf16 decoding")


def _probed(ms: dict[str, float], what: str) -> Precision:
    """bf16 when its probe time is at least MARGIN shorter than float32's."""
    bf16 = ms["bfloat16"] <= (1 - MARGIN) * ms["float32"]
    return Precision("bfloat16" if bf16 else "float32", f"{what} probed {'faster' if bf16 else 'no faster'}", ms)


def _shape(model: nn.Module) -> list:
    """What decides a model's speed: its parameters' shapes (dropout and weights do not), and the
    attention kernels it was given (choose_attention: the same model in bf16 trained 1.6x faster
    once its attention was written out)."""
    kernels = getattr(model, "attention_kernels", None) or {}
    # Options that change the work but no parameter (a GPT's rotary positions, QK-norm, ReLU^2...);
    # empty for the defaults, so keys measured before those options existed still hold.
    variant = getattr(model, "speed_variant", None) or {}
    return (
        [[name, list(p.shape)] for name, p in model.named_parameters()]
        + [[str(dtype), kernel] for dtype, kernel in sorted(kernels.items(), key=str)]
        + ([["variant", sorted(variant.items())]] if variant else [])
    )


def _slice(batch: tuple, targets: int) -> tuple:
    """The first rows of a batch holding about `targets` targets (every family's batch is
    batch-first)."""
    rows = len(batch[-1])
    per_row = max(1, batch[-1][0].numel())
    n = min(rows, max(1, -(-targets // per_row)))
    return tuple(x[:n] if x.dim() and len(x) == rows else x for x in batch)


def _probe(model: nn.Module, batch: tuple, bf16: Callable) -> dict[str, float]:
    """Milliseconds of the fastest forward and backward pass in each precision, after a warm-up
    of each. The two alternate (A B A B), so that a burst of load on a shared machine slows both
    rather than deciding the choice. The model and the RNG are left as they were."""
    precisions = {"float32": contextlib.nullcontext, "bfloat16": bf16}
    times: dict[str, list[float]] = {name: [] for name in precisions}
    with torch.random.fork_rng(devices=[]):  # dropout draws here must not shift the training's
        for _ in range(1 + PROBE_REPS):  # the first pass of each is a warm-up
            for name, autocast in precisions.items():
                times[name].append(_step_s(model, batch, autocast))
    model.zero_grad(set_to_none=True)
    return {name: round(1000 * min(ts[1:]), 1) for name, ts in times.items()}


def _step_s(model: nn.Module, batch: tuple, autocast: Callable) -> float:
    start = time.perf_counter()
    with autocast():
        _, loss, _ = model(*batch)
    loss.backward()
    return time.perf_counter() - start


# --- attention ------------------------------------------------------------------------------


def choose_attention(model: nn.Module, device: torch.device, batch: tuple) -> str:
    """Which attention a GPT trains with on this CPU, per precision; what was measured, in a line.

    torch's CPU flash attention (SDPA) streams keys in blocks and keeps float32 statistics; the
    same attention written out as batched matrix multiplies and a softmax
    (mllm.transformer.causal_attention) makes the score matrix whole but runs on the
    matrix-multiply kernels, and measured 2x faster in bf16 at the shakespeare-gpt shape and
    3-4x at nanoGPT's CPU size on an AMD EPYC. Which one wins depends on the CPU, the shape and
    the precision, so each is timed here, alone (a forward and a backward pass of q, k and v at
    the run's batch, heads, context and head size, the two alternating), and cached per machine
    and shape. The choice goes into the model's `attention_kernels` table. Models without one,
    `attention: explicit`, and devices other than a CPU (where SDPA's fused kernels are the
    fast path) are left as they are, and say nothing.
    """
    kernels = getattr(model, "attention_kernels", None)
    if kernels is None or device.type != "cpu" or model.config.attention != "sdpa":
        return ""
    rows, T = batch[0].shape[:2]
    shape = (min(rows, ATTENTION_ROWS), model.config.n_head, T, model.config.n_embd // model.config.n_head)
    said = []
    for name in ["float32"] + (["bfloat16"] if fast_bf16() else []):
        ms = _cached(
            ["attention", "causal_attention", name, *shape], lambda name=name: _attention_probe(DTYPES[name], *shape)
        )
        kernels[DTYPES[name]] = kernel = "matmul" if ms["matmul"] <= (1 - ATTENTION_MARGIN) * ms["sdpa"] else "sdpa"
        said.append(
            f"{name}: {'written out' if kernel == 'matmul' else 'sdpa'} "
            f"(a pass {ms['matmul']:.1f} ms written out, {ms['sdpa']:.1f} ms sdpa)"
        )
    return "; ".join(said)


def _attention_probe(dtype: torch.dtype, B: int, H: int, T: int, D: int) -> dict[str, float]:
    """Milliseconds of the fastest forward and backward pass of each attention (after a warm-up)."""
    g = torch.Generator().manual_seed(0)  # not the global one: the training's draws must not move
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, T, D, generator=g).to(dtype)
    passes = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "matmul": lambda: causal_attention(q, k, v),
    }
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(1 + ATTENTION_REPS):
        for name, attend in passes.items():
            start = time.perf_counter()
            attend().backward(grad)
            times[name].append(time.perf_counter() - start)
    return {name: round(1000 * min(ts[1:]), 2) for name, ts in times.items()}


# --- utilisation ----------------------------------------------------------------------------


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from) for dense matrix multiplies on `device` in `dtype`."""
    if device.type == "cuda":
        spec = spec_peak(torch.cuda.get_device_name(device), dtype, torch.backends.cuda.matmul.allow_tf32)
        if spec:
            return spec
    size = 1024 if device.type == "cpu" else 4096
    # A peak measured while another process shared the cores is too low, never too high (and
    # the load average is too slow to tell): a run more than PEAK_FRESH_S after the cache's
    # figure measures again, and the cache keeps the highest figure seen.
    key = ["matmul", device.type, dtype, size]
    hit = _recall(key)
    flops = hit["value"]["flops"] if hit else 0.0
    if hit is None or time.time() - hit.get("at", 0.0) > PEAK_FRESH_S:
        flops = max(flops, matmul_flops(device, DTYPES[dtype], size))
        _remember(key, {"flops": flops}, _busy())
    return (
        flops,
        f"measured ({size}x{size} matmul, {torch.get_num_threads()} threads)"
        if device.type == "cpu"
        else f"measured ({size}x{size} matmul)",
    )


def spec_peak(gpu: str, dtype: str, tf32: bool = False) -> tuple[float, str] | None:
    """A GPU's dense peak from its spec sheet (GPU_PEAKS), by the name CUDA gives it; None for a
    GPU or precision the table does not hold."""
    for key, (bf16, tf32_peak, fp32) in GPU_PEAKS:
        if key in gpu:
            spec = bf16 if dtype == "bfloat16" else tf32_peak if tf32 else fp32
            return (spec, f"{key} spec sheet") if spec else None
    return None


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of the fastest of repeated n x n matrix multiplies (after a warm-up); at one CPU thread
    timed by its CPU time, which sharing the cores does not stretch (docs/speed.md, "MFU")."""
    g = torch.Generator().manual_seed(0)  # not the global one: the training's draws must not move
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    one_thread = device.type == "cpu" and torch.get_num_threads() == 1
    best, spent = float("inf"), 0.0
    for i in range(50):
        _sync(device)
        start, cpu = time.perf_counter(), time.thread_time()
        a @ b
        _sync(device)
        took = time.perf_counter() - start
        if one_thread:
            took = min(took, time.thread_time() - cpu)
        if i:
            best, spent = min(best, took), spent + took
        if spent > seconds and i >= 3:
            break
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def flops_per_target(model: nn.Module, batch: tuple) -> float:
    """Training FLOPs (forward and backward) per target of `batch`.

    A model that knows better says so: the GPT (flops_per_token, which adds attention over its
    context), CBOW with negative sampling (flops_per_target). Any other: 6 FLOPs per weight a
    target passes through (2 forward, 4 backward), counting the weights of every layer but the
    embedding tables, which are looked up rather than multiplied.
    """
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token(batch[0].shape[-1]))
    if hasattr(model, "flops_per_target"):
        return float(model.flops_per_target())
    multiplied = {
        id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    return 6.0 * sum(p.numel() for p in model.parameters() if id(p) in multiplied)
