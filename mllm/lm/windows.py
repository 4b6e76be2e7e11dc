"""A language model's training batches: windows of token ids and the same shifted by one, drawn at
random or in shuffled epochs, both resumable exactly."""

from __future__ import annotations

import numpy as np
import torch

from mllm import UserError
from mllm.runtime.epochs import EpochOrder


def windows(ids: np.ndarray, starts: np.ndarray, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ids[s:s+window] and targets ids[s+1:s+window+1] for each start, as int64."""
    rows = np.asarray(ids[np.asarray(starts)[:, None] + np.arange(window + 1)], dtype=np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _check_length(ids: np.ndarray, window: int, what: str) -> None:
    if len(ids) <= window:
        raise UserError(
            f"the {what} split has {len(ids)} tokens, too few for one window of {window}: "
            "lower train.window or use more text"
        )


class RandomWindows:
    """nanoGPT's get_batch: every batch draws `batch_size` random window starts."""

    def __init__(self, ids: np.ndarray, window: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        _check_length(ids, window, "train")
        self.ids, self.window, self.batch_size = ids, window, batch_size
        self.rank, self.world_size = rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batches = 0
        self.batches_per_epoch = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank draws the global batch from the same generator and keeps its slice: rank 0's
        # generator state, the one checkpointed, then resumes every rank.
        n = self.batch_size * self.world_size
        starts = torch.randint(len(self.ids) - self.window, (n,), generator=self.generator)
        mine = starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        self.batches += 1
        return windows(self.ids, mine.numpy(), self.window)

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: dict[str, int], rng_state: torch.Tensor | None) -> None:
        self.batches = int(state.get("batches", 0))
        if rng_state is not None:
            self.generator.set_state(rng_state)

    @property
    def epoch(self) -> float | None:
        return None


class EpochWindows(EpochOrder):
    """Shuffled passes over every window start at `stride` (all of them with stride 1)."""

    def __init__(
        self, ids: np.ndarray, window: int, batch_size: int, stride: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        _check_length(ids, window, "train")
        self.ids, self.window, self.stride = ids, window, stride
        self.num_windows = (len(ids) - window - 1) // stride + 1
        super().__init__(self.num_windows, batch_size, seed, rank, world_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(self.ids, self.take() * self.stride, self.window)


def eval_starts(ids: np.ndarray, window: int, count: int, seed: int) -> np.ndarray:
    """The fixed validation windows scored at every eval, so that evals compare like with like."""
    _check_length(ids, window, "validation")
    possible = len(ids) - window
    if count >= possible:
        return np.arange(possible)
    return np.sort(np.random.default_rng(seed).choice(possible, size=count, replace=False))
