"""The device a model runs on."""

from __future__ import annotations

import torch

from mllm import UserError


def resolve_device(name: str) -> torch.device:
    """A device name (train.device, --device) as a torch.device: auto picks CUDA, then MPS, then
    the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device {name!r} is not a device: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"device {name} asked for, but no CUDA GPU is visible here: use cpu, or auto "
            "(which takes a GPU when there is one)"
        )
    return device
