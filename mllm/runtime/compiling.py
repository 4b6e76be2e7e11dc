"""torch.compile by measurement: what `train.compile: auto` decides, timing eager and compiled steps
of the training itself (docs/speed.md, `train.compile`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from mllm.runtime.speed import _busy, _recall, _remember, _shape
from mllm.settings import settings

COMPILE_GUESS = {"gain": 1.15, "compile_s": 60.0}  # before this machine has measured the model
COMPILE_MARGIN = 0.03  # compiled steps at least this much shorter, or back to eager
COMPILE_WATCH = 6  # eager steps timed before deciding (the first is a warm-up)
COMPILE_TRIAL = 6  # compiled steps timed before keeping it (the first compiles)


@dataclass
class Compiling:
    """Whether a training ran compiled, and why."""

    used: bool
    reason: str
    compile_s: float | None = None  # seconds the compilation took, when it ran
    step_ms: dict[str, float] | None = None  # a step eager and compiled, when both were timed


def cannot_compile(device: torch.device, world_size: int) -> str | None:
    """Why `train.compile: auto` will not compile here, or None."""
    if world_size > 1:
        return "auto compiles one-process trainings (set train.compile: true under DDP)"
    if device.type == "cpu":
        import shutil

        cxx = settings().cxx
        return None if shutil.which(cxx) else f"inductor needs a C++ compiler ({cxx} not found)"
    if device.type == "cuda":
        import importlib.util

        return None if importlib.util.find_spec("triton") else "inductor needs triton on CUDA"
    return f"no compile on {device.type}"


def compile_key(model: nn.Module, batch: tuple, dtype: str) -> list:
    return ["compile", type(model).__name__, _shape(model), [list(x.shape) for x in batch], dtype]


def compile_known(key: list) -> dict | None:
    """{"gain", "compile_s"} measured before on this machine for `key`, or None."""
    hit = _recall(key)
    return hit["value"] if hit is not None and (_busy() or not hit.get("busy")) else None


def compile_pays(left_s: float, known: dict | None) -> bool:
    """Whether compiling should save more of the `left_s` seconds of training than it costs."""
    gain, cost = (known or COMPILE_GUESS)["gain"], (known or COMPILE_GUESS)["compile_s"]
    return gain >= 1 + COMPILE_MARGIN and left_s * (1 - 1 / gain) > cost


def compile_measured(key: list, eager_s: float, compiled_s: float, compile_s: float) -> None:
    _remember(key, {"gain": round(eager_s / compiled_s, 3), "compile_s": round(compile_s, 1)}, _busy())


class _Lenient(nn.Module):
    """The model `auto` compiled. Where inductor cannot compile a graph, that frame runs eager
    instead of failing the training (the trial then finds it no faster and goes back to eager).
    Only this model's calls are lenient: torch's setting is patched around each of them, not set
    for the process, so a `train.compile: true` later in the same process still fails loudly."""

    def __init__(self, raw: nn.Module):
        super().__init__()
        self.compiled = torch.compile(raw, dynamic=False)

    def forward(self, *args, **kwargs):
        with torch._dynamo.config.patch(suppress_errors=True):
            return self.compiled(*args, **kwargs)


class Compiler:
    """train.compile in the loop: true compiles before the first step, false never; auto times
    the first eager steps, compiles when the training left should win the compilation back
    (compile_pays), times the compiled steps and keeps them only if they are faster
    (mllm.runtime.speed). Validation stays on the eager model when auto compiled (another graph, another
    compilation, for a few batches)."""

    def __init__(self, requested, raw: torch.nn.Module, device: torch.device, world_size: int, key: list):
        self.raw, self.key, self.eager_s = raw, key, None
        self.times: list[float] = []
        self.deciding = False
        if requested is True or requested is False:
            self.choice = Compiling(requested, "forced by train.compile")
            self.model = self.evaluator = torch.compile(raw) if requested else raw
            return
        self.model = self.evaluator = raw
        why_not = cannot_compile(device, world_size)
        self.known = compile_known(key)
        if why_not is None and self.known and not compile_pays(math.inf, self.known):
            why_not = (
                f"compiling measured no faster for this model here before "
                f"({self.known['gain']:.2f}x for a {self.known['compile_s']:.0f} s compilation)"
            )
        self.choice = Compiling(False, why_not or "the training ended while its first steps were timed")
        self.deciding = why_not is None

    def after_step(self, step_s: float, steps_left: int | None, seconds_left: float | None) -> torch.nn.Module:
        """The model for the next step, given the last step's seconds and the training left (in
        steps, in seconds, or both; neither: until stopped early)."""
        self.times.append(step_s)
        if self.model is self.raw:  # timing eager steps
            if len(self.times) < COMPILE_WATCH:
                return self.model
            self.eager_s = sorted(self.times[1:])[len(self.times[1:]) // 2]
            left_s = min(
                [math.inf] + [x for x in (seconds_left, steps_left and steps_left * self.eager_s) if x is not None]
            )
            if not compile_pays(left_s, self.known):
                cost = (self.known or COMPILE_GUESS)["compile_s"]
                self.choice.reason = (
                    f"about {left_s:.3g} s of training left: too short to win back a compilation (about {cost:.3g} s)"
                )
                self.deciding = False
                return self.model
            self.model, self.times = _Lenient(self.raw), []
            return self.model
        if len(self.times) < COMPILE_TRIAL:  # timing compiled steps
            return self.model
        compiled_s = sorted(self.times[1:])[len(self.times[1:]) // 2]
        compile_s = max(0.0, self.times[0] - compiled_s)
        compile_measured(self.key, self.eager_s, compiled_s, compile_s)
        ms = {"eager": round(1000 * self.eager_s, 1), "compiled": round(1000 * compiled_s, 1)}
        self.deciding = False
        if compiled_s > (1 - COMPILE_MARGIN) * self.eager_s:
            self.choice = Compiling(
                False,
                f"compiled steps no faster ({ms['compiled']} ms against {ms['eager']} ms eager): back to eager",
                compile_s,
                ms,
            )
            self.model = self.raw
        else:
            self.choice = Compiling(
                True,
                f"{self.eager_s / compiled_s:.2f}x faster compiled "
                f"({ms['compiled']} ms a step against {ms['eager']} ms eager, "
                f"after a {compile_s:.0f} s compilation)",
                compile_s,
                ms,
            )
        return self.model
