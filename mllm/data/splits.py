"""Train/val/test splits: which tokens go where, and the arrays training reads (a .npy and a Parquet
file per split, or for a corpus of many files a manifest of routed pieces)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mllm import UserError, storage
from mllm.config import SplitConfig
from mllm.data.text import Tokenizer
from mllm.data.tokens import piece_starts, token_batches
from mllm.data.vocab import Vocab

NAMES = ("train", "val", "test")
ROW_GROUP_IDS = 1 << 20  # token ids per row group of a split's Parquet file

Plan = list[tuple[int, int, str]]  # segments (start, end, split name) covering the tokens in order


@dataclass
class WrittenSplit:
    name: str
    n_tokens: int
    n_bytes: int  # UTF-8 bytes of the text these tokens stand for: bits per byte need it
    sha256: str  # of the ids .npy file as stored


def split_plan(n: int, cfg: SplitConfig) -> Plan:
    """Segments (start, end, split) that cover the n tokens in order.

    Contiguous: train, then val, then test. Otherwise the text is cut into blocks of
    `shuffle_chunk` tokens and a seeded permutation picks which blocks go to val and test, so
    each split still holds runs of running text.
    """
    if cfg.contiguous:
        n_val, n_test = int(n * cfg.val_fraction), int(n * cfg.test_fraction)
        n_train = n - n_val - n_test
        plan = [(0, n_train, "train"), (n_train, n_train + n_val, "val"), (n_train + n_val, n, "test")]
    else:
        n_blocks = -(-n // cfg.shuffle_chunk)
        order = np.random.default_rng(cfg.seed).permutation(n_blocks)
        n_val = round(n_blocks * cfg.val_fraction)
        n_test = round(n_blocks * cfg.test_fraction)
        owner = np.full(n_blocks, 0)
        owner[order[:n_val]] = 1
        owner[order[n_val : n_val + n_test]] = 2
        plan = [(b * cfg.shuffle_chunk, min(n, (b + 1) * cfg.shuffle_chunk), NAMES[owner[b]]) for b in range(n_blocks)]
    plan = [seg for seg in plan if seg[1] > seg[0]]
    sizes = plan_sizes(plan)
    if sizes["train"] < 2 or sizes["val"] < 2 or (cfg.test_fraction and sizes["test"] < 2):
        raise UserError(
            f"the corpus has only {n} tokens: too few for a {cfg.val_fraction:g} validation"
            f"{f' and {cfg.test_fraction:g} test' if cfg.test_fraction else ''} split; give a longer text"
            f"{'' if cfg.contiguous else ' or a smaller split.shuffle_chunk'}"
        )
    return plan


def plan_sizes(plan: Plan) -> dict[str, int]:
    sizes = dict.fromkeys(NAMES, 0)
    for start, end, name in plan:
        sizes[name] += end - start
    return sizes


def bytes_per_token(vocab: Vocab, tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes of the text each vocabulary entry stands for, indexed by id."""
    # Word tokens stand for a word and the space after it.
    extra = 1 if tokenizer.kind == "word" else 0
    return np.array([len(tokenizer.detokenize([t]).encode("utf-8")) + extra for t in vocab.itos], dtype=np.int64)


def split_offsets(plan: Plan, starts: np.ndarray) -> dict[str, np.ndarray]:
    """Each split's piece boundaries in its own coordinates: 0, where a piece (paragraph) starts
    inside it, where a segment of the plan ends, and its length. CBOW's contexts stay inside them."""
    bounds: dict[str, list] = {}
    filled: dict[str, int] = {}
    starts = np.asarray(starts)
    for start, end, name in plan:
        at = filled.get(name, 0)
        inside = starts[np.searchsorted(starts, start, "right") : np.searchsorted(starts, end, "left")]
        bounds.setdefault(name, [np.zeros(1, np.int64)]).append(at + inside - start)
        bounds[name].append(np.array([at + end - start], np.int64))
        filled[name] = at + end - start
    return {name: np.unique(np.concatenate(parts)) for name, parts in bounds.items()}


