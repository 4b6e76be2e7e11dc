"""The split stage: one file split contiguously (or by spans) into train/val/test ids; a corpus
routed pack by pack, each span by a digest of its content, then put together."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from pydantic import BaseModel

from mllm import layout, storage
from mllm.config import DataConfig, SplitConfig
from mllm.data import splits, text
from mllm.data import tokens as token_chunks
from mllm.data.vocab import Vocab
from tasks import assets
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.data import SplitPart, Splits, Tokens, Vocabulary, finished, write_manifest
from tasks.data.fan_out import fan_out
from tasks.data.tokenize import corpus_packs


def _split_key(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str) -> str:
    return storage.digest(
        ["split", tokens.key, vocabulary.digest, cfg.model_dump(), layout.code_digest(Vocab, splits, token_chunks)]
    )


@task(
    name="split",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_split_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def split(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str) -> Splits:
    """Encode the tokens and route each segment of the split plan to its split's arrays."""
    key = _split_key(tokens, vocabulary, cfg, root)
    url = layout.folder(root, layout.SPLITS, key)
    assets.materializes(url, reads=[tokens.url, vocabulary.url], name="split")
    if done := finished(url, Splits):
        return done
    vocab = Vocab.load(vocabulary.url)
    tokenizer = text.tokenizer_from_json(storage.read_text(tokens.tokenizer), source=tokens.tokenizer)
    source: Any = tokens.url
    if tokens.corpus:
        source, n_files = corpus_packs(tokens)
        if n_files > 1:  # split span by span, by content: split_source below
            raise ValueError("a corpus of many files is split by tasks.data.split.split_source")
    plan = splits.split_plan(tokens.n_tokens, cfg)
    with storage.staged_dir(url) as out:
        written = splits.write_splits(source, vocab, tokenizer, plan, out)
        parts = {
            w.name: SplitPart(
                parquet=storage.join(url, f"{w.name}.parquet"),
                ids=storage.join(url, f"{w.name}.npy"),
                n_tokens=w.n_tokens,
                n_bytes=w.n_bytes,
                sha256=w.sha256,
                offsets=storage.join(url, f"{w.name}.offsets.npy"),
            )
            for w in written
        }
        result = Splits(key=key, url=url, **parts)
        write_manifest(out, result)
    assets.describe(
        url,
        key=key,
        **{f"{w.name}_tokens": w.n_tokens for w in written},
        **{f"{w.name}_bytes": w.n_bytes for w in written},
    )
    get_run_logger().info("split: %s", ", ".join(f"{w.name} {w.n_tokens} tokens" for w in written))
    return result


class PackRows(BaseModel):
    url: str  # the pack's folder
    files: list[str] | None  # the corpus's files in it, or None for all


def _route_key(pack: PackRows, vocabulary: Vocabulary, tokenizer: str, cfg: SplitConfig, root: str) -> str:
    # The span size is the tokens stage's (it made the rows); seed and fractions decide the owner.
    return storage.digest(
        [
            "route",
            pack.model_dump(),
            vocabulary.digest,
            cfg.model_dump(exclude={"span_bytes"}),
            layout.code_digest(Vocab, splits),
        ]
    )


def _piece_url(pack: PackRows, vocabulary: Vocabulary, tokenizer: str, cfg: SplitConfig, root: str) -> str:
    return layout.folder(root, layout.SPLITS, "pieces", _route_key(pack, vocabulary, tokenizer, cfg, root))


def _stored_piece(url: str) -> dict[str, Any] | None:
    if not storage.is_complete(url):
        return None
    return {"url": url, "splits": storage.read_json(storage.join(url, splits.PIECES))}


