"""A corpus of many files: which files a source names (hidden files and other tools' markers left
out), what format each is in, and its documents."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from mllm import UserError, storage
from mllm.data.corpus import BLOCK, SourceUnreachable, TextDecoder, _decompressed, describe, open_source, short
from mllm.data.text import read_chunks, strip_gutenberg

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd")
_JSONL = (".jsonl", ".ndjson", ".json")
_PARQUET = (".parquet", ".pq")
_GLOB = set("*?[")
DOCS_PER_ROW_GROUP = 4096


@dataclass(frozen=True)
class SourceFile:
    url: str  # what to open: a local path or a URL, credentials already taken out
    size: int | None
    format: str  # text | jsonl | parquet
    # What the listing says of its version (modified time, ETag): with the size, a re-run that
    # finds both unchanged need not read the file again. None where the filesystem says nothing.
    stamp: str | None = None

    @property
    def name(self) -> str:
        return describe(self.url)


def file_format(name: str) -> str:
    """text, jsonl or parquet, by the name's extension (after a compression extension)."""
    base = name.lower()
    for ext in COMPRESSED:
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    if base.endswith(_JSONL):
        return "jsonl"
    if base.endswith(_PARQUET):
        return "parquet"
    return "text"


# What writers of data sets leave beside their output: Hadoop's job markers and temporary folder,
# Parquet's summary files, Spark's streaming sink log, Databricks' transactional commit markers
# (`_started_<txn>`, `_committed_<txn>`, `_committed_vacuum<txn>`) and Delta Lake's log.
MARKERS = frozenset(
    {"_SUCCESS", "_metadata", "_common_metadata", "_temporary", "_logs", "_spark_metadata", "_delta_log"}
)
MARKER_PREFIXES = ("_started_", "_committed_")


def _marker(part: str) -> bool:
    return part.startswith(".") or part in MARKERS or part.startswith(MARKER_PREFIXES)


def _hidden(relative: str, named: tuple[str, ...] = ()) -> bool:
    """Whether a file at `relative` (to its source) is hidden or a marker: a part of its path is,
    and no part of the glob (`named`) that matched it names such a name."""
    return any(
        _marker(part) and not any(fnmatch.fnmatchcase(part, n) for n in named) for part in relative.split("/") if part
    )


def list_files(sources: list[str]) -> tuple[list[SourceFile], list[str]]:
    """The files the sources name, in a stable order and each once, and the hidden files and
    markers that were skipped. A source that names no file is a UserError."""
    found: dict[str, SourceFile] = {}
    skipped: list[str] = []
    for source in sources:
        files, hidden = _list_one(source)
        skipped += hidden
        for f in files:
            found.setdefault(f.url, f)
    return [found[u] for u in sorted(found)], skipped