def write_splits(tokens: Any, vocab: Vocab, tokenizer: Tokenizer, plan: Plan, out: str) -> list[WrittenSplit]:
    """Encode the tokens and route each segment of the plan to `out/<split>.npy` and `.parquet`,
    with the split's piece boundaries in `out/<split>.offsets.npy` (see `split_offsets`).

    `tokens` is a token chunks folder (mllm.data.tokens) or a corpus's packs (mllm.data.packs.CorpusPacks)."""
    if isinstance(tokens, str):
        batches, starts = token_batches(tokens), piece_starts(tokens)
    else:
        batches, starts = tokens.batches(), tokens.piece_starts()
    sizes = plan_sizes(plan)
    names = [s for s in NAMES if sizes[s]]
    token_bytes = bytes_per_token(vocab, tokenizer)
    fs, path = storage.filesystem(out)
    with _writing_to(fs, path, "mllm-split-") as (tmp, publish):
        # Each split's tokens come in order (the plan's segments are in text order, and so are a
        # split's own), so its files are written front to back in one pass: memory stays at one
        # row group, with no memory map of the whole split.
        writers = {s: _SplitWriter(os.path.join(tmp, s), sizes[s], token_bytes) for s in names}
        try:
            segments = iter(plan)
            _, end, name = next(segments)
            pos = 0
            for flat in batches:
                ids = vocab.encode_array(flat)
                while len(ids):
                    if pos == end:
                        _, end, name = next(segments)
                    take = min(len(ids), end - pos)
                    writers[name].write(ids[:take])
                    pos += take
                    ids = ids[take:]
        finally:
            for w in writers.values():
                w.close()
        offsets = split_offsets(plan, starts)
        written = []
        for s in names:
            w = writers[s]
            np.save(os.path.join(tmp, f"{s}.offsets.npy"), offsets[s])
            for ext in ("npy", "offsets.npy", "parquet"):
                publish(f"{s}.{ext}")
            written.append(WrittenSplit(s, sizes[s], w.n_bytes, w.sha256.hexdigest()))
    return written


@contextlib.contextmanager
def _writing_to(fs: Any, path: str, prefix: str) -> Iterator[tuple[str, Callable[[str], None]]]:
    """A local folder to write files bound for `path`, and what publishes each one there: on a
    local disk the folder is `path` itself (a gigabyte's copy saved), elsewhere a temporary
    folder whose files are put to `path`."""
    if "file" in fs.protocol:
        fs.makedirs(path, exist_ok=True)
        yield path, lambda name: None
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp, lambda name: fs.put(os.path.join(tmp, name), f"{path}/{name}")


