"""The download stage: one text file copied into `raw/<sha256>.txt`; a corpus of many files
(folders, prefixes, globs, JSONL and Parquet) listed, each file downloaded as a mapped task, and
recorded in a corpus manifest."""

from __future__ import annotations

import os
from typing import Any

from prefect import get_run_logger, task
from pydantic import BaseModel

from mllm import UserError, layout, storage
from mllm.config import DataConfig
from mllm.data import corpus, files, heads
from tasks import NOTICE, assets, report_progress
from tasks.caching import forget_exception, retry_unless_mistake
from tasks.data import RawText
from tasks.data.fan_out import PACK_BYTES, fan_out


@task(
    name="download",
    on_failure=[forget_exception],
    retries=2,
    retry_delay_seconds=[1, 3],
    retry_condition_fn=retry_unless_mistake,
)
def download(source: str, sha256: str | None, root: str) -> RawText:
    """Copy the source into `raw/<sha256>.txt` as UTF-8 text, after checking that it is text.

    `sha256` pins the source's bytes as they are at the source (what `sha256sum` prints), also
    when the file is UTF-16 or UTF-32 and its stored copy is converted to UTF-8; the copy is
    named after that digest.
    """
    logger = get_run_logger()
    got = corpus.download(
        source,
        lambda sha: layout.folder(root, layout.RAW, f"{sha}.txt"),
        sha256,
        progress=lambda n, size: report_progress("download", n, size),
    )
    assets.materializes(got.url, reads=[got.source], name="corpus copy")
    assets.describe(
        got.url,
        sha256=got.sha256,
        bytes=got.bytes,
        encoding=got.encoding,
        compression=got.compression,
        source=got.source,
    )
    meta = layout.folder(root, layout.RAW, f"{got.sha256}.json")
    if not storage.exists(meta):
        storage.write_json(
            meta,
            {
                "source": got.source,
                "sha256": got.sha256,
                "bytes": got.bytes,
                "encoding": got.encoding,
                "compression": got.compression,
            },
        )
    if got.repaired:
        logger.warning(
            "the stored copy %s no longer held the source's text (changed in storage): written again", got.url
        )
    if got.compression:
        logger.info("source %s is %s-compressed: stored decompressed", got.source, got.compression, extra=NOTICE)
    if got.encoding != "utf-8":
        logger.info("source %s is %s: stored converted to UTF-8", got.source, got.encoding.upper(), extra=NOTICE)
    logger.info("source %s: %d bytes, sha256 %s", got.source, got.bytes, got.sha256[:12])
    return RawText(source=got.source, url=got.url, sha256=got.sha256, bytes=got.bytes, encoding=got.encoding)


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


@task(name="list-source", retries=2, retry_delay_seconds=[1, 3], retry_condition_fn=retry_unless_mistake)
def list_source(sources: list[str]) -> tuple[list[files.SourceFile], list[str]]:
    """The files of the sources, and the hidden and marker files left out (each named in the log)."""
    found, hidden = files.list_files(sources)
    if hidden:
        get_run_logger().info("skipped %d hidden or marker files: %s", len(hidden), _some(hidden), extra=NOTICE)
    return found, hidden


HIDDEN = "a hidden or marker file"


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


@task(name="download-files", retries=2, retry_delay_seconds=[1, 3], retry_condition_fn=retry_unless_mistake)
def download_files(batch: list[files.SourceFile], text_field: str, bad_files: str, root: str) -> list[FileRecord]:
    """Check files of the source and store each under `raw/` by the sha256 of its bytes (a batch
    of files a task run: a task run costs Prefect's bookkeeping, a small file far less)."""
    return [_download_file(f, text_field, bad_files, root) for f in batch]


def _download_file(f: files.SourceFile, text_field: str, bad_files: str, root: str) -> FileRecord:
    try:
        if f.format == "text":
            got = corpus.download(f.url, lambda sha: layout.folder(root, layout.RAW, f"{sha}.txt"))
            if got.repaired:
                get_run_logger().warning(
                    "the stored copy %s of %s had changed in storage: written again", got.url, got.source
                )
            record = FileRecord(source=got.source, sha256=got.sha256, bytes=got.bytes, documents=1, url=got.url)
        else:
            # The documents are those of one field: another field of the same file is another copy.
            field = storage.digest(text_field)[:8]
            rec = files.download_records(
                f.url, f.format, text_field, lambda sha: layout.folder(root, layout.RAW, f"{sha}-{field}.parquet")
            )
            record = FileRecord(
                source=rec.source,
                sha256=rec.sha256,
                bytes=rec.bytes,
                format=f.format,
                documents=rec.documents,
                url=rec.url,
            )
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


