"""Training data every family shares: token ids on disk, and the shuffled epoch order that each
family's batcher builds on (resumable exactly from a checkpoint; dealt out across DDP ranks)."""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from mllm import UserError, storage

CHAIN = "mllm.split-pieces/1"  # the format of a split stored as pieces (see ChainedIds)


def load_ids(url: str) -> "np.ndarray | ChainedIds":
    """A split's token ids: a flat .npy file (memory-mapped when local, read whole otherwise), or
    a manifest of pieces (`<split>.ids.json`, a corpus of many files) read as one ChainedIds."""
    storage.require(url, "token ids")
    if url.endswith(".json"):
        return ChainedIds.load(url)
    return _load_npy(url)


def _load_npy(url: str) -> np.ndarray:
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


class ChainedIds:
    """A split stored as its packs' pieces, read as one flat array of ids.

    A corpus of many files keeps each pack's share of a split where the pack was routed, and the
    split itself is a manifest of those pieces: a grown corpus then writes a manifest, not a
    gigabyte of ids again. Every reader of a split (windows, evaluation streams, CBOW contexts,
    DDP ranks) indexes it as it would the flat array: `len`, integer and array indexing of any
    shape, slices across pieces, `max`, `np.asarray`. Each local piece is memory-mapped.
    """

    ndim = 1

    def __init__(self, pieces: list[np.ndarray]):
        if not pieces:
            raise UserError("a split of pieces holds no piece: re-run the split stage")
        self.pieces = pieces
        self.ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
        self.starts = self.ends - [len(p) for p in pieces]
        self.dtype = np.result_type(*[p.dtype for p in pieces])
        self.shape = (int(self.ends[-1]),)

    @classmethod
    def load(cls, url: str) -> "ChainedIds":
        manifest = read_chain(url)
        pieces = []
        for p in manifest["pieces"]:
            storage.require(p["url"], f"a piece of the split {url}")
            ids = _load_npy(p["url"])
            if len(ids) != p["tokens"]:
                raise UserError(
                    f"{p['url']} holds {len(ids)} tokens, the split's manifest {url} says {p['tokens']}: "
                    "re-run the split stage"
                )
            pieces.append(ids)
        return cls(pieces)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, max(start, stop))
        if isinstance(key, (int, np.integer)):
            i = int(key) + len(self) if key < 0 else int(key)
            if not 0 <= i < len(self):
                raise IndexError(f"index {key} is out of bounds for a split of {len(self)} tokens")
            k = int(np.searchsorted(self.ends, i, "right"))
            return self.pieces[k][i - self.starts[k]]
        return self._take(np.asarray(key))

    def _range(self, start: int, stop: int) -> np.ndarray:
        first, last = np.searchsorted(self.ends, [start, stop - 1], "right") if stop > start else (0, -1)
        return np.concatenate(
            [np.zeros(0, self.dtype)]
            + [
                self.pieces[k][max(start - self.starts[k], 0) : min(stop, self.ends[k]) - self.starts[k]]
                for k in range(int(first), int(last) + 1)
            ]
        ).astype(self.dtype, copy=False)

    def _take(self, index: np.ndarray) -> np.ndarray:
        if not np.issubdtype(index.dtype, np.integer):
            raise IndexError(f"a split is indexed by integers, not {index.dtype}")
        idx = index.astype(np.int64, copy=False)
        idx = np.where(idx < 0, idx + len(self), idx)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"an index is out of bounds for a split of {len(self)} tokens")
        if idx.size == 0:
            return np.zeros(index.shape, self.dtype)
        # Readers index rows of nearby positions (a window, a context): a row inside one piece,
        # nearly every row, is one gather from it, grouped by piece; the few rows that cross a
        # piece's end are gathered index by index.
        rows = idx.reshape(-1, idx.shape[-1]) if idx.ndim else idx.reshape(1, 1)
        first = np.searchsorted(self.ends, rows.min(axis=1), "right")
        inside = first == np.searchsorted(self.ends, rows.max(axis=1), "right")
        out = np.empty(rows.shape, self.dtype)
        for k, mine in _groups(first, np.flatnonzero(inside)):
            out[mine] = self.pieces[k][rows[mine] - self.starts[k]]
        if not inside.all():
            across = np.flatnonzero(~inside)
            flat = rows[across].ravel()
            got = np.empty(len(flat), self.dtype)
            for k, mine in _groups(np.searchsorted(self.ends, flat, "right"), np.arange(len(flat))):
                got[mine] = self.pieces[k][flat[mine] - self.starts[k]]
            out[across] = got.reshape(len(across), -1)
        return out.reshape(index.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._range(0, len(self))
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def max(self, axis=None, out=None, **kw):
        if axis not in (None, 0) or out is not None:
            return np.asarray(self).max(axis=axis, out=out, **kw)
        return max(p.max() for p in self.pieces if len(p))

    def __repr__(self) -> str:
        return f"ChainedIds({len(self)} ids in {len(self.pieces)} pieces, {self.dtype})"


def _groups(keys: np.ndarray, members: np.ndarray):
    """(key, the members with that key) for each key among `members`, found by one sort."""
    order = members[np.argsort(keys[members], kind="stable")]
    found, first = np.unique(keys[order], return_index=True)
    for k, a, b in zip(found, first, [*first[1:], len(order)]):
        yield int(k), order[a:b]


def read_chain(url: str) -> dict:
    """A split's manifest of pieces, checked: each piece's URL, tokens and sha256, in order."""
    try:
        manifest = storage.read_json(url)
        ok = manifest.get("format") == CHAIN and all(
            isinstance(p.get("url"), str) and isinstance(p.get("tokens"), int) and isinstance(p.get("sha256"), str)
            for p in manifest["pieces"]
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise UserError(f"{url} is not a manifest of a split's pieces ({CHAIN}): re-run the split stage")
    return manifest


def chain_digest(digests: list[str]) -> str:
    """The digest of a split stored as pieces: of its pieces' sha256s in order, so it names the
    ids exactly as a flat file's sha256 does, without reading them."""
    import hashlib

    return hashlib.sha256((CHAIN + "\n" + "\n".join(digests)).encode()).hexdigest()


def ids_digest(url: str) -> str:
    """A split's digest as its files are now: a flat .npy's sha256, or a manifest's chain_digest
    over its pieces' files read again (a piece changed in place no longer matches)."""
    if not url.endswith(".json"):
        return storage.sha256_file(url)
    return chain_digest([storage.sha256_file(p["url"]) for p in read_chain(url)["pieces"]])


def missing_piece(url: str) -> str | None:
    """The first piece a split's manifest names that storage no longer holds (the manifest
    itself, when it is no manifest)."""
    try:
        pieces = read_chain(url)["pieces"]
    except UserError:
        return url
    return next((p["url"] for p in pieces if not storage.exists(p["url"])), None)


def check_offsets(offsets: np.ndarray, n_tokens: int, source: str = "paragraph offsets") -> np.ndarray:
    offsets = np.asarray(offsets)
    if (
        offsets.ndim != 1
        or len(offsets) < 1
        or not np.issubdtype(offsets.dtype, np.integer)
        or offsets[0] != 0
        or offsets[-1] != n_tokens
        or np.any(np.diff(offsets) < 0)
    ):
        raise UserError(
            f"{source} do not describe paragraphs of {n_tokens} tokens (need 0 first, "
            f"{n_tokens} last, never decreasing): re-run the split stage"
        )
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
            self._order, self._order_epoch = order[self.rank :: self.world_size], epoch
        return self._order

    def take(self) -> np.ndarray:
        """The next batch's item indices; the position moves past them."""
        epoch, batch = self.position
        picked = self._order_of(epoch)[batch * self.batch_size : (batch + 1) * self.batch_size]
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
