"""Token packs: the token chunks of a corpus of many files, tokenized once per file and tokenizer, as
spans whose split their content decides."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mllm import storage
from mllm.config import SplitConfig
from mllm.data.files import documents
from mllm.data.text import Tokenizer

PACK_FILE = "part-0.parquet"
COUNTS_FILE = "counts.parquet"
ROWS_PER_GROUP = 64  # rows (spans) per Parquet row group: about 1M characters
_COLUMN = "tokens.list.element"


def group(files: list[tuple[str, int]], target_bytes: int) -> list[list[str]]:
    """Files (sha256, bytes) in groups of about `target_bytes`, in digest order: a file at least
    that large is a group of its own."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for sha, n in sorted(files):
        if current and size + n > target_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(sha)
        size += n
    if current:
        groups.append(current)
    return groups


def pack_key(tokens_key: str, shas: Iterable[str]) -> str:
    return storage.digest(["pack", tokens_key, sorted(shas)])


def _same(a: pa.Array, b: pa.Array | None) -> bool:
    """Whether two dictionaries are one array (pyarrow hands out a new wrapper on each access)."""
    return (
        b is not None
        and len(a) == len(b)
        and all(
            (x.address if x is not None else None) == (y.address if y is not None else None)
            for x, y in zip(a.buffers(), b.buffers())
        )
    )


def span_digest(arr: pa.Array) -> int:
    """A 64-bit digest of a row's tokens: equal text gives equal tokens gives an equal digest."""
    h = hashlib.blake2b(digest_size=8)
    if pa.types.is_dictionary(arr.type):
        h.update(arr.indices.to_numpy(zero_copy_only=False).tobytes())
    else:
        arr = arr.cast(pa.string()) if arr.type != pa.string() else arr
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
        h.update((offsets - offsets[0]).tobytes())
        data = arr.buffers()[2]
        if data is not None:
            h.update(memoryview(data)[offsets[0] : offsets[-1]])
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class PackedFile:
    sha256: str
    rows: int
    tokens: int
    documents: int
    # What the tokenizer's normalisation dropped (Tokenizer.take_loss): characters read, and
    # dropped by character; None where it is not measured.
    chars: int | None = None
    lost: dict[str, int] | None = None


def tokenize_pack(
    files: list[tuple[str, str]], tokenizer: Tokenizer, out: str, strip: bool, span_chars: int
) -> list[PackedFile]:
    """Tokenize the stored files (sha256, url) into `out/part-0.parquet`, one row per span, and
    their token counts into `out/counts.parquet`. Memory: one row group and one file's counts."""
    fs, path = storage.filesystem(out)
    packed: list[PackedFile] = []
    count_rows: dict[str, list] = {"file": [], "token": [], "count": []}
    with fs.open(f"{path}/{PACK_FILE}", "wb") as f:
        writer = _RowWriter(f)
        try:
            tokenizer.take_loss()  # from here on, file by file
            for sha, url in files:
                counts = _Counts()
                rows = tokens = docs = 0
                for doc in documents(url, strip, span_chars):
                    docs += 1
                    for arr in tokenizer.token_arrays(doc):
                        if not len(arr):
                            continue
                        writer.add(sha, arr)
                        counts.add(arr)
                        rows, tokens = rows + 1, tokens + len(arr)
                for token, n in counts.items():
                    count_rows["file"].append(sha)
                    count_rows["token"].append(token)
                    count_rows["count"].append(n)
                loss = tokenizer.take_loss()
                packed.append(PackedFile(sha, rows, tokens, docs, *(loss or (None, None))))
        finally:
            writer.close()
    with fs.open(f"{path}/{COUNTS_FILE}", "wb") as f:
        pq.write_table(
            pa.table(
                {
                    "file": pa.array(count_rows["file"], pa.string()),
                    "token": pa.array(count_rows["token"], pa.string()),
                    "count": pa.array(count_rows["count"], pa.int64()),
                }
            ),
            f,
            compression="zstd",
        )
    return packed


class _Counts:
    """Token counts of one file: per dictionary index where the arrays have one (char, BPE)."""

    def __init__(self) -> None:
        self.by_index: np.ndarray | None = None
        self.dictionary: pa.Array | None = None
        self.by_token: Counter = Counter()

    def add(self, arr: pa.Array) -> None:
        if pa.types.is_dictionary(arr.type):
            if not _same(arr.dictionary, self.dictionary):
                self._fold()
                self.dictionary = arr.dictionary
                self.by_index = np.zeros(len(arr.dictionary), np.int64)
            self.by_index += np.bincount(
                arr.indices.to_numpy(zero_copy_only=False).astype(np.int64), minlength=len(self.by_index)
            )
        else:
            vc = pc.value_counts(arr)
            self.by_token.update(dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())))

    def _fold(self) -> None:
        if self.dictionary is not None:
            values = self.dictionary.to_pylist()
            for i in np.flatnonzero(self.by_index):
                self.by_token[values[i]] += int(self.by_index[i])
        self.dictionary = self.by_index = None

    def items(self) -> list[tuple[str, int]]:
        self._fold()
        return sorted(self.by_token.items())


