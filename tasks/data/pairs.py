"""The parallel-text stages of the seq2seq family: the numbers corpus made from its config, and
the pairs of texts tokenized with their vocabularies."""

from __future__ import annotations

from prefect import get_run_logger, task

from mllm import layout, storage
from mllm.config import DataConfig, NumbersConfig
from mllm.data import text
from mllm.data.vocab import Vocab
from tasks import assets
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.data import Pairs, RawText, SourceSide, SplitPart, Splits, Tokens, Vocabulary, finished, write_manifest


def _pairs():
    """mllm.seq2seq.pairs, imported when a parallel-text stage runs: the seq2seq package brings
    torch (seconds), which the text stages' process-pool workers have no use for."""
    from mllm.seq2seq import pairs

    return pairs


@task(name="numbers-corpus", on_failure=[forget_exception])
def numbers_corpus(cfg: NumbersConfig, root: str) -> str:
    """Write the numbers corpus (English words -> the same number in cfg.language) as a TSV file
    under the storage root, once per config: from there it is a source like any other."""
    key = storage.digest(["numbers", cfg.model_dump(), layout.code_digest(_pairs()), _num2words_version()])
    url = layout.folder(root, layout.NUMBERS, f"{key}.tsv")
    assets.materializes(url, name="numbers corpus")  # made from its config: no upstream asset
    assets.describe(url, pairs=cfg.count, seed=cfg.seed, max_number=cfg.max_number, language=cfg.language)
    if not storage.exists(url):
        n = _pairs().write_numbers_tsv(url, cfg.count, cfg.seed, cfg.max_number, cfg.language)
        get_run_logger().info(
            "numbers corpus: %d pairs in [0, %d], seed %d, en -> %s", n, cfg.max_number, cfg.seed, cfg.language
        )
    return url


def _num2words_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("num2words")
    except PackageNotFoundError:
        return "absent"


def _pairs_key(raw: RawText, cfg: DataConfig, max_src_len: int, max_tgt_len: int, root: str) -> str:
    what = cfg.model_dump(include={"tokenizer", "vocab", "split", "pairs"}, exclude={"pairs": {"numbers"}})
    return storage.digest(
        ["pairs", raw.sha256, what, max_src_len, max_tgt_len, layout.code_digest(_pairs(), text, Vocab)]
    )


@task(
    name="prepare-pairs",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_pairs_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def prepare_pairs(raw: RawText, cfg: DataConfig, max_src_len: int, max_tgt_len: int, root: str) -> Pairs:
    """Split the pairs (identical sources on one side), tokenize both sides, build the
    vocabularies on the training pairs, and write each split as Parquet (texts and ids)."""
    key = _pairs_key(raw, cfg, max_src_len, max_tgt_len, root)
    url = layout.folder(root, layout.PAIRS, key)
    # The pairs folder is split and token chunks at once; its vocabularies are assets of their own,
    # as a corpus's vocabulary is, since training reads them by their own URIs.
    assets.materializes(url, reads=[raw.url], name="pairs split")
    for side in ("tgt", "src"):
        assets.materializes(storage.join(url, f"{side}_vocab.json"), reads=[raw.url], name=f"{side} vocabulary")
    if done := finished(url, Pairs):
        return done
    parallel = _pairs()
    found, bad = parallel.read_tsv(raw.url, name=raw.source)
    with storage.staged_dir(url) as out:
        s = parallel.prepare_pairs(found, cfg, out, max_src_len, max_tgt_len, bad)
        src_vocab = parallel.check_vocab(Vocab.load(storage.join(out, "src_vocab.json")), "source")
        tgt_vocab = parallel.check_vocab(Vocab.load(storage.join(out, "tgt_vocab.json")), "target")
        result = _result(key, url, raw, s, src_vocab, tgt_vocab, bad)
        write_manifest(out, result)
    assets.describe(
        url,
        key=key,
        pairs=s["pairs"],
        bad_lines=bad,
        too_long=s["too_long"],
        **{f"{name}_pairs": s[f"{name}_pairs"] for name in parallel.SPLITS},
    )
    for v in (result.vocab, result.source_side.vocab):
        assets.describe(v.url, digest=v.digest, size=v.size)
    _say(raw, s, bad, max_src_len, max_tgt_len, len(src_vocab), len(tgt_vocab))
    return result


def _result(key: str, url: str, raw: RawText, s: dict, src_vocab: Vocab, tgt_vocab: Vocab, bad: int) -> Pairs:
    """The stage's output from what mllm.seq2seq.pairs wrote at `url` and counted in `s`."""
    parallel = _pairs()
    parts = {
        name: SplitPart(
            parquet=storage.join(url, f"{name}.parquet"),
            ids=storage.join(url, f"{name}.parquet"),
            n_tokens=s[f"{name}_tgt_tokens"],
            n_bytes=s[f"{name}_tgt_bytes"],
        )
        for name in parallel.SPLITS
        if s[f"{name}_pairs"] or name != "test"
    }
    kept = sum(s[f"{name}_pairs"] for name in parallel.SPLITS)
    return Pairs(
        tokens=Tokens(
            key=key,
            url=url,
            tokenizer=storage.join(url, "tgt_tokenizer.json"),
            n_tokens=sum(s[f"{n}_src_tokens"] + s[f"{n}_tgt_tokens"] for n in parallel.SPLITS),
            n_chunks=kept,
            raw_sha256=raw.sha256,
        ),
        vocab=Vocabulary(
            key=key, url=storage.join(url, "tgt_vocab.json"), digest=tgt_vocab.digest, size=len(tgt_vocab)
        ),
        splits=Splits(key=key, url=url, **parts),
        source_side=SourceSide(
            vocab=Vocabulary(
                key=key, url=storage.join(url, "src_vocab.json"), digest=src_vocab.digest, size=len(src_vocab)
            ),
            tokenizer=storage.join(url, "src_tokenizer.json"),
        ),
        pairs=s["pairs"],
        bad_lines=bad,
        too_long=s["too_long"],
    )


def _say(raw: RawText, s: dict, bad: int, max_src_len: int, max_tgt_len: int, n_src: int, n_tgt: int) -> None:
    """What the stage left out, and the sizes of the splits and vocabularies, in the run's log."""
    logger = get_run_logger()
    if bad:
        logger.warning("%s: %d bad lines left out (one column, or an empty side)", raw.source, bad)
    if s["too_long"]:
        logger.warning(
            "%d pairs longer than max_src_len %d / max_tgt_len %d tokens left out",
            s["too_long"],
            max_src_len,
            max_tgt_len,
        )
    logger.info(
        "pairs: train %d, val %d, test %d; vocabularies: source %d, target %d",
        s["train_pairs"],
        s["val_pairs"],
        s["test_pairs"],
        n_src,
        n_tgt,
    )
