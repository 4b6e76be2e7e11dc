"""The speed choices a training makes once, before its loop (mllm.runtime.speed measures them):
rank 0 measures for every rank, and a resumed training keeps the precision it started in."""

from __future__ import annotations

import torch

from mllm.config import TrainConfig
from mllm.runtime import speed
from mllm.runtime.distributed import Dist, gather


def choose_attention(device: torch.device, model: torch.nn.Module, batch: tuple, d: Dist) -> str:
    """A GPT's attention kernel per precision (mllm.runtime.speed.choose_attention), measured by rank 0
    for every rank: before the precision probe, so that it times each precision at its best."""
    said = speed.choose_attention(model, device, batch) if d.master else ""
    kernels = getattr(model, "attention_kernels", None)
    if d.world_size > 1 and kernels is not None:
        said, chosen = gather((said, dict(kernels)), d)[0]
        kernels.update(chosen)
    return said


def choose_precision(
    t: TrainConfig, device: torch.device, model: torch.nn.Module, batch: tuple, metrics: dict[str, float], d: Dist
) -> speed.Precision:
    """train.dtype resolved (mllm.runtime.speed). Rank 0 decides for every rank, and a resumed training
    keeps the precision it started in (the checkpoint's metrics hold it)."""
    p = speed.choose_precision(t.dtype, device, model, batch) if d.master else None
    if d.world_size > 1:
        p = gather(p, d)[0]
    if "bf16" in metrics and t.dtype == "auto" and (metrics["bf16"] == 1.0) != (p.dtype == "bfloat16"):
        p = speed.Precision(
            "bfloat16" if metrics["bf16"] else "float32",
            f"kept from the start of this training (the probe now says {p.dtype})",
            p.probe_ms,
        )
    metrics["bf16"] = float(p.dtype == "bfloat16")
    return p