class _RowWriter:
    def __init__(self, f) -> None:
        self.f, self.writer = f, None
        self.rows: list[tuple[str, pa.Array]] = []

    def add(self, sha: str, arr: pa.Array) -> None:
        self.rows.append((sha, arr))
        if len(self.rows) == ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self.rows and self.writer is not None:
            return
        arrays = [a for _, a in self.rows]
        kind = arrays[0].type if arrays else pa.string()
        lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
        offsets = np.zeros(len(arrays) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        if (
            arrays
            and pa.types.is_dictionary(kind)
            and any(not _same(a.dictionary, arrays[0].dictionary) for a in arrays)
        ):
            arrays = [a.dictionary_decode() for a in arrays]
            kind = pa.string()
        values = pa.concat_arrays(arrays) if arrays else pa.array([], kind)
        table = pa.table(
            {
                "file": pa.array([s for s, _ in self.rows], pa.string()),
                "span": pa.array([span_digest(a) for _, a in self.rows], pa.int64()),
                "n": pa.array(lengths, pa.int64()),
                "tokens": pa.ListArray.from_arrays(pa.array(offsets), values),
            }
        )
        if self.writer is None:
            # As mllm.data.tokens writes its chunks: no stored Arrow schema (readers see list<string>),
            # no statistics.
            self.writer = pq.ParquetWriter(
                self.f, table.schema, compression="zstd", store_schema=False, write_statistics=False
            )
        self.writer.write_table(table)
        self.rows = []

    def close(self) -> None:
        if self.rows or self.writer is None:
            self._flush()
        self.writer.close()


# --- a corpus: its files' rows across packs ------------------------------------------------------


class CorpusPacks:
    """The token rows of a corpus: `packs` is a list of (pack folder, the corpus's files in it,
    or None for all of them), read in that order."""

    def __init__(self, packs: list[tuple[str, list[str] | None]]):
        self.packs = packs

    def tables(self, columns: list[str]) -> Iterator[pa.Table]:
        """The rows of the corpus, row group by row group: `columns` of each (file, span, n, tokens)."""
        for url, files in self.packs:
            fs, path = storage.filesystem(url)
            keep = pa.array(sorted(files), pa.string()) if files is not None else None
            with fs.open(f"{path}/{PACK_FILE}", "rb") as f:
                pf = pq.ParquetFile(f, read_dictionary=[_COLUMN] if "tokens" in columns else None)
                for i in range(pf.num_row_groups):
                    table = pf.read_row_group(i, columns=columns + (["file"] if keep is not None else []))
                    if keep is not None:
                        table = table.filter(pc.is_in(table.column("file"), value_set=keep))
                    if table.num_rows:
                        yield table

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's token count and span digest, in reading order."""
        n, spans = [], []
        for t in self.tables(["n", "span"]):
            n.append(t.column("n").to_numpy())
            spans.append(t.column("span").to_numpy())
        if not n:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(n).astype(np.int64), np.concatenate(spans).astype(np.int64)

    def batches(self) -> Iterator[pa.ChunkedArray]:
        """The tokens of each row group, flat (dictionary-encoded where the packs are)."""
        for t in self.tables(["tokens"]):
            yield pc.list_flatten(t.column("tokens"))

    def piece_starts(self) -> np.ndarray:
        lengths, _ = self.rows()
        return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths

    def counts(self) -> dict[str, int]:
        """Token counts of the corpus: the sum of its files' counts."""
        total: Counter = Counter()
        for url, files in self.packs:
            fs, path = storage.filesystem(url)
            with fs.open(f"{path}/{COUNTS_FILE}", "rb") as f:
                table = pq.read_table(f)
            if files is not None:
                table = table.filter(pc.is_in(table.column("file"), value_set=pa.array(sorted(files), pa.string())))
            grouped = table.group_by("token").aggregate([("count", "sum")])
            total.update(dict(zip(grouped.column("token").to_pylist(), grouped.column("count_sum").to_pylist())))
        return dict(total)


# --- stable splits ---------------------------------------------------------------------------


def span_owner(spans: np.ndarray, cfg: SplitConfig) -> np.ndarray:
    """0 (train), 1 (val) or 2 (test) for each span digest: a seeded hash of the digest alone
    (splitmix64), so a span's split never depends on what else is in the corpus."""
    with np.errstate(over="ignore"):
        z = spans.astype(np.uint64) ^ np.uint64((cfg.seed * 0x9E3779B97F4A7C15) % (1 << 64))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    owner = np.zeros(len(spans), np.int8)
    owner[u < cfg.val_fraction + cfg.test_fraction] = 2
    owner[u < cfg.val_fraction] = 1
    return owner
