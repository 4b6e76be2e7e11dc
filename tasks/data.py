"""The data stages as Prefect tasks: download, tokenize to Parquet, build the vocabulary, split.

The work is done in `mllm` (corpus, tokens, vocab, splits); here is what makes it a pipeline
stage: where each output lives under the storage root, its cache key, retries, the manifest
that marks it complete, logging and progress.

Each stage writes under the storage root in a folder named after a digest of its inputs (the
upstream content digest, the stage's config and the code that does the work), so a re-run with
the same inputs finds its output and two different runs never share one. Prefect's cache uses the
same digest as its key, so a re-run shows these stages as Cached.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from pydantic import BaseModel

from mllm import storage
from mllm.data import corpus, gutenberg, splits, text, tokens as token_chunks
from mllm.config import DataConfig, NumbersConfig, SplitConfig, TokenizerConfig, VocabConfig
from mllm.data.vocab import Vocab
from tasks import NOTICE, assets, report_progress
from tasks.caching import code_digest, forget_exception, package_digest, stage_cache, transient


class RawText(BaseModel):
    source: str
    url: str
    sha256: str  # of the source's bytes as they were (what a pinned data.sha256 is checked against)
    bytes: int
    encoding: str = "utf-8"  # the source's; the stored copy is always UTF-8
    # A source of many files (or of JSONL/Parquet records): sha256 is the corpus digest (of the
    # files' sorted digests), url and manifest its manifest (tasks.corpus), bytes the total.
    files: int = 1
    manifest: str | None = None
    skipped: list[str] = []  # files left out (data.bad_files: skip), each with why
    previous: str | None = None  # the corpus digest the same sources gave the run before


class Tokens(BaseModel):
    key: str
    url: str  # folder of Parquet files: one row per text chunk, column `tokens: list<string>`
    tokenizer: str  # tokenizer JSON
    n_tokens: int
    n_chunks: int
    raw_sha256: str
    # A corpus of many files: its packs (tasks.corpus), and how many files this run tokenized.
    corpus: str | None = None
    files_tokenized: int | None = None
    files_reused: int | None = None


class Vocabulary(BaseModel):
    key: str
    url: str
    digest: str
    size: int


class SplitPart(BaseModel):
    parquet: str  # a split of pieces (many files): its manifest, which names each piece's Parquet
    # flat .npy (uint8, uint16 or int32: mllm.splits.ids_dtype), memory-mapped by training; a corpus
    # of many files: `<split>.ids.json`, a manifest of its pieces (mllm.data.ChainedIds); pairs: their Parquet
    ids: str
    n_tokens: int
    n_bytes: int  # UTF-8 bytes of the text these tokens stand for: bits per byte need it
    offsets: str | None = None  # int64 .npy: where each piece (paragraph) starts; CBOW needs it
    sha256: str | None = None  # of the ids file (pieces: mllm.data.chain_digest), when the split stage wrote it (lineage checks it)


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


# --- download ---------------------------------------------------------------------------------


@task(name="download", on_failure=[forget_exception],
      retries=2, retry_delay_seconds=[1, 3], retry_condition_fn=transient)
def download(source: str, sha256: str | None, root: str) -> RawText:
    """Copy the source into `raw/<sha256>.txt` as UTF-8 text, after checking that it is text.

    `sha256` pins the source's bytes as they are at the source (what `sha256sum` prints), also
    when the file is UTF-16 or UTF-32 and its stored copy is converted to UTF-8; the copy is
    named after that digest.
    """
    logger = get_run_logger()
    got = corpus.download(source, lambda sha: storage.join(root, "raw", f"{sha}.txt"), sha256,
                          progress=lambda n, size: report_progress("download", n, size))
    assets.materializes(got.url, reads=[got.source], name="corpus copy")
    assets.describe(got.url, sha256=got.sha256, bytes=got.bytes, encoding=got.encoding, compression=got.compression,
                    source=got.source)
    meta = storage.join(root, "raw", f"{got.sha256}.json")
    if not storage.exists(meta):
        storage.write_json(meta, {"source": got.source, "sha256": got.sha256, "bytes": got.bytes,
                                  "encoding": got.encoding, "compression": got.compression})
    if got.repaired:
        logger.warning("the stored copy %s no longer held the source's text (changed in storage): written again",
                       got.url)
    if got.compression:
        logger.info("source %s is %s-compressed: stored decompressed", got.source, got.compression, extra=NOTICE)
    if got.encoding != "utf-8":
        logger.info("source %s is %s: stored converted to UTF-8", got.source, got.encoding.upper(), extra=NOTICE)
    logger.info("source %s: %d bytes, sha256 %s", got.source, got.bytes, got.sha256[:12])
    return RawText(source=got.source, url=got.url, sha256=got.sha256, bytes=got.bytes, encoding=got.encoding)


# --- tokenize ---------------------------------------------------------------------------------


def _tokens_key(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    return storage.digest(["tokens", raw.sha256, cfg.model_dump(), code_digest(corpus, gutenberg, text, token_chunks)])


@task(name="tokenize", on_failure=[forget_exception], cache_key_fn=stage_cache(_tokens_key),
      retries=1, retry_condition_fn=transient)
def tokenize(raw: RawText, cfg: TokenizerConfig, root: str) -> Tokens:
    """Stream the raw text through the tokenizer into a Parquet dataset of token chunks."""
    key = _tokens_key(raw, cfg, root)
    url = storage.join(root, "tokens", key)
    assets.materializes(url, reads=[raw.url], name="token chunks")
    if done := _finished(url, Tokens):
        return done
    with storage.staged_dir(url) as out:
        tokenizer, n_tokens, n_chunks = token_chunks.tokenize_text(
            raw.url, cfg, out, source=raw.source, progress=lambda n: report_progress("tokenize", n, None))
        report_progress("tokenize", n_tokens, n_tokens)
        storage.write_text(storage.join(out, "tokenizer.json"), tokenizer.to_json())
        result = Tokens(key=key, url=url, tokenizer=storage.join(url, "tokenizer.json"),
                        n_tokens=n_tokens, n_chunks=n_chunks, raw_sha256=raw.sha256)
        _manifest(out, result)
    assets.describe(url, key=key, tokenizer=cfg.kind, n_tokens=n_tokens, n_chunks=n_chunks, raw_sha256=raw.sha256)
    get_run_logger().info("tokenized %s: %d tokens in %d chunks", raw.source, n_tokens, n_chunks)
    return result


def _finished(url: str, kind: type[BaseModel]) -> BaseModel | None:
    """The manifest of a stage output that is already complete, so the stage need not run."""
    if storage.is_complete(url):
        return kind.model_validate(storage.read_json(storage.join(url, "manifest.json")))
    return None


def _manifest(out: str, result: BaseModel) -> None:
    storage.write_json(storage.join(out, "manifest.json"), result.model_dump(mode="json"))


# --- vocabulary -------------------------------------------------------------------------------


def _vocab_key(tokens: Tokens, cfg: VocabConfig, root: str) -> str:
    return storage.digest(["vocab", tokens.key, cfg.model_dump(), code_digest(Vocab, token_chunks)])


@task(name="build-vocabulary", on_failure=[forget_exception], cache_key_fn=stage_cache(_vocab_key),
      retries=1, retry_condition_fn=transient)
def build_vocabulary(tokens: Tokens, cfg: VocabConfig, root: str) -> Vocabulary:
    """Count tokens row group by row group, then keep those that pass min_freq and max_size."""
    key = _vocab_key(tokens, cfg, root)
    url = storage.join(root, "vocab", key)
    assets.materializes(storage.join(url, "vocab.json"), reads=[tokens.url], name="vocabulary")
    if done := _finished(url, Vocabulary):
        return done
    many = False
    if tokens.corpus:
        from tasks.corpus import corpus_packs

        corpus, n_files = corpus_packs(tokens)
        counts, many = corpus.counts(), n_files > 1
    else:
        counts = token_chunks.count_tokens(tokens.url)
    order = cfg.order if cfg.order != "auto" else "token" if many else "frequency"
    vocab = Vocab.build(counts, min_freq=cfg.min_freq, max_size=cfg.max_size, specials=cfg.specials, order=order)
    result = Vocabulary(key=key, url=storage.join(url, "vocab.json"), digest=vocab.digest, size=len(vocab))
    with storage.staged_dir(url) as out:
        vocab.save(storage.join(out, "vocab.json"))
        _manifest(out, result)
    assets.describe(result.url, key=key, digest=vocab.digest, size=len(vocab))
    get_run_logger().info("vocabulary: %d entries from %d distinct tokens", len(vocab), len(counts))
    return result


# --- split ------------------------------------------------------------------------------------


def _split_key(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str) -> str:
    return storage.digest(["split", tokens.key, vocabulary.digest, cfg.model_dump(), code_digest(Vocab, splits, token_chunks)])


@task(name="split", on_failure=[forget_exception], cache_key_fn=stage_cache(_split_key),
      retries=1, retry_condition_fn=transient)
def split(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str) -> Splits:
    """Encode the tokens and route each segment of the split plan to its split's arrays."""
    key = _split_key(tokens, vocabulary, cfg, root)
    url = storage.join(root, "splits", key)
    assets.materializes(url, reads=[tokens.url, vocabulary.url], name="split")
    if done := _finished(url, Splits):
        return done
    vocab = Vocab.load(vocabulary.url)
    tokenizer = text.tokenizer_from_json(storage.read_text(tokens.tokenizer), source=tokens.tokenizer)
    source: Any = tokens.url
    if tokens.corpus:
        from tasks.corpus import corpus_packs

        source, n_files = corpus_packs(tokens)
        if n_files > 1:  # split span by span, by content: tasks.corpus_split
            raise ValueError("a corpus of many files is split by tasks.corpus_split.split_source")
    plan = splits.split_plan(tokens.n_tokens, cfg)
    with storage.staged_dir(url) as out:
        written = splits.write_splits(source, vocab, tokenizer, plan, out)
        parts = {w.name: SplitPart(parquet=storage.join(url, f"{w.name}.parquet"),
                                   ids=storage.join(url, f"{w.name}.npy"), n_tokens=w.n_tokens, n_bytes=w.n_bytes, sha256=w.sha256,
                                   offsets=storage.join(url, f"{w.name}.offsets.npy"))
                 for w in written}
        result = Splits(key=key, url=url, **parts)
        _manifest(out, result)
    assets.describe(url, key=key, **{f"{w.name}_tokens": w.n_tokens for w in written},
                    **{f"{w.name}_bytes": w.n_bytes for w in written})
    get_run_logger().info("split: %s", ", ".join(f"{w.name} {w.n_tokens} tokens" for w in written))
    return result


