"""The vocabulary stage: `vocab.json` from the token counts (never a pickle)."""

from __future__ import annotations

from prefect import get_run_logger, task

from mllm import layout, storage
from mllm.config import VocabConfig
from mllm.data import tokens as token_chunks
from mllm.data.vocab import Vocab
from tasks import assets
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.data import Tokens, Vocabulary, finished, write_manifest
from tasks.data.tokenize import corpus_packs


def _vocab_key(tokens: Tokens, cfg: VocabConfig, root: str) -> str:
    return storage.digest(["vocab", tokens.key, cfg.model_dump(), layout.code_digest(Vocab, token_chunks)])


@task(
    name="build-vocabulary",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_vocab_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def build_vocabulary(tokens: Tokens, cfg: VocabConfig, root: str) -> Vocabulary:
    """Count tokens row group by row group, then keep those that pass min_freq and max_size."""
    key = _vocab_key(tokens, cfg, root)
    url = layout.folder(root, layout.VOCAB, key)
    assets.materializes(storage.join(url, "vocab.json"), reads=[tokens.url], name="vocabulary")
    if done := finished(url, Vocabulary):
        return done
    many = False
    if tokens.corpus:
        corpus, n_files = corpus_packs(tokens)
        counts, many = corpus.counts(), n_files > 1
    else:
        counts = token_chunks.count_tokens(tokens.url)
    order = cfg.order if cfg.order != "auto" else "token" if many else "frequency"
    vocab = Vocab.build(counts, min_freq=cfg.min_freq, max_size=cfg.max_size, specials=cfg.specials, order=order)
    result = Vocabulary(key=key, url=storage.join(url, "vocab.json"), digest=vocab.digest, size=len(vocab))
    with storage.staged_dir(url) as out:
        vocab.save(storage.join(out, "vocab.json"))
        write_manifest(out, result)
    assets.describe(result.url, key=key, digest=vocab.digest, size=len(vocab))
    get_run_logger().info("vocabulary: %d entries from %d distinct tokens", len(vocab), len(counts))
    return result
