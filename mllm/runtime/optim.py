"""The optimizers a training builds (`train.optimizer`): Adam or AdamW over the parameter groups
of `optim_groups`, or Muon for a GPT's hidden matrices with AdamW for the rest; and the learning
rate's schedule (`lr_factor`)."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from mllm import UserError
from mllm.config import TrainConfig


def optim_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (weights, embeddings) only; biases and norm gains stay free
    (nanoGPT). A model with other needs says so with an `optim_groups` method of its own."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


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
            raise ValueError(f"optimizer state holds {sorted(saved or ['one optimizer'])}, "
                             f"this training {sorted(self.parts)}")
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])
        # Loading gives each part new group dicts: share those, or a scheduler would set stale ones.
        self.param_groups = [g for part in self.parts.values() for g in part.param_groups]


def build_optimizer(model: nn.Module, t, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `t` (a TrainConfig) asks for, over `model`'s parameters."""
    # Fused on CPU too: torch's default there is a Python loop over the parameters, a tenth of a
    # small GPT's step. The fused kernel computes the same update in another order, so weights
    # differ from the loop's in the last bits (tests/test_train.py bounds how far the losses move).
    fused = device.type in ("cuda", "cpu") or None
    if t.optimizer == "muon":
        hidden, rest = muon_split(model)
        adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": t.weight_decay},
                                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)
        muon = torch.optim.Muon(hidden, lr=t.muon_lr, momentum=t.muon_momentum,
                                weight_decay=t.muon_weight_decay)
        return Combined({"muon": muon, "adamw": adamw})
    own = getattr(model, "optim_groups", None)
    groups = own(t.weight_decay) if own else optim_groups(model, t.weight_decay)
    kind = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return kind(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)


def lr_factor(t: TrainConfig, total_steps: int | None,
              spent: Callable[[], float] | None = None) -> Callable[[int], float]:
    """The multiplier of train.lr at each step: linear warmup, then constant or cosine (or linear)
    to min_lr over the steps to total_steps, or, given `spent` (a time budget: the share of
    train.max_minutes gone, 0 to 1), over the budget's minutes."""
    if t.lr_schedule != "constant" and total_steps is None and spent is None:
        raise UserError(f"lr_schedule {t.lr_schedule} needs max_steps, epochs or max_minutes to know where to end: "
                        "set one, or use constant")

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
