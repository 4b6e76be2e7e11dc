"""The sample stage as a Prefect task: the recipe's own samples from a run's best checkpoint."""

from __future__ import annotations

from prefect import get_run_logger, task

from mllm import layout, storage
from mllm.config import RunConfig
from mllm.families.base import family_of, samples_text
from mllm.runtime import checkpoint
from tasks import assets
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.model import Trained
from tasks.model.evaluate import best_or_last


def _generate_key(cfg: RunConfig, trained: Trained) -> str:
    return storage.digest(["generate", trained.key, trained.steps, cfg.sample.model_dump(), layout.package_digest()])


@task(
    name="generate",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_generate_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def generate(cfg: RunConfig, trained: Trained) -> dict[str, list[str]]:
    """The recipe's own samples, one file per method (`samples/<method>.txt`), as the family
    samples: continuations, neighbours, translations or next elements.

    A recipe's prompt that this run's vocabulary cannot spell loses what it lacks (with a
    warning) rather than the run losing its model.
    """
    logger = get_run_logger()
    ckpt_url = best_or_last(trained)
    loaded = checkpoint.load_checkpoint(ckpt_url)
    samples = family_of(cfg).run_samples(loaded, cfg)
    for note in samples.notes:
        logger.warning("%s", note)
    for method, texts in samples.by_method.items():
        assets.materializes(trained.samples_url(method), reads=[ckpt_url], name=f"samples ({method})")
        storage.write_text(trained.samples_url(method), samples_text(samples.prompts, texts))
        assets.describe(trained.samples_url(method), method=method, samples=len(texts), prompts=len(samples.prompts))
    first = next(iter(samples.by_method.items()), None)
    if first and first[1]:
        logger.info("samples (%s): %r", first[0], first[1][0][:120])
    return samples.by_method