@task(name="record-corpus", retries=1, retry_condition_fn=retry_unless_mistake)
def record_corpus(
    records: list[FileRecord], sources: list[str], sha256: str | None, root: str, hidden: list[str] | None = None
) -> RawText:
    """The corpus manifest, `corpora/<digest>.json`: every file with its source, bytes, digest and
    documents; the files whose bytes are another's (`duplicates`: each kept file's twins); and the
    files left out: hidden and marker files, and bad files with data.bad_files=skip."""
    kept: dict[str, FileRecord] = {}
    twins: dict[str, list[str]] = {}
    for r in sorted(records, key=lambda r: (r.key, r.source)):
        if r.skipped:
            continue
        if r.key in kept:
            twins.setdefault(kept[r.key].source, []).append(r.source)
        else:
            kept[r.key] = r
    skipped = [r for r in records if r.skipped] + [FileRecord(source=h, skipped=HIDDEN) for h in hidden or []]
    if not kept:
        raise UserError(
            f"no usable file in {', '.join(sources)}: all {len(records)} were left out "
            f"({skipped[0].source}: {skipped[0].skipped})"
        )
    digest = corpus_digest(list(kept))
    if sha256 and sha256 != digest:
        raise UserError(
            f"the corpus has digest {digest}, not the pinned {sha256}: its files changed; update "
            "data.sha256 or remove it"
        )
    url = layout.folder(root, layout.CORPORA, f"{digest}.json")
    # The same bytes under another name: one file, named by the first source in order, its twins
    # beside it. Which names a corpus came by, and what was left out, may change with its digest
    # unchanged: the manifest says this run's.
    doc = {
        "digest": digest,
        "sources": sources,
        "files": [r.model_dump() for r in kept.values()],
        "duplicates": twins,
        "skipped": [{"source": r.source, "reason": r.skipped} for r in skipped],
    }
    if not storage.exists(url) or storage.read_json(url) != doc:
        storage.write_json(url, doc)
    total = sum(r.bytes for r in kept.values())
    assets.materializes(url, reads=[r.source for r in kept.values()][:50], name="corpus manifest")
    assets.describe(url, digest=digest, files=len(kept), bytes=total, skipped=len(skipped))
    logger = get_run_logger()
    n_empty = sum(r.skipped == heads.EMPTY for r in skipped)
    logger.info(
        "corpus %s: %d files, %d bytes%s",
        digest[:12],
        len(kept),
        total,
        f", {len(skipped)} left out" + (f" ({n_empty} empty)" if n_empty else "") if skipped else "",
    )
    n_twins = sum(len(t) for t in twins.values())
    if n_twins:
        logger.info(
            "%d files hold the same bytes as another, read once: %s (every name in the corpus manifest %s)",
            n_twins,
            _some([f"{d} = {k}" for k, ds in twins.items() for d in ds], 3),
            url,
            extra=NOTICE,
        )
    source = sources[0] if len(sources) == 1 else f"{sources[0]} and {len(sources) - 1} more"
    # The corpus these sources gave last time, for what changed since (then this one's).
    last_url = layout.folder(root, layout.CORPORA, f"last-{storage.digest(sources)}.json")
    previous = storage.read_json(last_url)["digest"] if storage.exists(last_url) else None
    storage.write_json(last_url, {"digest": digest})
    return RawText(
        source=source,
        url=url,
        sha256=digest,
        bytes=total,
        files=len(kept),
        manifest=url,
        skipped=[f"{r.source}: {r.skipped}" for r in skipped],
        previous=previous,
        duplicates=n_twins,
    )