# --- parallel text (the seq2seq family) -----------------------------------------------------


def _pairs():
    """mllm.seq2seq.pairs, imported when a parallel-text stage runs: the seq2seq package brings
    torch (seconds), which the text stages' process-pool workers have no use for."""
    from mllm.seq2seq import pairs

    return pairs


@task(name="numbers-corpus", on_failure=[forget_exception])
def numbers_corpus(cfg: NumbersConfig, root: str) -> str:
    """Write the numbers corpus (English words -> the same number in cfg.language) as a TSV file
    under the storage root, once per config: from there it is a source like any other."""
    key = storage.digest(["numbers", cfg.model_dump(), code_digest(_pairs()), _num2words_version()])
    url = storage.join(root, "numbers", f"{key}.tsv")
    assets.materializes(url, name="numbers corpus")  # made from its config: no upstream asset
    assets.describe(url, pairs=cfg.count, seed=cfg.seed, max_number=cfg.max_number, language=cfg.language)
    if not storage.exists(url):
        n = _pairs().write_numbers_tsv(url, cfg.count, cfg.seed, cfg.max_number, cfg.language)
        get_run_logger().info("numbers corpus: %d pairs in [0, %d], seed %d, en -> %s", n, cfg.max_number,
                              cfg.seed, cfg.language)
    return url


