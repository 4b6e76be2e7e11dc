"""Training data: token ids on disk, and the windows a model learns from.

Two ways to draw batches, both resumable exactly from a checkpoint:
- `RandomWindows` (nanoGPT's get_batch): each batch picks random window starts with a
  torch.Generator whose state goes into the checkpoint.
- `EpochWindows` (the reference LSTM recipe): every window start at `stride`, shuffled once per
  epoch; the position (epoch, batch) goes into the checkpoint.
Targets are the inputs shifted by one token. Under DDP each rank takes its share of every batch.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from mllm import UserError, storage


def load_ids(url: str) -> np.ndarray:
    """A flat array of token ids from a .npy file: memory-mapped when local, read whole otherwise."""
    storage.require(url, "token ids")
    fs, path = storage.filesystem(url)
    try:
        if isinstance(fs, LocalFileSystem):
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            ids = np.load(io.BytesIO(storage.read_bytes(url)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{url} is not a .npy array of token ids ({e}): re-run the split stage") from None
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{url} must hold a flat integer array of token ids: re-run the split stage")
    return ids


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

    def __init__(self, ids: np.ndarray, window: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
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
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
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


class EpochOrder:
    """Shuffled passes over `n` items, a batch of indices at a time, resumable exactly.

    An epoch's order depends only on (seed, epoch), so the position (epoch, batch) is the whole
    state. Under DDP the order is padded to a multiple of the world size and dealt out like
    torch's DistributedSampler, so every rank takes as many batches per epoch. The batchers of
    every family (windows of text, CBOW centre words, sentence pairs) build on it.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.n, self.batch_size, self.seed, self.rank, self.world_size = n, batch_size, seed, rank, world_size
        self.per_rank = math.ceil(n / world_size)
        self.batches_per_epoch = math.ceil(self.per_rank / batch_size)
        self.position = (0, 0)  # (epoch, batch within it) of the next batch
        self._order_epoch, self._order = -1, None

    def _order_of(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            order = np.resize(order, self.per_rank * self.world_size)
            self._order, self._order_epoch = order[self.rank::self.world_size], epoch
        return self._order

    def take(self) -> np.ndarray:
        """The next batch's item indices; the position moves past them."""
        epoch, batch = self.position
        picked = self._order_of(epoch)[batch * self.batch_size:(batch + 1) * self.batch_size]
        batch += 1
        self.position = (epoch + 1, 0) if batch == self.batches_per_epoch else (epoch, batch)
        return picked

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position[0], "batch": self.position[1]}

    def rng_state(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, int], rng_state: torch.Tensor | None = None) -> None:
        self.position = (int(state.get("epoch", 0)), int(state.get("batch", 0)))

    @property
    def epoch(self) -> float:
        """Epochs done so far, with the fraction of the current one."""
        return self.position[0] + self.position[1] / self.batches_per_epoch


class EpochWindows(EpochOrder):
    """Shuffled passes over every window start at `stride` (all of them with stride 1)."""

    def __init__(self, ids: np.ndarray, window: int, batch_size: int, stride: int, seed: int,
                 rank: int = 0, world_size: int = 1):
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
