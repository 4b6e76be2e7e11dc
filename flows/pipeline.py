"""The flows: `prepare` (data stages), `train`, `evaluate`, and `pipeline` (all of it).

Each flow body reads as the recipe: a straight line of task calls. Caching, retries and where
results live are configured on the tasks and in `with_results`, not in the logic.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from mllm import storage
from mllm.config import RunConfig, recipe_names, resolve, with_pool
from flows import dispatch
from tasks import data as data_tasks
from tasks import model as model_tasks
from tasks import tracking
from tasks.caching import result_storage
from tasks.tracking import RunTracker
from tasks.model import Evaluation, Prepared, Trained


def storage_root(storage_url: str | None = None) -> str:
    """The storage root: --storage, else $MLLM_STORAGE, else ./storage."""
    root = storage_url or os.environ.get("MLLM_STORAGE") or "storage"
    if "://" not in root:
        root = os.path.abspath(os.path.expanduser(root))
    return root.rstrip("/")


def with_results(fl: Any, root: str) -> Any:
    """The flow with its task results (and so Prefect's cache records) kept under `root`."""
    # The flows themselves persist nothing (a failed run would leave its pickled exception in
    # storage); their tasks take this storage for their results and cache records.
    return fl.with_options(result_storage=result_storage(root), persist_result=False)


@flow(name="prepare", log_prints=True)
def prepare(cfg: RunConfig, root: str) -> Prepared:
    d = cfg.data
    raw = data_tasks.download(d.source, d.sha256, root)
    tokens = data_tasks.tokenize(raw, d.tokenizer, root)
    vocab = data_tasks.build_vocabulary(tokens, d.vocab, root)
    splits = data_tasks.split(tokens, vocab, d.split, root)
    return Prepared(raw_sha256=raw.sha256, raw_url=raw.url, raw_bytes=raw.bytes, source=raw.source,
                    tokens=tokens, vocab=vocab, splits=splits)


@flow(name="train")
def train(cfg: RunConfig, data: Prepared, root: str, run_id: str | None = None) -> Trained:
    return model_tasks.train(cfg, data, root, run_id)


@flow(name="evaluate")
def evaluate(cfg: RunConfig, trained: Trained, data: Prepared) -> tuple[Evaluation, dict[str, list[str]]]:
    evaluation = model_tasks.evaluate(cfg, trained, data, "val")
    samples = model_tasks.generate(cfg, trained)
    return evaluation, samples


class PipelineResult(BaseModel):
    recipe: str
    storage: str
    data: Prepared
    decision: Literal["promoted", "kept", "skipped"]
    reason: str
    trained: Trained | None  # None when skipped
    evaluation: Evaluation | None
    samples: dict[str, list[str]]
    mlflow_run_id: str
    champion: dict[str, Any]


# The shipped recipes: the Prefect UI shows the parameter as a choice.
RecipeName = Literal[tuple(recipe_names())]  # type: ignore[valid-type]


@flow(name="pipeline")
def pipeline(recipe: RecipeName = "default", source: str | None = None, storage_url: str | None = None,
             overrides: list[str] = [], tags: dict[str, str] = {},  # noqa: B006
             train_on: str | None = None, force: bool = False) -> PipelineResult:
    """Download, tokenize, build the vocabulary, split, train, evaluate and sample one recipe.

    - recipe: a shipped recipe; source: the corpus URL (a path, file://, s3://, https://) when
      not the recipe's; storage_url: the storage root [$MLLM_STORAGE or ./storage]
    - overrides: config fields as `section.field=value`, e.g. `train.max_steps=500`
    - train_on: a work pool to train on [this process]
    - force: train even when the champion was trained on the same data and code

    The source is always read again. When the recipe's champion model was trained on the same
    data, config and code, the run skips training and says so; otherwise the new model is
    evaluated on the same validation split as the champion and becomes champion only if better.
    """
    cfg = resolve(recipe, overrides=with_pool(overrides, train_on), source=source)
    root = storage_root(storage_url)
    if cfg.train.pool:
        dispatch.ensure_deployment(cfg.train.pool)  # no such pool: say so before the data stages
    data = with_results(prepare, root)(cfg, root)
    champion = tracking.champion_of(cfg, root)
    key = model_tasks.train_key(cfg, data)
    done = tracking.version_trained_on(cfg, root, key) if champion and not force else None
    with RunTracker(cfg, root, tags=tags) as run:
        tracking.log_data(run.run_id, cfg, root, data)
        if done:
            reason = (f"data, config and code unchanged since champion v{champion['version']} was trained"
                      if done == champion["version"] else
                      f"data, config and code unchanged since v{done} was trained, which did not beat "
                      f"champion v{champion['version']}")
            reason += f" (corpus sha256 {data.raw_sha256[:12]}, training key {key}); force retrains"
            tracking.log_skipped(run.run_id, cfg, root, champion, reason)
            outcome = {**champion, "name": cfg.recipe, "promoted": False, "decision": "skipped", "reason": reason}
            trained = evaluation = None
            samples: dict[str, list[str]] = {}
        else:
            if cfg.train.pool:
                trained = dispatch.train_on_pool(cfg, data, root, run.run_id, cfg.train.pool)
            else:
                trained = with_results(train, root)(cfg, data, root, run.run_id)
            evaluation, samples = with_results(evaluate, root)(cfg, trained, data)
            score = None
            if champion and champion["checkpoint"] and champion["splits_key"] != data.splits.key:
                scorer = model_tasks.score_checkpoint.with_options(result_storage=result_storage(root))
                score = scorer(champion["checkpoint"], data, cfg.train.window)
            outcome = tracking.log_outcome(run.run_id, cfg, root, trained, evaluation, samples, data, score)
    result = PipelineResult(recipe=cfg.recipe, storage=root, data=data, decision=outcome["decision"],
                            reason=outcome["reason"], trained=trained, evaluation=evaluation, samples=samples,
                            mlflow_run_id=run.run_id, champion=outcome)
    slug = _slug(cfg.recipe)
    create_markdown_artifact(decision_table(result), key=f"decision-{slug}",
                             description=f"{cfg.recipe}: {result.decision}")
    if trained is not None:
        create_markdown_artifact(summary(result), key=f"pipeline-{slug}",
                                 description=f"{cfg.recipe}: data, training and samples")
    return result


def decision_table(r: PipelineResult) -> str:
    c = r.champion
    rows = [("decision", f"**{r.decision}**"), ("reason", r.reason), ("corpus sha256", r.data.raw_sha256[:16]),
            ("MLflow run", f"`{r.mlflow_run_id}`")]
    if r.decision == "skipped":
        rows.append(("champion", f"{c.get('name')} v{c.get('version')} (run `{c.get('run_id')}`)"))
    else:
        rows.append(("this model", f"{c.get('name')} v{c.get('version')}, val loss {c.get('val_loss', float('nan')):.4f}, "
                                   f"{r.evaluation.bits_per_byte:.4f} bits/byte"))
        prev = c.get("previous")
        if prev:
            score = c.get("champion_score")
            measured = (f"{score['bits_per_byte']:.4f} bits/byte on this split" if score
                        else f"val loss {prev['val_loss']:.4f} on the same split")
            rows.append(("previous champion", f"v{prev['version']}, {measured}"))
    return "\n".join([f"# {r.recipe}: {r.decision}", "", "| | |", "|---|---|",
                      *[f"| {k} | {v} |" for k, v in rows], ""])


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def summary(r: PipelineResult) -> str:
    d, t, e = r.data, r.trained, r.evaluation
    lines = [
        f"# {r.recipe}",
        "",
        "| | |",
        "|---|---|",
        f"| corpus | {d.source} ({d.raw_bytes:,} bytes, sha256 `{d.raw_sha256[:12]}`) |",
        f"| tokens | {d.tokens.n_tokens:,} |",
        f"| vocabulary | {d.vocab.size} entries |",
        f"| split | train {d.splits.train.n_tokens:,} / val {d.splits.val.n_tokens:,}"
        + (f" / test {d.splits.test.n_tokens:,}" if d.splits.test else "") + " tokens |",
        f"| steps | {t.steps} ({t.stop_reason}), {t.tokens_per_s:,.0f} tokens/s |",
        f"| train loss | {_f(t.train_loss)} |",
        f"| val loss | {e.loss:.4f} ({e.bits_per_token:.3f} bits/token, {e.bits_per_byte:.3f} bits/byte; "
        f"bigram baseline {e.bigram_bits_per_token:.3f} bits/token) |",
        f"| outputs | `{t.run_dir}` |",
        f"| MLflow run | `{r.mlflow_run_id}`; model {r.champion.get('name')} v{r.champion.get('version')}, "
        f"{'now champion' if r.champion.get('promoted') else 'champion kept'} ({r.champion.get('reason', '')}) |",
        "",
        "## Samples",
        "",
    ]
    for method, texts in r.samples.items():
        lines += [f"**{method}**", "", "```", texts[0].strip(), "```", ""]
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
