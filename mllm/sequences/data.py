"""The sequence experiments' data, made from the config: inputs and targets of numbers, one .npz a
split, and the batches drawn from them."""

from __future__ import annotations

import io

import numpy as np
import torch

from mllm import UserError, storage
from mllm.data.vocab import UNK, Vocab
from mllm.runtime.epochs import EpochOrder


def vocabulary(numbers: int) -> Vocab:
    return Vocab([UNK, *(str(n) for n in range(numbers))])


def make_sequences(task: str, length: int, numbers: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets as numbers (not ids), one sequence a row."""
    if task == "remember-first-random":
        x = np.random.default_rng(seed).integers(0, numbers, size=(count, length))
    else:  # every run of `length` consecutive numbers whose successor is still below `numbers`
        x = np.arange(numbers - length)[:, None] + np.arange(length)
    y = x + 1 if task == "count" else np.repeat(x[:, :1], length, axis=1)
    return x, y


def split_sequences(task: str, n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the train and validation split. The consecutive tasks have so few distinct
    sequences that, as in the seed, every one is trained on and scored; random ones are held out."""
    if task != "remember-first-random":
        every = np.arange(n)
        return every, every
    order = np.random.default_rng(seed).permutation(n)
    cut = max(1, int(round(n * val_fraction)))
    return np.sort(order[cut:]), np.sort(order[:cut])


def save_split(url: str, x: np.ndarray, y: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, inputs=x.astype(np.int64) + 1, targets=y.astype(np.int64) + 1)  # numbers -> ids
    storage.write_bytes(url, buf.getvalue())


def load_split(url: str) -> tuple[np.ndarray, np.ndarray]:
    """Input and target ids [N, L] of one split."""
    storage.require(url, "sequences")
    try:
        with np.load(io.BytesIO(storage.read_bytes(url)), allow_pickle=False) as f:
            x, y = f["inputs"], f["targets"]
    except (ValueError, OSError, KeyError, EOFError) as e:
        raise UserError(f"{url} is not a sequences file ({e}): prepare the data again") from None
    if x.ndim != 2 or x.shape != y.shape or len(x) == 0:
        raise UserError(f"{url} must hold inputs and targets of the same shape [N, L]: prepare the data again")
    return x, y


class SequenceBatches(EpochOrder):
    """Shuffled passes over the sequences, a batch of rows at a time."""

    def __init__(
        self, split: tuple[np.ndarray, np.ndarray], batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        self.x, self.y = (torch.from_numpy(np.ascontiguousarray(a)) for a in split)
        super().__init__(len(self.x), batch_size, seed, rank, world_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.take())
        return self.x[rows], self.y[rows]


def all_batches(split: tuple[np.ndarray, np.ndarray], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = (torch.from_numpy(np.ascontiguousarray(a)) for a in split)
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
