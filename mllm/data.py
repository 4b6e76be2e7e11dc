"""Training data every family shares: token ids on disk, and the shuffled epoch order that each
family's batcher builds on (resumable exactly from a checkpoint; dealt out across DDP ranks)."""

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


def check_offsets(offsets: np.ndarray, n_tokens: int, source: str = "paragraph offsets") -> np.ndarray:
    offsets = np.asarray(offsets)
    if (offsets.ndim != 1 or len(offsets) < 1 or not np.issubdtype(offsets.dtype, np.integer)
            or offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 0)):
        raise UserError(f"{source} do not describe paragraphs of {n_tokens} tokens (need 0 first, "
                        f"{n_tokens} last, never decreasing): re-run the split stage")
    return offsets.astype(np.int64, copy=False)


def save_array(url: str, array: np.ndarray) -> None:
    """One .npy file (ids or offsets), written atomically to any storage URL."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    storage.write_bytes(url, buf.getvalue())


def load_offsets(url: str, n_tokens: int) -> np.ndarray:
    storage.require(url, "paragraph offsets")
    try:
        offsets = np.load(io.BytesIO(storage.read_bytes(url)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{url} is not a .npy array of paragraph offsets ({e}): re-run the split stage") from None
    return check_offsets(offsets, n_tokens, url)


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
