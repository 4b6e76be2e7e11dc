"""The data stages of a source of many files: list it, download each file, tokenize each new file,
as Prefect tasks mapped over the files on the prepare flow's task runner (a process pool by
default, a Dask cluster with `data.task_runner: dask://HOST:PORT`).

The per-file work is plain functions in `mllm` (files, packs); here is what makes it stages:
where each output lives, cache keys, what is reused. A source that is one text file goes the
single-file way of `tasks.data` (download, tokenize), exactly as it always did.

    raw = download_source(cfg.data, root)         # RawText: one file, or the corpus manifest
    tokens = tokenize_source(raw, cfg.data, root)  # Tokens: one folder, or the corpus's packs
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from prefect import get_run_logger, task, unmapped
from pydantic import BaseModel

from mllm import UserError, storage
from mllm.data import corpus, files, gutenberg, packs, text
from mllm.config import DataConfig, TokenizerConfig
from tasks import NOTICE, assets
from tasks.caching import code_digest, forget_exception, stage_cache, transient
from tasks.data import RawText, Tokens, download, tokenize

PACK_BYTES = 32 << 20  # text per pack of small files: a new file re-tokenizes at most this much


class FileRecord(BaseModel):
    source: str  # where it came from (no credentials)
    sha256: str = ""  # of its bytes as they were
    bytes: int = 0
    format: str = "text"
    documents: int = 0
    url: str = ""  # the stored copy: raw/<sha256>.txt or raw/<sha256>.parquet
    skipped: str | None = None  # why the file was left out (data.bad_files: skip)
    stored_bytes: int | None = None  # of the stored copy: a copy of another size was changed in storage
    stamp: str | None = None  # the source's version as listed (mtime, ETag): see files.SourceFile

    @property
    def key(self) -> str:
        return file_key(self.url, self.sha256)


def file_key(url: str, sha256: str) -> str:
    """A file's identity in a corpus, as its stored copy is named: the sha256 of its bytes, and for
    JSONL or Parquet a digest of the text field its documents came from (`<sha256>-<field>`)."""
    return url.rsplit("/", 1)[-1].split(".", 1)[0] if url else sha256


class PackSpec(BaseModel):
    key: str
    url: str
    files: list[tuple[str, str]]  # (sha256, stored url) of each file in the pack


# --- download -----------------------------------------------------------------------------------


@task(name="list-source", retries=2, retry_delay_seconds=[1, 3], retry_condition_fn=transient)
def list_source(sources: list[str]) -> list[files.SourceFile]:
    found, hidden = files.list_files(sources)
    if hidden:
        shown = ", ".join(hidden[:5]) + (f" and {len(hidden) - 5} more" if len(hidden) > 5 else "")
        get_run_logger().info("skipped %d hidden or marker files: %s", len(hidden), shown, extra=NOTICE)
    return found


@task(name="download-files", retries=2, retry_delay_seconds=[1, 3], retry_condition_fn=transient)
def download_files(batch: list[files.SourceFile], text_field: str, bad_files: str, root: str) -> list[FileRecord]:
    """Check files of the source and store each under `raw/` by the sha256 of its bytes (a batch
    of files a task run: a task run costs Prefect's bookkeeping, a small file far less)."""
    return [_download_file(f, text_field, bad_files, root) for f in batch]


def _download_file(f: files.SourceFile, text_field: str, bad_files: str, root: str) -> FileRecord:
    try:
        if f.format == "text":
            got = corpus.download(f.url, lambda sha: storage.join(root, "raw", f"{sha}.txt"))
            if got.repaired:
                get_run_logger().warning("the stored copy %s of %s had changed in storage: written again", got.url,
                                         got.source)
            record = FileRecord(source=got.source, sha256=got.sha256, bytes=got.bytes, documents=1, url=got.url)
        else:
            # The documents are those of one field: another field of the same file is another copy.
            field = storage.digest(text_field)[:8]
            rec = files.download_records(f.url, f.format, text_field,
                                         lambda sha: storage.join(root, "raw", f"{sha}-{field}.parquet"))
            record = FileRecord(source=rec.source, sha256=rec.sha256, bytes=rec.bytes, format=f.format,
                                documents=rec.documents, url=rec.url)
        fs, path = storage.filesystem(record.url)
        return record.model_copy(update={"stored_bytes": int(fs.size(path)), "stamp": f.stamp})
    except UserError as e:
        if bad_files != "skip" or getattr(e, "transient", False):
            raise
        get_run_logger().warning("skipped %s: %s", f.name, e)
        return FileRecord(source=f.name, format=f.format, skipped=str(e))


def corpus_digest(shas: list[str]) -> str:
    """The corpus's digest: of its files' sorted digests (the same bytes under two names count once)."""
    return storage.sha256_bytes("\n".join(sorted(set(shas))).encode())


@task(name="record-corpus", retries=1, retry_condition_fn=transient)
def record_corpus(records: list[FileRecord], sources: list[str], sha256: str | None, root: str) -> RawText:
    """The corpus manifest, `corpora/<digest>.json`: every file with its source, bytes, digest and
    documents, and the files left out."""
    kept = {r.key: r for r in sorted(records, key=lambda r: (r.key, r.source)) if not r.skipped}
    skipped = [r for r in records if r.skipped]
    if not kept:
        raise UserError(f"no usable file in {', '.join(sources)}: all {len(records)} were left out "
                        f"({skipped[0].source}: {skipped[0].skipped})")
    digest = corpus_digest(list(kept))
    if sha256 and sha256 != digest:
        raise UserError(f"the corpus has digest {digest}, not the pinned {sha256}: its files changed; update "
                        "data.sha256 or remove it")
    url = storage.join(root, "corpora", f"{digest}.json")
    # The same bytes under another name: one file, named by the first source in order.
    doc = {"digest": digest, "sources": sources, "files": [r.model_dump() for r in kept.values()],
           "skipped": [{"source": r.source, "reason": r.skipped} for r in skipped]}
    if not storage.exists(url):
        storage.write_json(url, doc)
    total = sum(r.bytes for r in kept.values())
    assets.materializes(url, reads=[r.source for r in kept.values()][:50], name="corpus manifest")
    assets.describe(url, digest=digest, files=len(kept), bytes=total, skipped=len(skipped))
    get_run_logger().info("corpus %s: %d files, %d bytes%s", digest[:12], len(kept), total,
                          f", {len(skipped)} left out" if skipped else "")
    source = sources[0] if len(sources) == 1 else f"{sources[0]} and {len(sources) - 1} more"
    # The corpus these sources gave last time, for what changed since (then this one's).
    last_url = storage.join(root, "corpora", f"last-{storage.digest(sources)}.json")
    previous = storage.read_json(last_url)["digest"] if storage.exists(last_url) else None
    storage.write_json(last_url, {"digest": digest})
    return RawText(source=source, url=url, sha256=digest, bytes=total, files=len(kept), manifest=url,
                   skipped=[f"{r.source}: {r.skipped}" for r in skipped], previous=previous)


def download_source(d: DataConfig, root: str) -> RawText:
    """The download stage for any source: one text file as it always was; many files (or JSONL
    and Parquet) listed, each downloaded as a mapped task, and recorded in a corpus manifest."""
    sources = d.sources
    found = list_source(sources)
    if len(found) == 1 and found[0].format == "text":
        return download(found[0].url, d.sha256, root)
    # What was read depends on the text field too (a JSONL file's documents are that field's).
    index_url = storage.join(root, "corpora", f"seen-{storage.digest([sources, d.text_field])}.json")
    known = _known(index_url, root) if not d.sha256 else {}  # a pinned corpus is read whole, always
    todo = [f for f in found if _quick_key(f) not in known]
    batches = _batches(todo, len(os.sched_getaffinity(0)))
    made = fan_out(download_files, batches, sum(f.size or 0 for f in todo), d.task_runner, d.text_field,
                   d.bad_files, root)
    fresh = [r for batch in made for r in batch]
    records = [known[_quick_key(f)] for f in found if _quick_key(f) in known] + fresh
    if fresh:
        get_run_logger().info("read %d files of %d (the others' size and time are as when last read)", len(todo),
                              len(found))
        seen = dict(known)
        for r in fresh:
            if not r.skipped and (key := _quick_key(r)):
                seen[key] = r
        storage.write_json(index_url, {k: r.model_dump() for k, r in seen.items()})
    return record_corpus(records, sources, d.sha256, root)


def _quick_key(f: files.SourceFile | FileRecord) -> str | None:
    """What says a file is unchanged without reading it: its name, size and listed version
    (rsync's quick check). None where the listing gives no version (HTTP): always read."""
    name = f.url if isinstance(f, files.SourceFile) else f.source
    size = f.size if isinstance(f, files.SourceFile) else f.bytes
    return f"{files.describe(name)}|{size}|{f.stamp}" if f.stamp else None


def _known(index_url: str, root: str) -> dict[str, FileRecord]:
    """The files read before from these sources whose stored copies are still there, whole (their
    size checked against one listing of raw/; a copy changed in storage is read again)."""
    if not storage.exists(index_url):
        return {}
    fs, path = storage.filesystem(storage.join(root, "raw"))
    fs.invalidate_cache(path)
    try:
        stored = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return {}
    known = {}
    for k, r in storage.read_json(index_url).items():
        rec = FileRecord.model_validate(r)
        if stored.get(rec.url.rsplit("/", 1)[-1]) == rec.stored_bytes:
            known[k] = rec
    return known


def _batches(found: list[files.SourceFile], workers: int) -> list[list[files.SourceFile]]:
    """Files in batches for the download tasks: a few per worker (so they share the work
    evenly), none over PACK_BYTES or 500 files."""
    total = sum(f.size or 1 for f in found)
    target = max(min(PACK_BYTES, total // (4 * workers)), 1)
    out: list[list[files.SourceFile]] = []
    size = 0
    for f in found:
        if not out or size + (f.size or 1) > target or len(out[-1]) >= 500:
            out.append([])
            size = 0
        out[-1].append(f)
        size += f.size or 1
    return out


SMALL_BYTES = 64 << 20  # less work than this is done in the flow's process: a pool's start costs more


def fan_out(stage: Any, items: list[Any], work_bytes: int, runner: str, *args: Any) -> list[Any]:
    """`stage` over `items` (one task run each) on the flow's task runner; a little work on the
    default runner runs in this process instead, one item after another."""
    if runner == "processes" and work_bytes < SMALL_BYTES:
        return [stage(item, *args) for item in items]
    with _this_server():
        return stage.map(items, *[unmapped(a) for a in args]).result()


@contextlib.contextmanager
def _this_server() -> Iterator[None]:
    """Workers (a process pool's, a Dask cluster's) report their task runs to this flow's Prefect
    server. Prefect's temporary server is known to this process only: each worker would start a
    server of its own (seconds each, and runs recorded nowhere). Both runners hand the current
    settings on to their workers, so the server's address goes there."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = PREFECT_API_URL.value()
    if not url:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            url = str(client.api_url).rstrip("/")
    if not url.startswith("http"):
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


def manifest_files(raw: RawText) -> list[FileRecord]:
    return [FileRecord.model_validate(f) for f in storage.read_json(raw.manifest)["files"]]


# --- tokenize -----------------------------------------------------------------------------------


def _sample(records: list[FileRecord], cap: int) -> list[tuple[FileRecord, int]]:
    """The BPE training sample: whole files in digest order up to `cap` bytes, the last one cut."""
    out, left = [], cap
    for r in sorted(records, key=lambda r: r.key):
        if left <= 0:
            break
        out.append((r, min(r.bytes, left)))
        left -= r.bytes
    return out


def _sample_key(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    sample = [(r.key, n) for r, n in _sample(manifest_files(raw), cfg.train_bytes)]
    return storage.digest(["bpe", sample, cfg.model_dump(exclude={"train_bytes"}), code_digest(files, text, gutenberg)])


def _sample_chunks(sample: list[tuple[FileRecord, int]], strip: bool):
    for r, n in sample:
        for doc in files.documents(r.url, strip, 1 << 16):
            for chunk in doc:
                if n <= 0:
                    break
                yield chunk[:n]
                n -= len(chunk)
            if n <= 0:
                break


@task(name="train-tokenizer", on_failure=[forget_exception], cache_key_fn=stage_cache(_sample_key),
      retries=1, retry_condition_fn=transient)
def train_tokenizer(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    """A BPE tokenizer trained on the corpus's sample (`data.tokenizer.train_bytes`): the same
    sample gives the same tokenizer, so a corpus that grows outside it keeps its tokens."""
    key = _sample_key(raw, cfg, root)
    url = storage.join(root, "tokenizers", key)
    if not storage.is_complete(url):
        sample = _sample(manifest_files(raw), cfg.train_bytes)
        tok = text.BpeTokenizer.train(_sample_chunks(sample, cfg.strip_gutenberg), cfg.bpe_vocab_size, cfg.normalize)
        with storage.staged_dir(url) as out:
            storage.write_text(storage.join(out, "tokenizer.json"), tok.to_json())
        get_run_logger().info("BPE tokenizer trained on %d files, %d bytes (sample %s)", len(sample),
                              sum(n for _, n in sample), key)
    return storage.join(url, "tokenizer.json")


def _pack_key(pack: PackSpec, tokenizer: str, cfg: TokenizerConfig, span_bytes: int) -> str:
    return pack.key


@task(name="tokenize-pack", on_failure=[forget_exception], cache_key_fn=stage_cache(_pack_key),
      retries=1, retry_condition_fn=transient)
def tokenize_pack(pack: PackSpec, tokenizer: str, cfg: TokenizerConfig, span_bytes: int) -> dict[str, Any]:
    """Tokenize the files of one pack; a pack already in storage is read, not made again."""
    if storage.is_complete(pack.url):
        return storage.read_json(storage.join(pack.url, "manifest.json"))
    tok = text.tokenizer_from_json(storage.read_text(tokenizer), source=tokenizer)
    with storage.staged_dir(pack.url) as out:
        packed = packs.tokenize_pack(pack.files, tok, out, cfg.strip_gutenberg, span_bytes)
        result = {"key": pack.key, "url": pack.url, "files": {p.sha256: {"rows": p.rows, "tokens": p.tokens,
                                                                        "documents": p.documents} for p in packed}}
        storage.write_json(storage.join(out, "manifest.json"), result)
    n = sum(p.tokens for p in packed)
    assets.materializes(pack.url, reads=[u for _, u in pack.files][:50], name="token pack")
    get_run_logger().info("tokenized %d files into pack %s: %d tokens", len(packed), pack.key, n)
    return result


def _existing_packs(folder: str) -> dict[str, dict[str, Any]]:
    """The packs a tokenizer has written under `folder`, by the files in them."""
    fs, path = storage.filesystem(folder)
    fs.invalidate_cache(path)
    found: dict[str, dict[str, Any]] = {}
    if not fs.exists(path):
        return found
    for entry in sorted(fs.ls(path, detail=False)):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        url = storage.join(folder, name)
        if name.startswith("pack-") and storage.is_complete(url):
            manifest = storage.read_json(storage.join(url, "manifest.json"))
            for sha in manifest["files"]:
                found.setdefault(sha, manifest)
    return found


def _tokens_key(raw: RawText, cfg: TokenizerConfig, span_bytes: int, tokenizer: str) -> str:
    what = cfg.model_dump(exclude={"train_bytes"})
    return storage.digest(["corpus-tokens", what, span_bytes, tokenizer, code_digest(files, packs, text, corpus, gutenberg)])


def tokenize_source(raw: RawText, d: DataConfig, root: str) -> Tokens:
    """The tokenize stage: one text file as it always was; a corpus file by file, each file's
    tokens made once per tokenizer and reused by every corpus that holds it."""
    if raw.manifest is None:
        return tokenize(raw, d.tokenizer, root)
    cfg = d.tokenizer
    records = manifest_files(raw)
    if cfg.kind == "bpe":
        tokenizer = train_tokenizer(raw, cfg, root)
        tok_id = tokenizer.rsplit("/", 2)[-2]
    else:
        tokenizer, tok_id = "", cfg.kind
    key = _tokens_key(raw, cfg, d.split.span_bytes, tok_id)
    folder = storage.join(root, "tokens", key)
    if not tokenizer:
        tokenizer = storage.join(folder, "tokenizer.json")
        if not storage.exists(tokenizer):
            storage.write_text(tokenizer, text.build_tokenizer(cfg).to_json())
    existing = _existing_packs(folder)
    reused = {r.key: existing[r.key] for r in records if r.key in existing}
    new = [r for r in records if r.key not in existing]
    by_sha = {r.key: r for r in records}
    specs = {m["key"]: PackSpec(key=m["key"], url=m["url"], files=[]) for m in reused.values()}
    for shas in packs.group([(r.key, r.bytes) for r in new], PACK_BYTES):
        k = packs.pack_key(key, shas)
        specs[k] = PackSpec(key=k, url=storage.join(folder, f"pack-{k}"), files=[(s, by_sha[s].url) for s in shas])
    logger = get_run_logger()
    logger.info("tokenize: %d new files into %d packs; %d files reused from %d packs", len(new),
                len(specs) - len({m["key"] for m in reused.values()}), len(reused),
                len({m["key"] for m in reused.values()}))
    ordered = [specs[k] for k in sorted(specs)]
    made = fan_out(tokenize_pack, ordered, sum(by_sha[s].bytes for s, _ in (f for p in ordered for f in p.files)),
                   d.task_runner, tokenizer, cfg, d.split.span_bytes)
    wanted = set(by_sha)
    used = []
    n_tokens = n_rows = 0
    for m in made:
        mine = sorted(set(m["files"]) & wanted)
        used.append({"url": m["url"], "files": None if len(mine) == len(m["files"]) else mine})
        n_tokens += sum(m["files"][s]["tokens"] for s in mine)
        n_rows += sum(m["files"][s]["rows"] for s in mine)
    if n_tokens == 0:
        raise UserError(f"no tokens left in {raw.source} after the {cfg.kind} tokenizer's normalisation: is it "
                        "the text you meant? (data.tokenizer.normalize=false keeps every character)")
    corpus_url = storage.join(folder, f"corpus-{raw.sha256[:16]}.json")
    if not storage.exists(corpus_url):
        storage.write_json(corpus_url, {"corpus": raw.sha256, "packs": used, "files": len(records),
                                        "n_tokens": n_tokens})
    assets.materializes(corpus_url, reads=[raw.url], name="token chunks")
    assets.describe(corpus_url, tokenizer=cfg.kind, n_tokens=n_tokens, files=len(records), packs=len(used))
    return Tokens(key=storage.digest([key, raw.sha256]), url=folder, corpus=corpus_url, tokenizer=tokenizer, n_tokens=n_tokens,
                  n_chunks=n_rows, raw_sha256=raw.sha256, files_tokenized=len(new), files_reused=len(reused))


def corpus_packs(tokens: Tokens) -> tuple[packs.CorpusPacks, int]:
    """The packs a corpus's tokens are in (the tokens stage's `corpus-<digest>.json`), and its
    number of files."""
    doc = storage.read_json(tokens.corpus)
    return packs.CorpusPacks([(p["url"], p["files"]) for p in doc["packs"]]), doc["files"]


def corpus_changes(data: Any, root: str) -> dict[str, int]:
    """What a many-file corpus holds against the corpus its sources gave the run before: files
    new, changed (a source name whose bytes differ), removed and reused, and how many files this
    run tokenized. Empty for a one-file source."""
    if data.raw_manifest is None:
        return {}
    previous = data.raw_previous
    now = [FileRecord.model_validate(f) for f in storage.read_json(data.raw_manifest)["files"]]
    before_url = storage.join(root, "corpora", f"{previous}.json") if previous else None
    before = ([FileRecord.model_validate(f) for f in storage.read_json(before_url)["files"]]
              if before_url and storage.exists(before_url) else [])
    old_sha, old_names = {f.key for f in before}, {f.source for f in before}
    new_sha, new_names = {f.key for f in now}, {f.source for f in now}
    changed = sum(f.key not in old_sha and f.source in old_names for f in now)
    return {"files": len(now), "new": sum(f.key not in old_sha and f.source not in old_names for f in now),
            "changed": changed, "removed": sum(f.key not in new_sha and f.source not in new_names for f in before),
            "reused": len(new_sha & old_sha), "tokenized": data.tokens.files_tokenized or 0,
            "skipped": len(data.raw_skipped)}