def _num2words_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("num2words")
    except PackageNotFoundError:
        return "absent"


def _pairs_key(raw: RawText, cfg: DataConfig, max_src_len: int, max_tgt_len: int, root: str) -> str:
    what = cfg.model_dump(include={"tokenizer", "vocab", "split", "pairs"}, exclude={"pairs": {"numbers"}})
    return storage.digest(["pairs", raw.sha256, what, max_src_len, max_tgt_len,
                           code_digest(_pairs(), text, Vocab)])


@task(name="prepare-pairs", on_failure=[forget_exception], cache_key_fn=stage_cache(_pairs_key),
      retries=1, retry_condition_fn=transient)
def prepare_pairs(raw: RawText, cfg: DataConfig, max_src_len: int, max_tgt_len: int, root: str) -> Pairs:
    """Split the pairs (identical sources on one side), tokenize both sides, build the
    vocabularies on the training pairs, and write each split as Parquet (texts and ids)."""
    key = _pairs_key(raw, cfg, max_src_len, max_tgt_len, root)
    url = storage.join(root, "pairs", key)
    # The pairs folder is split and token chunks at once; its vocabularies are assets of their own,
    # as a corpus's vocabulary is, since training reads them by their own URIs.
    assets.materializes(url, reads=[raw.url], name="pairs split")
    for side in ("tgt", "src"):
        assets.materializes(storage.join(url, f"{side}_vocab.json"), reads=[raw.url], name=f"{side} vocabulary")
    if done := _finished(url, Pairs):
        return done
    logger = get_run_logger()
    parallel = _pairs()
    found, bad = parallel.read_tsv(raw.url, name=raw.source)
    with storage.staged_dir(url) as out:
        s = parallel.prepare_pairs(found, cfg, out, max_src_len, max_tgt_len, bad)
        src_vocab = parallel.check_vocab(Vocab.load(storage.join(out, "src_vocab.json")), "source")
        tgt_vocab = parallel.check_vocab(Vocab.load(storage.join(out, "tgt_vocab.json")), "target")
        parts = {name: SplitPart(parquet=storage.join(url, f"{name}.parquet"), ids=storage.join(url, f"{name}.parquet"),
                                 n_tokens=s[f"{name}_tgt_tokens"], n_bytes=s[f"{name}_tgt_bytes"])
                 for name in parallel.SPLITS if s[f"{name}_pairs"] or name != "test"}
        kept = sum(s[f"{name}_pairs"] for name in parallel.SPLITS)
        result = Pairs(
            tokens=Tokens(key=key, url=url, tokenizer=storage.join(url, "tgt_tokenizer.json"),
                          n_tokens=sum(s[f"{n}_src_tokens"] + s[f"{n}_tgt_tokens"] for n in parallel.SPLITS),
                          n_chunks=kept, raw_sha256=raw.sha256),
            vocab=Vocabulary(key=key, url=storage.join(url, "tgt_vocab.json"), digest=tgt_vocab.digest,
                             size=len(tgt_vocab)),
            splits=Splits(key=key, url=url, **parts),
            source_side=SourceSide(vocab=Vocabulary(key=key, url=storage.join(url, "src_vocab.json"),
                                                    digest=src_vocab.digest, size=len(src_vocab)),
                                   tokenizer=storage.join(url, "src_tokenizer.json")),
            pairs=s["pairs"], bad_lines=bad, too_long=s["too_long"])
        _manifest(out, result)
    assets.describe(url, key=key, pairs=s["pairs"], bad_lines=bad, too_long=s["too_long"],
                    **{f"{name}_pairs": s[f"{name}_pairs"] for name in parallel.SPLITS})
    for v in (result.vocab, result.source_side.vocab):
        assets.describe(v.url, digest=v.digest, size=v.size)
    if bad:
        logger.warning("%s: %d bad lines left out (one column, or an empty side)", raw.source, bad)
    if s["too_long"]:
        logger.warning("%d pairs longer than max_src_len %d / max_tgt_len %d tokens left out", s["too_long"],
                       max_src_len, max_tgt_len)
    logger.info("pairs: train %d, val %d, test %d; vocabularies: source %d, target %d", s["train_pairs"],
                s["val_pairs"], s["test_pairs"], len(src_vocab), len(tgt_vocab))
    return result


