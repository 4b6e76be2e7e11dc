"""The optimizers a training builds (`train.optimizer`): Adam or AdamW over the parameter groups
of `optim_groups`, or Muon for a GPT's hidden matrices with AdamW for the rest; and the learning
rate's schedule (`lr_factor`)."""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn as nn

from mllm import UserError
from mllm.config import TrainConfig
from mllm.runtime import speed
from mllm.runtime.machine import fast_bf16


def optim_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (weights, embeddings) only; biases and norm gains stay free
    (nanoGPT). A model with other needs says so with an `optim_groups` method of its own."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) parameters: Muon takes the 2-D weights inside the transformer blocks (the
    attention and MLP matrices); the embeddings, head, norm gains and biases go to AdamW, as
    torch.optim.Muon's own docstring and modded-nanogpt do (an embedding row is a lookup, not a
    linear map whose update orthogonalisation should shape)."""
    blocks = {id(p) for p in model.transformer.h.parameters()}
    muon, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (muon if id(p) in blocks and p.dim() == 2 else rest).append(p)
    return muon, rest


class Combined(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped, zeroed and saved as one.

    Its param_groups are the parts' own group dicts, so one LR scheduler sets every part's rate
    (each group's schedule multiplies its own initial rate), and clipping sees every parameter.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        # Optimizer.__init__ keeps the group dicts it is given, so they stay the parts' own.
        super().__init__([g for part in parts.values() for g in part.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict:
        return {"parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("parts")
        if saved is None or set(saved) != set(self.parts):
            raise ValueError(
                f"optimizer state holds {sorted(saved or ['one optimizer'])}, this training {sorted(self.parts)}"
            )
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])
        # Loading gives each part new group dicts: share those, or a scheduler would set stale ones.
        self.param_groups = [g for part in self.parts.values() for g in part.param_groups]


def newton_schulz_dtype(device: torch.device, shapes: list[tuple[int, int]] | None = None) -> tuple[torch.dtype, str]:
    """The precision Muon orthogonalises its updates in, and why.

    torch.optim.Muon always runs its Newton-Schulz iteration in bf16, which is the fast choice
    on a GPU. On a CPU it is measured, as the model's precision is (mllm.runtime.speed): a CPU
    without AMX or AVX512-BF16 emulates bf16 matrix multiplies (measured on an AMD EPYC with AVX2
    alone, a 512x512 product took 220.6 ms in bf16 and 2.46 ms in float32, and a Muon step of the
    default recipe 1,695 ms against AdamW's 29 ms), and so does a CPU that has them under
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2. Elsewhere one iteration on a matrix of each of
    Muon's `shapes` is timed in either precision (cached per machine, shapes and those variables),
    and bf16 taken where it is at least speed.MARGIN faster. Float32 is more precise, the same
    update up to rounding."""
    if device.type != "cpu":
        return torch.bfloat16, f"bfloat16 ({'CUDA' if device.type == 'cuda' else device.type}, as torch.optim.Muon)"
    if not fast_bf16():
        return torch.float32, "float32: this CPU has neither AMX nor AVX512-BF16, so bf16 products are emulated"
    shapes = sorted({tuple(s) for s in shapes or [(512, 512)]})
    ms = speed._cached(["newton-schulz", [list(s) for s in shapes]], lambda: _newton_schulz_probe(shapes))
    bf16 = ms["bfloat16"] <= (1 - speed.MARGIN) * ms["float32"]
    return (
        torch.bfloat16 if bf16 else torch.float32,
        f"{'bfloat16' if bf16 else 'float32'}: bf16 probed {'faster' if bf16 else 'no faster'} "
        f"(an iteration: bfloat16 {ms['bfloat16']:.1f} ms, float32 {ms['float32']:.1f} ms)",
    )


def _newton_schulz_probe(shapes: list[tuple[int, int]]) -> dict[str, float]:
    """Milliseconds of the fastest Newton-Schulz iteration over one matrix of each shape, in each
    precision, after a warm-up; the two alternate, so a burst of load slows both."""
    g = torch.Generator().manual_seed(0)  # not the global one: the training's draws must not move
    mats = [torch.randn(1, *shape, generator=g) for shape in shapes]
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for _ in range(1 + speed.PROBE_REPS):
        for name in times:
            start = time.perf_counter()
            for m in mats:
                orthogonalise(m, (3.4445, -4.775, 2.0315), 1, 1e-7, speed.DTYPES[name])
            times[name].append(time.perf_counter() - start)
    return {name: round(1000 * min(ts[1:]), 2) for name, ts in times.items()}


def orthogonalise(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (Keller Jordan's, as torch.optim.Muon has it) in
    `dtype`: an approximation of U V^T for each matrix g = U S V^T of a stack (count, rows, cols),
    computed on the wide orientation."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in `ns_dtype` (newton_schulz_dtype), and
    the matrices of one shape orthogonalised together, as one batched iteration.

    The same update rule, hyperparameters and state (one `momentum_buffer` per matrix), so a
    checkpoint moves between machines whichever precision each one orthogonalises in. torch's
    iteration takes one matrix at a time: on a GPU a step of shakespeare-gpt (24 matrices of
    four shapes) was launch-bound, 52 ms against AdamW's 19.5; here it is four batched ones."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, ns_reason: str = "", **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype, self.ns_reason = ns_dtype, ns_reason  # the reason: what the training reports

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("adjust_lr_fn") not in (None, "original"):
                raise ValueError(f"adjust_lr_fn {group['adjust_lr_fn']} is not supported here")
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads, bufs = [p.grad for p in params], []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            shapes: dict[tuple[int, ...], list[int]] = {}
            for i, p in enumerate(params):
                shapes.setdefault(tuple(p.shape), []).append(i)
            for (rows, cols), idx in shapes.items():
                ortho = orthogonalise(
                    torch.stack([updates[i] for i in idx]),
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                    self.ns_dtype,
                )
                # torch's "original" rate: larger for tall matrices, sqrt(max(1, rows / cols)).
                scale = max(1.0, rows / cols) ** 0.5
                ps = [params[i] for i in idx]
                torch._foreach_add_(ps, [o.to(ps[0].dtype) for o in ortho.unbind(0)], alpha=-lr * scale)
        return loss


def build_optimizer(model: nn.Module, t, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `t` (a TrainConfig) asks for, over `model`'s parameters."""
    # Fused on CPU too: torch's default there is a Python loop over the parameters, a tenth of a
    # small GPT's step. The fused kernel computes the same update in another order, so weights
    # differ from the loop's in the last bits (tests/mllm/test_train.py bounds how far the losses move).
    fused = device.type in ("cuda", "cpu") or None
    if t.optimizer == "muon":
        hidden, rest = muon_split(model)
        adamw = torch.optim.AdamW(
            [
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": t.weight_decay},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            fused=fused,
        )
        ns_dtype, ns_reason = newton_schulz_dtype(device, [tuple(p.shape) for p in hidden])
        muon = Muon(
            hidden,
            ns_dtype=ns_dtype,
            ns_reason=ns_reason,
            lr=t.muon_lr,
            momentum=t.muon_momentum,
            weight_decay=t.muon_weight_decay,
        )
        return Combined({"muon": muon, "adamw": adamw})
    own = getattr(model, "optim_groups", None)
    groups = own(t.weight_decay) if own else optim_groups(model, t.weight_decay)
    kind = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return kind(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)


def lr_factor(
    t: TrainConfig, total_steps: int | None, spent: Callable[[], float] | None = None
) -> Callable[[int], float]:
    """The multiplier of train.lr at each step: linear warmup, then constant or cosine (or linear)
    to min_lr over the steps to total_steps, or, given `spent` (a time budget: the share of
    train.max_minutes gone, 0 to 1), over the budget's minutes."""
    if t.lr_schedule != "constant" and total_steps is None and spent is None:
        raise UserError(
            f"lr_schedule {t.lr_schedule} needs max_steps, epochs or max_minutes to know where to end: "
            "set one, or use constant"
        )

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        if t.lr_schedule == "constant":
            return 1.0
        if spent is not None:
            ratio = spent()
        else:
            ratio = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
        coeff = 1.0 - ratio if t.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
        return (t.min_lr + coeff * (t.lr - t.min_lr)) / t.lr

    return factor