@task(
    name="route-pack",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_route_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def route_pack(pack: PackRows, vocabulary: Vocabulary, tokenizer: str, cfg: SplitConfig, root: str) -> dict[str, Any]:
    """One pack's rows encoded and routed to their splits; a piece already stored is reused."""
    url = _piece_url(pack, vocabulary, tokenizer, cfg, root)
    if not storage.is_complete(url):
        vocab = Vocab.load(vocabulary.url)
        tok = text.tokenizer_from_json(storage.read_text(tokenizer), source=tokenizer)
        with storage.staged_dir(url) as out:
            splits.route_pack(pack.url, pack.files, vocab, splits.bytes_per_token(vocab, tok), cfg, out)
    return {"url": url, "splits": storage.read_json(storage.join(url, splits.PIECES))}


def _assembled_key(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str, pieces: list[str]) -> str:
    return _split_key(tokens, vocabulary, cfg, root)


@task(
    name="split",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_assembled_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def assemble_splits(tokens: Tokens, vocabulary: Vocabulary, cfg: SplitConfig, root: str, pieces: list[str]) -> Splits:
    """The corpus's splits from its packs' routed pieces, in pack order."""
    key = _split_key(tokens, vocabulary, cfg, root)
    url = layout.folder(root, layout.SPLITS, key)
    assets.materializes(url, reads=[tokens.url, vocabulary.url], name="split")
    if done := finished(url, Splits):
        return done
    with storage.staged_dir(url) as out:
        written = splits.assemble(pieces, vocabulary.size, out)
        # A split is its manifest of pieces: the ids and the Parquet both lie in the pieces it names.
        parts = {
            w.name: SplitPart(
                parquet=storage.join(url, f"{w.name}.ids.json"),
                ids=storage.join(url, f"{w.name}.ids.json"),
                n_tokens=w.n_tokens,
                n_bytes=w.n_bytes,
                sha256=w.sha256,
                offsets=storage.join(url, f"{w.name}.offsets.npy"),
            )
            for w in written
        }
        result = Splits(key=key, url=url, **parts)
        write_manifest(out, result)
    assets.describe(
        url,
        key=key,
        **{f"{w.name}_tokens": w.n_tokens for w in written},
        **{f"{w.name}_bytes": w.n_bytes for w in written},
    )
    get_run_logger().info(
        "split: %s (from %d packs)", ", ".join(f"{w.name} {w.n_tokens} tokens" for w in written), len(pieces)
    )
    return result


def split_source(tokens: Tokens, vocabulary: Vocabulary, d: DataConfig, root: str) -> Splits:
    """The split stage for any source: one file (or a corpus of one) contiguous, in one task; a
    corpus of many files span by span, pack by pack."""
    cfg = d.split
    if not tokens.corpus:
        return split(tokens, vocabulary, cfg, root)
    corpus, n_files = corpus_packs(tokens)
    if n_files == 1:
        return split(tokens, vocabulary, cfg, root)
    pieces: list[str] = []
    if not storage.is_complete(layout.folder(root, layout.SPLITS, _split_key(tokens, vocabulary, cfg, root))):
        refs = [PackRows(url=url, files=files) for url, files in corpus.packs]
        # Pieces already stored are read here: a task run each would cost Prefect's bookkeeping
        # (a tenth of a second) for a pack that needs nothing done.
        stored = {i: _stored_piece(_piece_url(r, vocabulary, tokens.tokenizer, cfg, root)) for i, r in enumerate(refs)}
        todo = [i for i, piece in stored.items() if piece is None]
        made = iter(
            fan_out(
                route_pack,
                [refs[i] for i in todo],
                tokens.n_tokens * len(todo) // len(refs),
                d.task_runner,
                vocabulary,
                tokens.tokenizer,
                cfg,
                root,
            )
        )
        routed = [stored[i] or next(made) for i in range(len(refs))]
        get_run_logger().info("split: %d packs routed, %d reused", len(todo), len(refs) - len(todo))
        sizes = {name: sum(r["splits"].get(name, {}).get("tokens", 0) for r in routed) for name in splits.NAMES}
        rows = sum(s["rows"] for r in routed for s in r["splits"].values())
        splits.check_span_sizes(sizes, rows, cfg)
        pieces = [r["url"] for r in routed]
    return assemble_splits(tokens, vocabulary, cfg, root, pieces)
