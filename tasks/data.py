"""The data stages as Prefect tasks: download, tokenize to Parquet, build the vocabulary, split.

Each stage writes under the storage root in a folder named after a digest of its inputs (the
upstream content digest, the stage's config and the code that does the work), so a re-run with
the same inputs finds its output and two different runs never share one. Prefect's cache uses the
same digest as its key, so a re-run shows these stages as Cached.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import get_run_logger, task
from pydantic import BaseModel

from mllm import UserError, storage, text
from mllm.config import DataConfig, SplitConfig, TokenizerConfig, VocabConfig
from mllm.vocab import Vocab
from tasks import report_progress
from tasks.caching import code_digest, forget_exception, stage_cache, transient

# Token chunks per Parquet row group: large enough for zstd and vectorised reads, small enough
# that a reader holds only a few MB at a time.
ROW_GROUP_CHUNKS = 16
CHUNK_CHARS = 1 << 18
ROW_GROUP_IDS = 1 << 20  # token ids per row group of a split's Parquet file


class RawText(BaseModel):
    source: str
    url: str
    sha256: str
    bytes: int


class Tokens(BaseModel):
    key: str
    url: str  # folder of Parquet files: one row per text chunk, column `tokens: list<string>`
    tokenizer: str  # tokenizer JSON
    n_tokens: int
    n_chunks: int
    raw_sha256: str


class Vocabulary(BaseModel):
    key: str
    url: str
    digest: str
    size: int


class SplitPart(BaseModel):
    parquet: str
    ids: str  # flat int32 .npy, memory-mapped by training
    n_tokens: int
    n_bytes: int  # UTF-8 bytes of the text these tokens stand for: bits per byte need it


class Splits(BaseModel):
    key: str
    url: str
    train: SplitPart
    val: SplitPart
    test: SplitPart | None = None


# --- download ---------------------------------------------------------------------------------


class SourceUnreachable(UserError):
    """The source could not be read for a reason that may pass (network): worth a retry."""

    transient = True


def _describe(source: str) -> str:
    return source if "://" in source else os.path.abspath(source)


def open_source(source: str) -> tuple[Any, str, Any]:
    """Open a corpus for reading: (filesystem, path, file). A missing file is a UserError; a
    network failure is SourceUnreachable, which the download task retries."""
    if not source:
        raise UserError("no data source: pass --source URL (a path, file://, s3:// or https://)")
    if "://" not in source and not os.path.isfile(source):
        raise UserError(f"source file {_describe(source)} not found: check the path")
    try:
        fs, path = storage.filesystem(source)
        return fs, path, fs.open(path, "rb")
    except Exception as e:
        # fsspec's HTTP filesystem reports a refused connection or a failed DNS lookup as
        # FileNotFoundError too; its cause tells them from a real 404.
        cause = e.__cause__ if isinstance(e, FileNotFoundError) else e
        if isinstance(e, FileNotFoundError) and (cause is None or _is_http_status(cause)):
            raise UserError(f"source {source} not found: check the URL or path") from None
        raise SourceUnreachable(
            f"cannot download {source} ({_short(cause)}): pass a local copy with "
            "--source path/to/file.txt (make run SOURCE=path/to/file.txt)"
        ) from None


@task(name="download", on_failure=[forget_exception],
      retries=2, retry_delay_seconds=[1, 3], retry_condition_fn=transient)
def download(source: str, sha256: str | None, root: str) -> RawText:
    """Copy the source into `raw/<sha256>.txt`, checking that it is non-empty UTF-8 text."""
    logger = get_run_logger()
    fs, path, src = open_source(source)
    size = _size(fs, path)
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    n = 0
    tmp = tempfile.NamedTemporaryFile(prefix="mllm-download-", suffix=".txt", delete=False)
    try:
        with src, tmp:
            while True:
                try:
                    block = src.read(1 << 20)
                except Exception as e:
                    raise SourceUnreachable(f"download of {source} broke off ({_short(e)}): try again") from None
                if not block:
                    break
                if b"\x00" in block:
                    raise UserError(f"{source} looks binary (it holds NUL bytes): give a plain-text file")
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    raise UserError(
                        f"{source} is not UTF-8 text (bad byte at offset {n + e.start}): "
                        "convert it, e.g. iconv -f latin1 -t utf-8"
                    ) from None
                digest.update(block)
                tmp.write(block)
                n += len(block)
                report_progress("download", n, size)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise UserError(f"{source} ends in the middle of a UTF-8 character: the file is truncated") from None
        if n == 0:
            raise UserError(f"{source} is empty: give a file with text in it")
        sha = digest.hexdigest()
        if sha256 and sha != sha256:
            raise UserError(
                f"{source} has sha256 {sha}, not the pinned {sha256}: the source changed; "
                "update data.sha256 or remove it"
            )
        url = storage.join(root, "raw", f"{sha}.txt")
        if not storage.exists(url):
            with open(tmp.name, "rb") as f, storage.atomic_open(url) as out:
                shutil.copyfileobj(f, out, 1 << 20)
            storage.write_json(storage.join(root, "raw", f"{sha}.json"),
                               {"source": _describe(source), "sha256": sha, "bytes": n})
        logger.info("source %s: %d bytes, sha256 %s", _describe(source), n, sha[:12])
        return RawText(source=_describe(source), url=url, sha256=sha, bytes=n)
    finally:
        if os.path.exists(tmp.name):
            os.remove(tmp.name)


def _size(fs: Any, path: str) -> int | None:
    try:
        return int(fs.size(path))
    except Exception:  # a server that does not say; the bar then just counts
        return None


def _is_http_status(e: BaseException) -> bool:
    """An answer from the server (404, 403, ...), as opposed to no answer at all."""
    return type(e).__name__ == "ClientResponseError" or getattr(e, "status", None) is not None


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:200]


# --- tokenize ---------------------------------------------------------------------------------


def _tokens_key(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    return storage.digest(["tokens", raw.sha256, cfg.model_dump(), code_digest(text)])


@task(name="tokenize", on_failure=[forget_exception], cache_key_fn=stage_cache(_tokens_key),
      retries=1, retry_condition_fn=transient)
def tokenize(raw: RawText, cfg: TokenizerConfig, root: str) -> Tokens:
    """Stream the raw text through the tokenizer into a Parquet dataset of token chunks."""
    key = _tokens_key(raw, cfg, root)
    url = storage.join(root, "tokens", key)
    if done := _finished(url, Tokens):
        return done

    def chunks():
        stream = text.read_chunks(raw.url, CHUNK_CHARS)
        return text.strip_gutenberg(stream) if cfg.strip_gutenberg else stream

    tokenizer = text.build_tokenizer(cfg, training_chunks=chunks)
    schema = pa.schema([("chunk", pa.int64()), ("tokens", pa.list_(pa.string()))])
    n_tokens = n_chunks = 0
    with storage.staged_dir(url) as out:
        fs, path = storage.filesystem(out)
        with fs.open(f"{path}/part-0.parquet", "wb") as f, pq.ParquetWriter(f, schema, compression="zstd") as w:
            batch: list[list[str]] = []
            for toks in tokenizer.tokenize(chunks()):
                if not toks:
                    continue
                report_progress("tokenize", n_tokens, None)
                batch.append(toks)
                n_tokens += len(toks)
                if len(batch) == ROW_GROUP_CHUNKS:
                    w.write_table(_chunk_table(batch, n_chunks, schema))
                    n_chunks += len(batch)
                    batch = []
            if batch:
                w.write_table(_chunk_table(batch, n_chunks, schema))
                n_chunks += len(batch)
        report_progress("tokenize", n_tokens, n_tokens)
        if n_tokens == 0:
            raise UserError(
                f"no tokens left in {raw.source} after the {cfg.kind} tokenizer's normalisation: "
                "is it the text you meant? (data.tokenizer.normalize=false keeps every character)"
            )
        storage.write_text(storage.join(out, "tokenizer.json"), tokenizer.to_json())
        result = Tokens(key=key, url=url, tokenizer=storage.join(url, "tokenizer.json"),
                        n_tokens=n_tokens, n_chunks=n_chunks, raw_sha256=raw.sha256)
        _manifest(out, result)
    get_run_logger().info("tokenized %s: %d tokens in %d chunks", raw.source, n_tokens, n_chunks)
    return result


def _finished(url: str, kind: type[BaseModel]) -> BaseModel | None:
    """The manifest of a stage output that is already complete, so the stage need not run."""
    if storage.is_complete(url):
        return kind.model_validate(storage.read_json(storage.join(url, "manifest.json")))
    return None


def _manifest(out: str, result: BaseModel) -> None:
    storage.write_json(storage.join(out, "manifest.json"), result.model_dump(mode="json"))


def _chunk_table(batch: list[list[str]], start: int, schema: pa.Schema) -> pa.Table:
    return pa.table({"chunk": pa.array(range(start, start + len(batch)), pa.int64()),
                     "tokens": pa.array(batch, pa.list_(pa.string()))}, schema=schema)


def token_batches(tokens: Tokens):
    """Yield the flat token arrays of each row group: memory bounded by one row group."""
    fs, path = storage.filesystem(tokens.url)
    with fs.open(f"{path}/part-0.parquet", "rb") as f:
        pf = pq.ParquetFile(f)
        for i in range(pf.num_row_groups):
            yield pc.list_flatten(pf.read_row_group(i, columns=["tokens"]).column("tokens"))


# --- vocabulary -------------------------------------------------------------------------------


def _vocab_key(tokens: Tokens, cfg: VocabConfig, root: str) -> str:
    return storage.digest(["vocab", tokens.key, cfg.model_dump(), code_digest(Vocab)])


@task(name="build-vocabulary", on_failure=[forget_exception], cache_key_fn=stage_cache(_vocab_key),
      retries=1, retry_condition_fn=transient)
def build_vocabulary(tokens: Tokens, cfg: VocabConfig, root: str) -> Vocabulary:
    """Count tokens row group by row group, then keep those that pass min_freq and max_size."""
    key = _vocab_key(tokens, cfg, root)
    url = storage.join(root, "vocab", key)
    if done := _finished(url, Vocabulary):
        return done
    counts: dict[str, int] = {}
    for flat in token_batches(tokens):
        vc = pc.value_counts(flat)
        for value, count in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
            counts[value] = counts.get(value, 0) + count
    vocab = Vocab.build(counts, min_freq=cfg.min_freq, max_size=cfg.max_size, specials=cfg.specials)
    result = Vocabulary(key=key, url=storage.join(url, "vocab.json"), digest=vocab.digest, size=len(vocab))
    with storage.staged_dir(url) as out:
        vocab.save(storage.join(out, "vocab.json"))
        _manifest(out, result)
    get_run_logger().info("vocabulary: %d entries from %d distinct tokens", len(vocab), len(counts))
    return result


# --- split ------------------------------------------------------------------------------------


def _split_key(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str) -> str:
    return storage.digest(["split", tokens.key, vocabulary.digest, cfg.model_dump(), code_digest(Vocab)])


def split_plan(n: int, cfg: SplitConfig) -> list[tuple[int, int, str]]:
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
        owner[order[n_val:n_val + n_test]] = 2
        names = ("train", "val", "test")
        plan = [(b * cfg.shuffle_chunk, min(n, (b + 1) * cfg.shuffle_chunk), names[owner[b]])
                for b in range(n_blocks)]
    plan = [seg for seg in plan if seg[1] > seg[0]]
    sizes = _sizes(plan)
    if sizes["train"] < 2 or sizes["val"] < 2 or (cfg.test_fraction and sizes["test"] < 2):
        raise UserError(
            f"the corpus has only {n} tokens: too few for a {cfg.val_fraction:g} validation"
            f"{f' and {cfg.test_fraction:g} test' if cfg.test_fraction else ''} split; give a longer text"
            f"{'' if cfg.contiguous else ' or a smaller split.shuffle_chunk'}"
        )
    return plan


def _sizes(plan: list[tuple[int, int, str]]) -> dict[str, int]:
    sizes = {"train": 0, "val": 0, "test": 0}
    for start, end, name in plan:
        sizes[name] += end - start
    return sizes


@task(name="split", on_failure=[forget_exception], cache_key_fn=stage_cache(_split_key),
      retries=1, retry_condition_fn=transient)
def split(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str) -> Splits:
    """Encode the tokens and route each segment of the plan to its split's arrays."""
    key = _split_key(tokens, vocabulary, cfg, root)
    url = storage.join(root, "splits", key)
    if done := _finished(url, Splits):
        return done
    vocab = Vocab.load(vocabulary.url)
    tokenizer = text.tokenizer_from_json(storage.read_text(tokens.tokenizer))
    token_bytes = _bytes_per_token(vocab, tokenizer)
    plan = split_plan(tokens.n_tokens, cfg)
    sizes = _sizes(plan)
    names = [s for s in ("train", "val", "test") if sizes[s]]
    with storage.staged_dir(url) as out, tempfile.TemporaryDirectory(prefix="mllm-split-") as tmp:
        arrays = {s: np.lib.format.open_memmap(os.path.join(tmp, f"{s}.npy"), mode="w+",
                                               dtype=np.int32, shape=(sizes[s],)) for s in names}
        filled = dict.fromkeys(names, 0)
        segments = iter(plan)
        start, end, name = next(segments)
        pos = 0
        for flat in token_batches(tokens):
            ids = vocab.encode_array(flat)
            while len(ids):
                if pos == end:
                    start, end, name = next(segments)
                take = min(len(ids), end - pos)
                arrays[name][filled[name]:filled[name] + take] = ids[:take]
                filled[name] += take
                pos += take
                ids = ids[take:]
        fs, path = storage.filesystem(out)
        parts = {}
        for s in names:
            arr = arrays.pop(s)
            arr.flush()
            fs.put(os.path.join(tmp, f"{s}.npy"), f"{path}/{s}.npy")
            # Row group by row group, so memory stays at one row group whatever the split's size.
            n_bytes = 0
            schema = pa.schema([("token_id", pa.int32())])
            with fs.open(f"{path}/{s}.parquet", "wb") as f, pq.ParquetWriter(f, schema, compression="zstd") as w:
                for i in range(0, len(arr), ROW_GROUP_IDS):
                    ids = np.asarray(arr[i:i + ROW_GROUP_IDS])
                    w.write_table(pa.table({"token_id": pa.array(ids, pa.int32())}, schema=schema))
                    n_bytes += int(token_bytes[ids].sum())
            parts[s] = SplitPart(parquet=storage.join(url, f"{s}.parquet"), ids=storage.join(url, f"{s}.npy"),
                                 n_tokens=sizes[s], n_bytes=n_bytes)
            del arr
        result = Splits(key=key, url=url, **parts)
        _manifest(out, result)
    get_run_logger().info("split: %s", ", ".join(f"{s} {sizes[s]} tokens" for s in names))
    return result


def _bytes_per_token(vocab: Vocab, tokenizer: Any) -> np.ndarray:
    # Word tokens stand for a word and the space after it.
    extra = 1 if getattr(tokenizer, "kind", "") == "word" else 0
    return np.array([len(tokenizer.detokenize([t]).encode("utf-8")) + extra for t in vocab.itos],
                    dtype=np.int64)