class _SplitWriter:
    """One split's `.npy` and `.parquet` (`token_id: int32`, ROW_GROUP_IDS a row group), with the
    UTF-8 bytes the ids stand for, counted as they are written."""

    def __init__(self, base: str, n: int, token_bytes: np.ndarray):
        self.token_bytes, self.n_bytes = token_bytes, 0
        self.npy = _NpyWriter(f"{base}.npy", n, ids_dtype(len(token_bytes)))
        self.sha256 = self.npy.sha256
        self.parquet = pq.ParquetWriter(f"{base}.parquet", _IDS_SCHEMA, **_IDS_PARQUET)
        self.pending: list[np.ndarray] = []
        self.n_pending = 0

    def write(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        self.npy.write(ids)
        self.n_bytes += int(self.token_bytes[ids].sum())
        self.pending.append(ids)
        self.n_pending += len(ids)
        if self.n_pending >= ROW_GROUP_IDS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            ids = np.concatenate(self.pending)
            for i in range(0, len(ids), ROW_GROUP_IDS):
                self.parquet.write_table(
                    pa.table({"token_id": pa.array(ids[i : i + ROW_GROUP_IDS])}, schema=_IDS_SCHEMA)
                )
            self.pending, self.n_pending = [], 0

    def close(self) -> None:
        self._flush()
        self.parquet.close()
        self.npy.close()


_IDS_SCHEMA = pa.schema([("token_id", pa.int32())])
# Byte-stream split: ids of a small vocabulary leave the high bytes zero, which zstd then all but
# removes; twice as fast to write as dictionary encoding, a third smaller, and several times
# faster to read (measured in docs/benchmarks/data.md, many files).
_IDS_PARQUET = {"compression": "zstd", "use_dictionary": False, "column_encoding": {"token_id": "BYTE_STREAM_SPLIT"}}


def ids_dtype(n_vocab: int) -> np.dtype:
    """The narrowest dtype that holds every id of a vocabulary: a character vocabulary's ids take
    one byte each, most BPE and word vocabularies' two (training reads them as int64 anyway)."""
    return np.dtype(np.uint8 if n_vocab <= 1 << 8 else np.uint16 if n_vocab <= 1 << 16 else np.int32)


class _NpyWriter:
    """A flat `.npy` of n ids (`dtype`), written front to back, with its sha256."""

    def __init__(self, path: str, n: int, dtype: np.dtype):
        import hashlib
        import io

        self.sha256 = hashlib.sha256()
        header = io.BytesIO()
        self.dtype = np.dtype(dtype)
        np.lib.format.write_array_header_1_0(header, {"descr": self.dtype.str, "fortran_order": False, "shape": (n,)})
        self.f = open(path, "wb")
        self.write_bytes(header.getvalue())

    def write_bytes(self, data: bytes) -> None:
        self.sha256.update(data)
        self.f.write(data)

    def write(self, ids: np.ndarray) -> None:
        self.write_bytes(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "_NpyWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- a corpus of many files: each pack routed on its own, the splits a manifest of the pieces --

PIECES = "pieces.json"


def route_pack(
    pack: str, files: list[str] | None, vocab: Vocab, token_bytes: np.ndarray, cfg: SplitConfig, out: str
) -> dict[str, dict[str, Any]]:
    """The rows of one pack (those of `files`, or all) encoded and routed by their span digest
    (mllm.data.packs.span_owner) to `out/<split>.npy` (ids in `ids_dtype`, what training memory-maps)
    and `out/<split>.parquet` (`token_id: int32`), with each split's row lengths in
    `out/<split>.lengths.npy`. A pack's piece depends on the pack, the vocabulary and the split's
    seed and fractions alone, so a corpus that grows by one file routes one pack, and its splits
    (`assemble`) name the pieces where they lie. Returns {split: {tokens, bytes, rows, sha256}}
    for the splits that got rows, sha256 being that of the piece's .npy."""
    from mllm.data.packs import CorpusPacks, span_owner

    corpus = CorpusPacks([(pack, files)])
    # The .npy header holds its length, so a first pass over the rows' sizes (8 bytes a row,
    # not their tokens) lets the ids be written front to back in one pass, however large the pack.
    totals = np.zeros(len(NAMES), np.int64)
    for table in corpus.tables(["n", "span"]):
        owner = span_owner(table.column("span").to_numpy(), cfg)
        totals += np.bincount(owner, weights=table.column("n").to_numpy(), minlength=len(NAMES)).astype(np.int64)
    fs, path = storage.filesystem(out)
    summary: dict[str, dict[str, Any]] = {}
    with _writing_to(fs, path, "mllm-route-") as (tmp, publish):
        npys: dict[str, _NpyWriter] = {}
        writers: dict[str, Any] = {}
        lengths: dict[str, list[np.ndarray]] = {}
        try:
            for table in corpus.tables(["n", "span", "tokens"]):
                owner = span_owner(table.column("span").to_numpy(), cfg)
                for k in np.unique(owner):
                    name, rows = NAMES[k], table.filter(pa.array(owner == k))
                    ids = vocab.encode_array(pc.list_flatten(rows.column("tokens")))
                    if name not in writers:
                        npys[name] = _NpyWriter(
                            os.path.join(tmp, f"{name}.npy"), int(totals[k]), ids_dtype(len(token_bytes))
                        )
                        writers[name] = pq.ParquetWriter(
                            os.path.join(tmp, f"{name}.parquet"), _IDS_SCHEMA, **_IDS_PARQUET
                        )
                        summary[name] = {"tokens": 0, "bytes": 0, "rows": 0}
                    npys[name].write(ids)
                    writers[name].write_table(pa.table({"token_id": pa.array(ids, pa.int32())}))
                    lengths.setdefault(name, []).append(rows.column("n").to_numpy())
                    s = summary[name]
                    s["tokens"] += len(ids)
                    s["bytes"] += int(token_bytes[ids].sum())
                    s["rows"] += rows.num_rows
        finally:
            for w in [*writers.values(), *npys.values()]:
                w.close()
        for name in writers:
            if summary[name]["tokens"] != totals[NAMES.index(name)]:
                raise ValueError(
                    f"{pack}: its rows' sizes say {totals[NAMES.index(name)]} {name} tokens, "
                    f"their tokens {summary[name]['tokens']}"
                )
            summary[name]["sha256"] = npys[name].sha256.hexdigest()
            np.save(os.path.join(tmp, f"{name}.lengths.npy"), np.concatenate(lengths[name]).astype(np.int64))
            for ext in ("npy", "parquet", "lengths.npy"):
                publish(f"{name}.{ext}")
    storage.write_json(f"{out.rstrip('/')}/{PIECES}", summary)
    return summary


def check_span_sizes(sizes: dict[str, int], n_rows: int, cfg: SplitConfig) -> None:
    """A corpus split span by span needs a span in validation (and test, if asked) and some in training."""
    if sizes.get("val", 0) == 0 or (cfg.test_fraction and sizes.get("test", 0) == 0) or sizes.get("train", 0) < 2:
        missing = "validation" if not sizes.get("val") else "training" if sizes.get("train", 0) < 2 else "test"
        raise UserError(
            f"the corpus has {n_rows} spans of about data.split.span_bytes characters, and none went to {missing}: "
            "give more text, or a smaller data.split.span_bytes"
        )


def assemble(pieces: list[str], n_vocab: int, out: str) -> list[WrittenSplit]:
    """The splits of a corpus from its packs' routed pieces (`route_pack`), in pack order, stored
    as pieces: each split's `<split>.ids.json` names its pieces' ids (.npy) and Parquet files with
    their tokens and sha256s (mllm.runtime.epochs.ChainedIds reads them as one array), and `.offsets.npy`
    holds its row boundaries (every row a piece of text). Nothing of the ids is copied: a grown
    corpus writes these small files again, and its old pieces stay as they were."""
    from mllm.runtime.epochs import CHAIN, chain_digest

    summaries = [storage.read_json(f"{p.rstrip('/')}/{PIECES}") for p in pieces]
    written = []
    for name in NAMES:
        mine = [(p.rstrip("/"), s[name]) for p, s in zip(pieces, summaries) if name in s]
        if not mine:
            continue
        lengths = [np.zeros(1, np.int64)]
        for p, _ in mine:
            lengths.append(np.load(io.BytesIO(storage.read_bytes(f"{p}/{name}.lengths.npy")), allow_pickle=False))
        offsets = np.cumsum(np.concatenate(lengths)).astype(np.int64)
        buf = io.BytesIO()
        np.save(buf, offsets, allow_pickle=False)
        storage.write_bytes(f"{out.rstrip('/')}/{name}.offsets.npy", buf.getvalue())
        digest = chain_digest([s["sha256"] for _, s in mine])
        storage.write_json(
            f"{out.rstrip('/')}/{name}.ids.json",
            {
                "format": CHAIN,
                "dtype": ids_dtype(n_vocab).str,
                "tokens": sum(s["tokens"] for _, s in mine),
                "sha256": digest,
                "pieces": [
                    {
                        "url": f"{p}/{name}.npy",
                        "parquet": f"{p}/{name}.parquet",
                        "tokens": s["tokens"],
                        "sha256": s["sha256"],
                    }
                    for p, s in mine
                ],
            },
        )
        written.append(WrittenSplit(name, sum(s["tokens"] for _, s in mine), sum(s["bytes"] for _, s in mine), digest))
    return written
