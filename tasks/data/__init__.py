"""The data stages as Prefect tasks, a module each (the work is done in `mllm.data`), and what each
stage hands on."""

from __future__ import annotations

from pydantic import BaseModel

from mllm import storage


# Prefect keeps a cached result as a pickle that names its class by module: these classes stay at
# `tasks.data.<Name>` for stages cached before.
class RawText(BaseModel):
    source: str
    url: str
    sha256: str  # of the source's bytes as they were (what a pinned data.sha256 is checked against)
    bytes: int
    encoding: str = "utf-8"  # the source's; the stored copy is always UTF-8
    # A source of many files (or of JSONL/Parquet records): sha256 is the corpus digest (of the
    # files' sorted digests), url and manifest its manifest (tasks/data/download.py), bytes the total.
    files: int = 1
    manifest: str | None = None
    skipped: list[str] = []  # files left out (hidden or markers; data.bad_files: skip), each with why
    duplicates: int = 0  # files read once because another holds the same bytes (the manifest names them)
    previous: str | None = None  # the corpus digest the same sources gave the run before


class Tokens(BaseModel):
    key: str
    url: str  # folder of Parquet files: one row per text chunk, column `tokens: list<string>`
    tokenizer: str  # tokenizer JSON
    n_tokens: int
    n_chunks: int
    raw_sha256: str
    # A corpus of many files: its packs (tasks/data/tokenize.py), and how many files this run tokenized.
    corpus: str | None = None
    files_tokenized: int | None = None
    files_reused: int | None = None
    # What the tokenizer's normalisation dropped: characters read, and dropped by character (all
    # the corpus's files); None where it is not measured (a tokenizer that does not normalise so).
    chars: int | None = None
    lost: dict[str, int] | None = None

    def dropped_share(self) -> float | None:
        """The share of the corpus's characters that the tokenizer's normalisation dropped."""
        return None if not self.chars or self.lost is None else max(self.chars - self.n_tokens, 0) / self.chars


class Vocabulary(BaseModel):
    key: str
    url: str
    digest: str
    size: int


class SplitPart(BaseModel):
    parquet: str  # a split of pieces (many files): its manifest, which names each piece's Parquet
    # flat .npy (uint8, uint16 or int32: mllm.data.splits.ids_dtype), memory-mapped by training; a corpus
    # of many files: `<split>.ids.json`, a manifest of its pieces (mllm.runtime.epochs.ChainedIds); pairs: their Parquet
    ids: str
    n_tokens: int
    n_bytes: int  # UTF-8 bytes of the text these tokens stand for: bits per byte need it
    offsets: str | None = None  # int64 .npy: where each piece (paragraph) starts; CBOW needs it
    sha256: str | None = (
        None  # of the ids file (pieces: mllm.runtime.epochs.chain_digest), when the split stage wrote it (lineage checks it)
    )


class Splits(BaseModel):
    key: str
    url: str
    train: SplitPart
    val: SplitPart
    test: SplitPart | None = None


class SourceSide(BaseModel):
    """Parallel text: the source side's vocabulary and tokenizer (the target side's are the
    run's `vocab` and `tokens.tokenizer`, what the model writes)."""

    vocab: Vocabulary
    tokenizer: str


class Pairs(BaseModel):
    """Parallel text, prepared: the same hand-over as a corpus's stages, plus the source side.
    `tokens` counts both sides' tokens of the kept pairs; each split part counts target tokens."""

    tokens: Tokens
    vocab: Vocabulary
    splits: Splits
    source_side: SourceSide
    pairs: int
    bad_lines: int
    too_long: int


class Generated(BaseModel):
    """Data a family made from its config, handed on as a corpus's stages hand theirs on."""

    key: str
    source: str  # what was made, in words
    sha256: str  # of the files made
    bytes: int
    tokens: Tokens
    vocab: Vocabulary
    splits: Splits


def finished(url: str, kind: type[BaseModel]) -> BaseModel | None:
    """The manifest of a stage output that is already complete, so the stage need not run."""
    if storage.is_complete(url):
        return kind.model_validate(storage.read_json(storage.join(url, "manifest.json")))
    return None


def write_manifest(out: str, result: BaseModel) -> None:
    storage.write_json(storage.join(out, "manifest.json"), result.model_dump(mode="json"))