def download_source(d: DataConfig, root: str) -> RawText:
    """The download stage for any source: one text file as it always was; many files (or JSONL
    and Parquet) listed, each downloaded as a mapped task, and recorded in a corpus manifest."""
    sources = d.sources
    found, hidden = list_source(sources)
    if len(found) == 1 and found[0].format == "text":
        raw = download(found[0].url, d.sha256, root)
        return raw.model_copy(update={"skipped": [f"{h}: {HIDDEN}" for h in hidden]}) if hidden else raw
    # An empty file of many holds no text to lose: left out and counted (data.bad_files).
    empty = heads.empty_files(found, d.bad_files, sources)
    found = [f for f in found if f not in empty]
    # What was read depends on the text field too (a JSONL file's documents are that field's).
    index_url = layout.folder(root, layout.CORPORA, f"seen-{storage.digest([sources, d.text_field])}.json")
    known = _known(index_url, root) if not d.sha256 else {}  # a pinned corpus is read whole, always
    todo = [f for f in found if _quick_key(f) not in known]
    batches = _batches(todo, len(os.sched_getaffinity(0)))
    made = fan_out(
        download_files, batches, sum(f.size or 0 for f in todo), d.task_runner, d.text_field, d.bad_files, root
    )
    fresh = [r for batch in made for r in batch]
    records = (
        [known[_quick_key(f)] for f in found if _quick_key(f) in known]
        + fresh
        + [FileRecord(source=f.name, format=f.format, skipped=heads.EMPTY) for f in empty]
    )
    if fresh:
        get_run_logger().info(
            "read %d files of %d (the others' size and time are as when last read)", len(todo), len(found)
        )
        seen = dict(known)
        for r in fresh:
            if not r.skipped and (key := _quick_key(r)):
                seen[key] = r
        storage.write_json(index_url, {k: r.model_dump() for k, r in seen.items()})
    return record_corpus(records, sources, d.sha256, root, hidden)


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
    fs, path = storage.filesystem(layout.folder(root, layout.RAW))
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


def manifest_files(raw: RawText) -> list[FileRecord]:
    return [FileRecord.model_validate(f) for f in storage.read_json(raw.manifest)["files"]]


# A file compressed in place stays the file it was: its name without the compression's suffix.
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def file_identities(data: Any) -> list[str]:
    """What two corpora compare to say whether they share a file: each file's sha256, and a
    digest of where it was read from (without a compression suffix), so that a file edited or
    compressed in place is still the file it was. Files left out count not."""
    if data.raw_manifest is None:
        named = [(data.raw_sha256, data.source)]
    else:
        named = [(f.sha256, f.source) for f in manifest_records(data.raw_manifest) if f.sha256 and not f.skipped]

    def place(source: str) -> str:
        for suffix in _COMPRESSED:
            source = source.removesuffix(suffix)
        return storage.sha256_bytes(source.encode())

    return [d for sha, source in named for d in (sha, place(source))]


def manifest_records(url: str) -> list[FileRecord]:
    return [FileRecord.model_validate(f) for f in storage.read_json(url)["files"]]


def corpus_changes(data: Any, root: str) -> dict[str, int]:
    """What a many-file corpus holds against the corpus its sources gave the run before: files
    new, changed (a source name whose bytes differ), removed and reused, and how many files this
    run tokenized. Empty for a one-file source."""
    if data.raw_manifest is None:
        return {}
    previous = data.raw_previous
    now = [FileRecord.model_validate(f) for f in storage.read_json(data.raw_manifest)["files"]]
    before_url = layout.folder(root, layout.CORPORA, f"{previous}.json") if previous else None
    before = (
        [FileRecord.model_validate(f) for f in storage.read_json(before_url)["files"]]
        if before_url and storage.exists(before_url)
        else []
    )
    old_sha, old_names = {f.key for f in before}, {f.source for f in before}
    new_sha, new_names = {f.key for f in now}, {f.source for f in now}
    changed = sum(f.key not in old_sha and f.source in old_names for f in now)
    return {
        "files": len(now),
        "new": sum(f.key not in old_sha and f.source not in old_names for f in now),
        "changed": changed,
        "removed": sum(f.key not in new_sha and f.source not in new_names for f in before),
        "reused": len(new_sha & old_sha),
        "tokenized": data.tokens.files_tokenized or 0,
        "skipped": len(data.raw_skipped),
        "duplicates": data.raw_duplicates,
        "empty": sum(s.endswith(f": {heads.EMPTY}") for s in data.raw_skipped),
    }
