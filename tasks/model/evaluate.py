"""The evaluation stage as Prefect tasks: a run's best checkpoint scored on a split as its family
scores it, and the champion's checkpoint scored on this run's split."""

from __future__ import annotations

from prefect import get_run_logger, task

from mllm import UserError, layout, storage
from mllm.config import RunConfig
from mllm.families.base import Evaluation as Scores
from mllm.families.base import family_of
from mllm.runtime import checkpoint
from tasks import assets
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.model import Evaluation, Prepared, Trained
from tasks.tracking.champion import ChampionScore


def best_or_last(trained: Trained) -> str:
    best = trained.best_checkpoint
    return best if best and storage.exists(best) else trained.checkpoint


def _evaluate_key(cfg: RunConfig, trained: Trained, data: Prepared, split: str = "val") -> str:
    # The checkpoint is named by the training key and its step count (a longer resumed
    # training makes a new one); the split by its digest.
    return storage.digest(
        [
            "evaluate",
            trained.key,
            trained.steps,
            data.splits.key,
            split,
            cfg.model_dump(include={"train", "sample", "data"}),
            layout.package_digest(),
        ]
    )


@task(
    name="evaluate",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_evaluate_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def evaluate(cfg: RunConfig, trained: Trained, data: Prepared, split: str = "val") -> Evaluation:
    """Score the best checkpoint on a whole split, as its family scores it; the report and the
    pictures and exports go beside the checkpoints."""
    part = getattr(data.splits, split)
    if part is None:
        raise UserError(f"there is no {split} split: set data.split.test_fraction above 0 to make one")
    ckpt_url = best_or_last(trained)
    loaded = checkpoint.load_checkpoint(ckpt_url)
    family = family_of(cfg)
    e = family.evaluate(loaded, cfg, part, data.splits.train, trained.run_dir)
    report_url = storage.join(trained.run_dir, f"eval-{split}.md")
    assets.materializes(report_url, reads=[ckpt_url, data.splits.url], name=f"evaluation ({split})")
    storage.write_text(report_url, e.report)
    result = Evaluation(
        split=split,
        checkpoint=ckpt_url,
        loss=e.loss,
        tokens=e.count,
        report=report_url,
        headline=e.headline,
        higher_is_better=e.higher_is_better,
        metrics=e.metrics,
        files=e.files,
    )
    storage.write_json(storage.join(trained.run_dir, f"eval-{split}.json"), result.model_dump(mode="json"))
    assets.describe(
        report_url,
        split=split,
        headline=e.headline,
        value=e.metrics.get(e.headline),
        loss=e.loss,
        targets=e.count,
        checkpoint_steps=trained.steps,
    )
    logger = get_run_logger()
    logger.info("%s: %s", split, family.describe(e))
    for note in e.notes:
        logger.warning("%s", note)
    return result


def describe(e: Evaluation, cfg: RunConfig) -> str:
    """An evaluation in one line, as its family puts it."""
    return family_of(cfg).describe(Scores(e.headline, e.higher_is_better, e.loss, e.tokens, e.metrics, ""))


def _score_key(checkpoint_url: str, cfg: RunConfig, data: Prepared, split: str = "val") -> str:
    return storage.digest(
        [
            "score",
            checkpoint_url,
            data.splits.key,
            split,
            cfg.model_dump(include={"train", "data"}),
            layout.package_digest(),
        ]
    )


@task(
    name="score-champion",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_score_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def score_champion(checkpoint_url: str, cfg: RunConfig, data: Prepared, split: str = "val") -> ChampionScore | None:
    """Score another run's checkpoint (the champion's) on this run's split, as its family does
    (None: the family's headline does not depend on the split).

    No asset: it writes nothing to storage, and Prefect records what a task reads only beside
    what it writes (a materialization's upstream assets)."""
    part = getattr(data.splits, split)
    loaded = checkpoint.load_checkpoint(checkpoint_url)
    e = family_of(loaded).rescore(loaded, cfg, part, data.vocab.url)
    if e is None:
        return None
    get_run_logger().info(
        "champion %s on this %s split: %s %.4f, loss %.4f", checkpoint_url, split, e.headline, e.value, e.loss
    )
    return ChampionScore(
        checkpoint=checkpoint_url,
        split=split,
        splits_key=data.splits.key,
        loss=e.loss,
        tokens=e.count,
        headline=e.headline,
        value=e.value,
    )
