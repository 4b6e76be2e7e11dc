"""Token chunks on disk: tokenize a text into Parquet, read it back row group by row group, count."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mllm import UserError, storage
from mllm.config import TokenizerConfig
from mllm.data import text

CHUNK_CHARS = 1 << 18  # characters read at a time: bounds the memory of the whole stage
# Token arrays per Parquet row group: large enough for zstd and vectorised reads, small enough
# that a reader holds only a few MB at a time.
ROW_GROUP_CHUNKS = 16
FILE = "part-0.parquet"
_COLUMN = "tokens.list.element"  # the Parquet path of the token strings inside the list column


def text_chunks(raw_url: str, strip_gutenberg: bool) -> Iterator[str]:
    """The text a tokenizer sees: the raw text in chunks, Gutenberg headers and licences gone."""
    chunks = text.read_chunks(raw_url, CHUNK_CHARS)
    return text.strip_gutenberg(chunks) if strip_gutenberg else chunks


def tokenize_text(
    raw_url: str, cfg: TokenizerConfig, out: str, source: str = "", progress: Callable[[int], None] | None = None
) -> tuple[text.Tokenizer, int, int]:
    """Tokenize the text at `raw_url` into `out/part-0.parquet`: (tokenizer, n_tokens, n_chunks).

    BPE first learns its merges from the same text (a second pass over it). A text that leaves
    no tokens at all is a UserError: the normalisation dropped everything.
    """
    tokenizer = text.build_tokenizer(cfg, training_chunks=lambda: text_chunks(raw_url, cfg.strip_gutenberg))
    n_tokens, n_chunks = write_chunks(tokenizer.token_arrays(text_chunks(raw_url, cfg.strip_gutenberg)), out, progress)
    if n_tokens == 0:
        raise UserError(
            f"no tokens left in {source or raw_url} after the {cfg.kind} tokenizer's normalisation: "
            "is it the text you meant? (data.tokenizer.normalize=false keeps every character)"
        )
    return tokenizer, n_tokens, n_chunks


def write_chunks(
    arrays: Iterator[pa.Array], out: str, progress: Callable[[int], None] | None = None
) -> tuple[int, int]:
    """Write token arrays as rows of `out/part-0.parquet`, ROW_GROUP_CHUNKS to a row group."""
    fs, path = storage.filesystem(out)
    n_tokens = n_chunks = 0
    writer = None
    batch: list[pa.Array] = []
    with fs.open(f"{path}/{FILE}", "wb") as f:
        try:
            for arr in arrays:
                if not len(arr):
                    continue
                batch.append(arr)
                n_tokens += len(arr)
                if len(batch) == ROW_GROUP_CHUNKS:
                    writer = _write(writer, f, batch, n_chunks)
                    n_chunks += len(batch)
                    batch = []
                if progress:
                    progress(n_tokens)
            if batch or writer is None:
                writer = _write(writer, f, batch, n_chunks)
                n_chunks += len(batch)
        finally:
            if writer is not None:
                writer.close()
    return n_tokens, n_chunks


def _write(writer: pq.ParquetWriter | None, f, batch: list[pa.Array], start: int) -> pq.ParquetWriter:
    kind = batch[0].type if batch else pa.string()
    lengths = np.fromiter((len(a) for a in batch), dtype=np.int64, count=len(batch))
    offsets = np.zeros(len(batch) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.concat_arrays(batch) if batch else pa.array([], kind)
    table = pa.table(
        {
            "chunk": pa.array(np.arange(start, start + len(batch), dtype=np.int64)),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), values),
        }
    )
    if writer is None:
        # store_schema=False: the Arrow schema would bring the dictionary type back on reading;
        # readers see plain list<string> and ask for the dictionary only where it helps.
        # No statistics: min/max of a token column helps no reader and costs a pass over it.
        writer = pq.ParquetWriter(f, table.schema, compression="zstd", store_schema=False, write_statistics=False)
    writer.write_table(table)
    return writer


def token_batches(folder: str) -> Iterator[pa.ChunkedArray]:
    """The tokens of each row group, flat: memory bounded by one row group. The arrays are
    dictionary-encoded (indices into the row group's distinct tokens)."""
    fs, path = storage.filesystem(folder)
    with fs.open(f"{path}/{FILE}", "rb") as f:
        pf = pq.ParquetFile(f, read_dictionary=[_COLUMN])
        for i in range(pf.num_row_groups):
            yield pc.list_flatten(pf.read_row_group(i, columns=["tokens"]).column("tokens"))


def piece_starts(folder: str) -> np.ndarray:
    """Where each piece (a row: a chunk of text, or a paragraph for basic_english) starts in the
    flat token sequence, read from the list lengths alone."""
    fs, path = storage.filesystem(folder)
    lengths = []
    with fs.open(f"{path}/{FILE}", "rb") as f:
        pf = pq.ParquetFile(f, read_dictionary=[_COLUMN])
        for i in range(pf.num_row_groups):
            column = pf.read_row_group(i, columns=["tokens"]).column("tokens")
            lengths.append(pc.list_value_length(column).to_numpy(zero_copy_only=False))
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def count_tokens(folder: str) -> dict[str, int]:
    """How often each distinct token occurs in the dataset."""
    counts: dict[str, int] = {}
    for flat in token_batches(folder):
        for arr in flat.chunks:
            if pa.types.is_dictionary(arr.type):
                # A row group's distinct tokens are few: count indices, not strings.
                indices = arr.indices.to_numpy(zero_copy_only=False)
                per = np.bincount(indices, minlength=len(arr.dictionary))
                values = arr.dictionary.to_pylist()
                pairs = ((values[i], int(per[i])) for i in np.flatnonzero(per))
            else:
                vc = pc.value_counts(arr)
                pairs = zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())
            for value, count in pairs:
                counts[value] = counts.get(value, 0) + count
    return counts
