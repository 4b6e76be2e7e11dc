"""The generated-data stage of the sequence experiments: sequences made from the config."""

from __future__ import annotations

from prefect import get_run_logger, task

from mllm import layout, storage
from mllm.config import DataConfig
from mllm.data.vocab import Vocab
from mllm.families.base import families
from tasks import assets
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.data import Generated, SplitPart, Splits, Tokens, Vocabulary, finished, write_manifest


def _generated_key(cfg: DataConfig, family: str, root: str) -> str:
    return storage.digest(["generated", family, cfg.model_dump(), layout.package_digest()])


@task(
    name="generate-data",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_generated_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def generate_data(cfg: DataConfig, family: str, root: str) -> Generated:
    """Make the data of a family whose data is made from its config (no download)."""

    key = _generated_key(cfg, family, root)
    url = layout.folder(root, layout.GENERATED, key)
    assets.materializes(url, name="generated data")  # made from its config: no upstream asset
    assets.materializes(storage.join(url, "vocab.json"), name="vocabulary")
    if done := finished(url, Generated):
        return done
    maker = next(f for f in families() if f.name == family)
    with storage.staged_dir(url) as out:
        made = maker.make_data(cfg, out)
        files = [storage.join(out, made[name]["file"]) for name in ("train", "val")]
        blobs = [storage.read_bytes(f) for f in files]
        digest = storage.sha256_bytes(b"".join(blobs))
        vocab = Vocab.load(storage.join(out, "vocab.json"))
        parts = {
            name: SplitPart(
                parquet=storage.join(url, made[name]["file"]),
                ids=storage.join(url, made[name]["file"]),
                n_tokens=made[name]["n_tokens"],
                n_bytes=len(blob),
            )
            for name, blob in zip(("train", "val"), blobs)
        }
        result = Generated(
            key=key,
            source=made["source"],
            sha256=digest,
            bytes=sum(len(b) for b in blobs),
            tokens=Tokens(
                key=key,
                url=url,
                tokenizer=storage.join(url, "tokenizer.json"),
                n_tokens=made["n_tokens"],
                n_chunks=made["sequences"],
                raw_sha256=digest,
            ),
            vocab=Vocabulary(key=key, url=storage.join(url, "vocab.json"), digest=vocab.digest, size=len(vocab)),
            splits=Splits(key=key, url=url, **parts),
        )
        write_manifest(out, result)
    assets.describe(
        url, key=key, sha256=digest, bytes=result.bytes, sequences=made["sequences"], n_tokens=made["n_tokens"]
    )
    assets.describe(result.vocab.url, digest=vocab.digest, size=len(vocab))
    get_run_logger().info(
        "%s: %d sequences, train %d / val %d positions",
        made["source"],
        made["sequences"],
        made["train"]["n_tokens"],
        made["val"]["n_tokens"],
    )
    return result
