"""A GPU of its own for each training that a worker runs at once, held by a file lock (docs/stack.md)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator

from flows.settings import settings
from mllm import UserError
from mllm.settings import export

log = logging.getLogger(__name__)


def worker_devices() -> list[str]:
    s = settings()
    listed = s.gpus or s.cuda_visible_devices
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _locks() -> Path:
    folder = Path(settings().gpu_locks or Path(tempfile.gettempdir()) / f"mllm-gpus-{os.getuid()}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _try_claim(devices: list[str], n: int) -> list[tuple[str, IO]] | None:
    held: list[tuple[str, IO]] = []
    for device in devices:
        f = open(_locks() / f"gpu-{device}.lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        held.append((device, f))
        if len(held) == n:
            return held
    for _, f in held:
        f.close()  # closing releases the lock
    return None


@contextlib.contextmanager
def own_devices(n: int, device: str, logger: logging.Logger | None = None) -> Iterator[list[str]]:
    """Hold `n` of the worker's GPUs for a training on `device` (auto or cuda; cpu, cuda:N and
    mps are left as they are) and show it only those; yields the ids held (none: nothing done)."""
    logger = logger or log
    devices = worker_devices() if settings().flow_run_id and device in ("auto", "cuda") else []
    if n < 1 or len(devices) < 2:
        yield []
        return
    if n > len(devices):
        raise UserError(
            f"the training asks for {n} GPUs (train.nproc_per_node); this worker has {len(devices)} "
            f"({','.join(devices)}): lower train.nproc_per_node, or train on a worker with more"
        )
    said = False
    while (held := _try_claim(devices, n)) is None:
        if not said:
            logger.info(
                "every GPU of this worker (%s) is taken by another training: waiting for one", ",".join(devices)
            )
            said = True
        time.sleep(1.0)
    shown = ",".join(d for d, _ in held)
    before = export({"CUDA_VISIBLE_DEVICES": shown})
    logger.info("training on GPU %s of this worker's %s (CUDA_VISIBLE_DEVICES=%s)", shown, ",".join(devices), shown)
    try:
        yield [d for d, _ in held]
    finally:
        logger.info("GPU %s of this worker free again", shown)
        export(before)
        for _, f in held:
            f.close()
