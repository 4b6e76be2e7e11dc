"""Training on several processes (DDP under torchrun), and the RNG states a checkpoint keeps so
that every rank resumes exactly. With one process each of these is a no-op or a plain copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist

from mllm.settings import settings


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def master(self) -> bool:
        return self.rank == 0


def join(device: torch.device) -> tuple[Dist, torch.device]:
    """Join the process group when started under torchrun (WORLD_SIZE > 1)."""
    s = settings()
    if s.world_size <= 1:
        return Dist(), device
    d = Dist(s.rank, s.local_rank, s.world_size)
    if device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        d.owns_group = True
    return d, device


def gather(obj, d: Dist) -> list:
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    tdist.all_gather_object(out, obj)
    return out


def rng_state(batches, device: torch.device, d: Dist) -> dict:
    # Every rank's own dropout RNG, so a DDP run resumes exactly too (only rank 0 writes).
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    states = gather((torch.get_rng_state(), cuda), d)
    rng = {"cpu": [s[0] for s in states]}
    if cuda is not None:
        rng["cuda"] = [s[1] for s in states]
    if batches.rng_state() is not None:
        rng["data"] = batches.rng_state()
    return rng


def set_rng_state(rng: dict, batches, data_state: dict, device: torch.device, d: Dist) -> None:
    if d.rank < len(rng.get("cpu", [])):
        torch.set_rng_state(rng["cpu"][d.rank].cpu())
    if device.type == "cuda" and d.rank < len(rng.get("cuda", [])):
        torch.cuda.set_rng_state(rng["cuda"][d.rank].cpu(), device)
    data = rng.get("data")
    batches.load_state_dict(data_state, data.cpu() if data is not None else None)