# --- generated data (a family that makes its own, such as the sequence experiments) ------------


class Generated(BaseModel):
    """Data a family made from its config, handed on as a corpus's stages hand theirs on."""

    key: str
    source: str  # what was made, in words
    sha256: str  # of the files made
    bytes: int
    tokens: Tokens
    vocab: Vocabulary
    splits: Splits


def _generated_key(cfg: DataConfig, family: str, root: str) -> str:
    return storage.digest(["generated", family, cfg.model_dump(), package_digest()])


@task(name="generate-data", on_failure=[forget_exception], cache_key_fn=stage_cache(_generated_key),
      retries=1, retry_condition_fn=transient)
def generate_data(cfg: DataConfig, family: str, root: str) -> Generated:
    """Make the data of a family whose data is made from its config (no download)."""
    from mllm.family import families

    key = _generated_key(cfg, family, root)
    url = storage.join(root, "generated", key)
    assets.materializes(url, name="generated data")  # made from its config: no upstream asset
    assets.materializes(storage.join(url, "vocab.json"), name="vocabulary")
    if done := _finished(url, Generated):
        return done
    maker = next(f for f in families() if f.name == family)
    with storage.staged_dir(url) as out:
        made = maker.make_data(cfg, out)
        files = [storage.join(out, made[name]["file"]) for name in ("train", "val")]
        blobs = [storage.read_bytes(f) for f in files]
        digest = storage.sha256_bytes(b"".join(blobs))
        vocab = Vocab.load(storage.join(out, "vocab.json"))
        parts = {name: SplitPart(parquet=storage.join(url, made[name]["file"]), ids=storage.join(url, made[name]["file"]),
                                 n_tokens=made[name]["n_tokens"], n_bytes=len(blob))
                 for name, blob in zip(("train", "val"), blobs)}
        result = Generated(
            key=key, source=made["source"], sha256=digest, bytes=sum(len(b) for b in blobs),
            tokens=Tokens(key=key, url=url, tokenizer=storage.join(url, "tokenizer.json"), n_tokens=made["n_tokens"],
                          n_chunks=made["sequences"], raw_sha256=digest),
            vocab=Vocabulary(key=key, url=storage.join(url, "vocab.json"), digest=vocab.digest, size=len(vocab)),
            splits=Splits(key=key, url=url, **parts))
        _manifest(out, result)
    assets.describe(url, key=key, sha256=digest, bytes=result.bytes, sequences=made["sequences"],
                    n_tokens=made["n_tokens"])
    assets.describe(result.vocab.url, digest=vocab.digest, size=len(vocab))
    get_run_logger().info("%s: %d sequences, train %d / val %d positions", made["source"], made["sequences"],
                          made["train"]["n_tokens"], made["val"]["n_tokens"])
    return result