def _list_one(source: str) -> tuple[list[SourceFile], list[str]]:
    if not source:
        raise UserError("no data source: pass --source URL (a path, folder, glob, file://, s3:// or https://)")
    if source.startswith(("http://", "https://")):  # HTTP has no listing: one file
        return [SourceFile(source, None, file_format(source))], []
    try:
        fs, path = storage.filesystem(source)
        local = "://" not in source or source.startswith("file://")
        if _GLOB & set(path):
            infos = fs.glob(path, detail=True)
            if not infos:
                raise UserError(f"source glob {source} matches no file: check the pattern (** matches any depth)")
            base = path[: min(path.find(c) for c in _GLOB if c in path)].rsplit("/", 1)[0]
            named = tuple(p for p in path[len(base) :].split("/") if p.startswith((".", "_")))
        elif fs.isdir(path):
            fs.invalidate_cache(path)  # s3fs caches listings; files may have landed since
            infos = fs.find(path, detail=True)
            base, named = path.rstrip("/"), ()
            if not infos:
                raise UserError(
                    f"source folder {describe(source)} holds no files: put the corpus files in it, "
                    "or give a file or a glob"
                )
        else:
            if not fs.exists(path):
                open_source(source)[2].close()  # says what it is: not found, a link loop, refused...
                raise UserError(f"source {describe(source)} not found: check the path or URL")
            info = fs.info(path)
            return [SourceFile(source, _size(info), file_format(path), _stamp(info))], []
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (any filesystem's own network errors)
        if credentials := storage.credentials_problem(e, source):
            raise UserError(credentials) from None  # no retry mends it
        if isinstance(e, PermissionError):
            raise UserError(
                f"source {source} cannot be listed ({short(e)}): check its credentials "
                "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3://)"
            ) from None
        raise SourceUnreachable(
            f"cannot list {source} ({short(e)}): check that it is reachable, then run the same command again"
        ) from None
    files, hidden = [], []
    for p, info in sorted(infos.items()):
        if info.get("type") == "directory":
            continue
        url = p if local else fs.unstrip_protocol(p)
        if _hidden(p[len(base) :], named):
            hidden.append(describe(url))
        else:
            files.append(SourceFile(url, _size(info), file_format(p), _stamp(info)))
    if not files:
        raise UserError(
            f"source {describe(source)} holds only hidden or marker files ({', '.join(hidden[:3])}"
            f"{', ...' if len(hidden) > 3 else ''}): give the folder of the corpus files"
        )
    return files, hidden


def _stamp(info: dict[str, Any]) -> str | None:
    """A file's version as its listing gives it: local mtime (ns), an object's ETag and time."""
    parts = [str(info[k]) for k in ("mtime", "ETag", "LastModified", "last_modified", "etag") if info.get(k)]
    return "|".join(parts) or None


def _size(info: dict[str, Any]) -> int | None:
    size = info.get("size")
    return int(size) if size is not None else None


# --- records: JSON Lines and Parquet ------------------------------------------------------------


@dataclass
class Records:
    source: str
    url: str  # the stored documents, raw/<sha256>.parquet
    sha256: str  # of the source's bytes as they are
    bytes: int
    documents: int
    compression: str | None = None


def download_records(source: str, fmt: str, text_field: str, dest: Callable[[str], str] | None) -> Records:
    """Check a JSONL or Parquet file and store its documents (the `text_field` of each record,
    empty ones left out) as Parquet at `dest(sha256)`. Nothing is stored unless every record
    passed: a line that is not JSON, a record without the field, or a field that is not text is a
    UserError naming the file and the line."""
    fs, path, src = open_source(source)
    digest = hashlib.sha256()
    n = 0
    with tempfile.TemporaryDirectory(prefix="mllm-records-") as tmp:
        raw_path, docs_path = os.path.join(tmp, "raw"), os.path.join(tmp, "docs.parquet")
        with src, open(raw_path, "wb") as raw:
            while True:
                try:
                    block = src.read(BLOCK)
                except Exception as e:  # noqa: BLE001 (any reader's failure mid-stream: the download broke off)
                    raise SourceUnreachable(f"download of {source} broke off ({short(e)}): try again") from None
                if not block:
                    break
                digest.update(block)
                n += len(block)
                raw.write(block)
        if n == 0:
            raise UserError(f"{source} is empty: give a file with records in it")
        texts = (
            _jsonl_texts(source, raw_path, text_field)
            if fmt == "jsonl"
            else _parquet_texts(source, raw_path, text_field)
        )
        compression = next(texts) if fmt == "jsonl" else None
        documents = _write_documents(texts, docs_path)
        if documents == 0:
            raise UserError(
                f"{source} holds no text in its {text_field!r} field: is data.text_field the "
                "column that holds the documents?"
            )
        sha = digest.hexdigest()
        url = dest(sha) if dest else ""
        if dest and not storage.exists(url):
            with open(docs_path, "rb") as f, storage.atomic_open(url) as out:
                shutil.copyfileobj(f, out, BLOCK)
    return Records(describe(source), url, sha, n, documents, compression)


def _write_documents(texts: Iterator[str], path: str) -> int:
    schema = pa.schema([("text", pa.large_string())])
    n = 0
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        batch: list[str] = []
        for t in texts:
            if t.strip():
                batch.append(t)
            if len(batch) == DOCS_PER_ROW_GROUP:
                w.write_table(pa.table({"text": pa.array(batch, pa.large_string())}))
                n, batch = n + len(batch), []
        if batch:
            w.write_table(pa.table({"text": pa.array(batch, pa.large_string())}))
            n += len(batch)
    return n


def _jsonl_texts(source: str, path: str, field: str) -> Iterator[Any]:
    """First the compression found (or None), then the text of each record."""
    with open(path, "rb") as f:
        read, compression = _decompressed(source, f.read)
        yield compression
        decoder, carry, line_no = TextDecoder(source), "", 0
        while True:
            block = read(BLOCK)
            text = carry + decoder.decode(block, final=not block)
            lines = text.split("\n")
            carry = lines.pop() if block else ""
            for line in lines:
                line_no += 1
                if line.strip():
                    yield _record_text(source, line_no, line, field)
            if not block:
                return


def _record_text(source: str, line_no: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{source} line {line_no} is not JSON ({e.msg}): fix the line, or set "
            "data.bad_files=skip to leave the file out"
        ) from None
    if not isinstance(record, dict) or field not in record:
        raise UserError(
            f"{source} line {line_no} has no {field!r} field: set data.text_field to the field that holds the text"
        )
    value = record[field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(
            f"{source} line {line_no}: field {field!r} holds {type(value).__name__}, not text: "
            "set data.text_field to the field that holds the text"
        )
    return value


def _parquet_texts(source: str, path: str, field: str) -> Iterator[str]:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001  (pyarrow's ArrowInvalid and friends)
        raise UserError(f"{source} is not a readable Parquet file ({short(e)}): download it again") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise UserError(
            f"{source} has no column {field!r} (it has {', '.join(names[:8])}): set "
            "data.text_field to the column that holds the text"
        )
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(
            f"{source}: column {field!r} is {kind}, not text: set data.text_field to the column that holds the text"
        )
    for batch in pf.iter_batches(columns=[field], batch_size=DOCS_PER_ROW_GROUP):
        for value in batch.column(0).to_pylist():
            if value:
                yield value


# --- reading stored documents ------------------------------------------------------------------


def documents(url: str, strip: bool, chunk_chars: int) -> Iterator[Iterator[str]]:
    """The documents of a stored file, each a stream of text chunks of about `chunk_chars`:
    a `.txt` is one document, a `.parquet` one per row. Project Gutenberg headers and licences
    are dropped from each when `strip`."""
    if url.endswith(".parquet"):
        fs, path = storage.filesystem(url)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            for i in range(pf.num_row_groups):
                for text in pf.read_row_group(i, columns=["text"]).column(0).to_pylist():
                    chunks = (text[j : j + chunk_chars] for j in range(0, len(text), chunk_chars))
                    yield strip_gutenberg(chunks) if strip else chunks
        return
    chunks = read_chunks(url, chunk_chars)
    yield strip_gutenberg(chunks) if strip else chunks
