"""The pipeline flow: download, tokenize, build the vocabulary, split, train, evaluate, sample,
and decide about the champion, and the `prepare` and `evaluate` flows it is made of. Caching,
retries and where results live are configured on the tasks and in `flows.launch`, where training
runs in `flows.training`, what a run shows in Prefect's UI in `flows.artifacts.pipeline`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from flows import dispatch
from flows.artifacts.pipeline import PipelineResult, publish
from flows.launch import check_model_name, data_runner, preflight, storage_root, training_pool, with_results
from flows.settings import process_defaults
from flows.stack import orphans
from flows.training import run_training, train
from mllm import UserError, layout, storage
from mllm.config import RunConfig
from mllm.families.base import family_of
from mllm.resolve import NO_OVERRIDES, Overrides, recipe_names, resolve
from tasks.caching import forget_exception, result_storage
from tasks.data.download import corpus_changes, download, download_source, file_identities
from tasks.data.generated import generate_data
from tasks.data.pairs import numbers_corpus, prepare_pairs
from tasks.data.split import split_source
from tasks.data.tokenize import dropped_line, tokenize_source
from tasks.data.vocabulary import build_vocabulary
from tasks.model import Evaluation, Prepared, Trained
from tasks.model import evaluate as evaluation_stage
from tasks.model import generate as sample_stage
from tasks.model.train import lineage_tags, train_key
from tasks.tracking import outage
from tasks.tracking.champion import (
    Champion,
    Outcome,
    current_champion,
    shares_files,
    skip_reason,
    version_trained_on,
)
from tasks.tracking.registry import log_outcome, log_skipped
from tasks.tracking.store import client as tracking_client
from tasks.tracking.tracker import RunTracker, log_data


@flow(name="prepare", log_prints=True, flow_run_name=lambda: f"{_run_name()}-prepare")
def prepare(cfg: RunConfig, root: str) -> Prepared:
    """The data stages: download, tokenize, build the vocabulary, split; for parallel text,
    download (or make the numbers corpus) and prepare the pairs; for a family that makes its own
    data, make it."""
    d, kind = cfg.data, family_of(cfg).data
    if kind == "generated":
        made = generate_data(d, family_of(cfg).name, root)
        return Prepared(
            raw_sha256=made.sha256,
            raw_url=made.splits.url,
            raw_bytes=made.bytes,
            source=made.source,
            tokens=made.tokens,
            vocab=made.vocab,
            splits=made.splits,
        )
    if kind == "pairs":
        source = d.source or numbers_corpus(d.pairs.numbers, root)
        raw = download(source, d.sha256, root)
        pairs = prepare_pairs(raw, d, cfg.model.max_src_len, cfg.model.max_tgt_len, root)
        return Prepared(
            raw_sha256=raw.sha256,
            raw_url=raw.url,
            raw_bytes=raw.bytes,
            source=raw.source,
            tokens=pairs.tokens,
            vocab=pairs.vocab,
            splits=pairs.splits,
            source_side=pairs.source_side,
        )
    raw = download_source(d, root)  # one file, or many: listed, then file by file
    tokens = tokenize_source(raw, d, root)  # each file once per tokenizer
    if line := dropped_line(tokens):
        get_run_logger().warning(line)
    vocab = build_vocabulary(tokens, d.vocab, root)
    splits = split_source(tokens, vocab, d, root)  # one file contiguous; many span by span, pack by pack
    return Prepared(
        raw_sha256=raw.sha256,
        raw_url=raw.url,
        raw_bytes=raw.bytes,
        source=raw.source,
        tokens=tokens,
        vocab=vocab,
        splits=splits,
        raw_files=raw.files,
        raw_manifest=raw.manifest,
        raw_skipped=raw.skipped,
        raw_previous=raw.previous,
        raw_duplicates=raw.duplicates,
    )


@flow(name="evaluate", flow_run_name=lambda: f"{_run_name()}-evaluate")
def evaluate(cfg: RunConfig, trained: Trained, data: Prepared) -> tuple[Evaluation, dict[str, list[str]]]:
    """Score the trained model on the validation split and generate its samples."""
    evaluation = evaluation_stage.evaluate(cfg, trained, data, "val")
    samples = sample_stage.generate(cfg, trained)
    return evaluation, samples


# The shipped recipes: the Prefect UI shows the parameter as a choice.
RecipeName = Literal[tuple(recipe_names())]  # type: ignore[valid-type]


def _run_name() -> str:
    """A flow run named after its recipe and start time, not Prefect's random "ultra-wombat"."""
    import time

    from prefect.runtime import flow_run

    p = flow_run.parameters
    recipe = p.get("recipe") or getattr(p.get("cfg"), "recipe", None) or flow_run.flow_name
    return f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


# The pipeline's parameters as the Prefect UI's Run form names them, for the CLI options of the same.
FORM_FIELDS = {
    "--set": "overrides",
    "--storage": "storage_url",
    "--source": "source",
    "--train-on": "train_on",
    "--recipe": "recipe",
    "--tag": "tags",
    "--force": "force",
    "--model": "model",
}


def _form_fields(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A run started from a deployment (the UI's Run form, a schedule) has no command line: its
    error names the form's fields (`overrides`, `storage_url`) where the CLI's names its options."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            from prefect.runtime import deployment

            if not deployment.id:
                raise
            pattern = r"--(?:" + "|".join(f[2:] for f in FORM_FIELDS) + r")\b"
            raise UserError(re.sub(pattern, lambda m: FORM_FIELDS[m.group(0)], str(e))) from None

    return wrapper


@flow(name="pipeline", on_failure=[forget_exception], on_crashed=[forget_exception], flow_run_name=_run_name)
@_form_fields
def pipeline(
    recipe: RecipeName = "default",
    source: str | list[str] | None = None,
    storage_url: str | None = None,
    overrides: Overrides = NO_OVERRIDES,
    tags: dict[str, str] = {},
    train_on: str | None = None,
    force: bool = False,
    reproduces: str | None = None,
    model: str | None = None,
) -> PipelineResult:
    """Download, tokenize, build the vocabulary, split, train, evaluate and sample one recipe.

    The source is always read again. When a version of the recipe's model was trained on the same
    data, config and code, the run skips training and says so; otherwise the new model is
    evaluated on the same validation split as the champion and becomes champion only if better.

    Args:
        recipe: A shipped recipe (see `mllm-pipeline recipes`).
        source: The corpus to train on when not the recipe's own: a path, file://, s3:// or https:// URL.
        storage_url: The storage root for data, checkpoints and results [$MLLM_STORAGE or ./storage].
        overrides: Config fields to change, as section.field=value (e.g. train.max_steps=500).
        tags: Extra MLflow run tags, as key: value.
        train_on: A work pool whose worker trains the model [the recipe's pipeline.pool, else this process].
        force: Do not skip when a version was already trained on the same data, config and code: evaluate,
            register and judge again (a finished training of the same key in storage is reused, not repeated).
        reproduces: The MLflow run this run reproduces (`mllm-pipeline reproduce` sets it): it trains and
            evaluates, registers nothing and moves no alias; the run is tagged `reproduces`.
        model: The registered model the run's model joins and is judged in [the recipe's name].
    """
    process_defaults()  # a worker (a schedule's run) imports the flows without the CLI
    orphans.running_here(flow_run.get_id())  # for `stack up`, should the stack's database go down under it
    cfg = resolve(recipe, overrides=overrides, source=source)
    if model:
        check_model_name(model)
    root = storage_root(storage_url)
    preflight(root)
    pool = training_pool(recipe, train_on)
    if pool:
        dispatch.ensure_deployment(train, pool)  # no such pool: say so before the data stages
    plan = RunPlan(cfg, root, pool, force, reproduces, model or cfg.recipe)
    # A full disk (storage, or the MLflow store beside it) is one line naming the root: no retry
    # makes room, and the same command goes on from what was kept.
    with storage.room_on(root):
        data = with_results(prepare, root, data_runner(cfg.data.task_runner))(cfg, root)
        result = plan.tracked(data, tags)
    publish(result)
    return result


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One pipeline run after its data stages: what it was asked, and where it goes."""

    cfg: RunConfig
    root: str
    pool: str | None
    force: bool
    reproduces: str | None
    model: str

    def skip(self, data: Prepared, key: str, registry: Any, champion: Champion | None) -> str | None:
        """Why this run need not train (the champion was trained on the same data, config and
        code), or None."""
        # Storage roots may share a tracking store (mlflow.db beside sibling roots, a server): a
        # run skips only when this root holds the finished training, so a new --storage trains.
        trained_here = storage.exists(layout.folder(self.root, layout.RUNS, key, "trained.json"))
        if self.force or self.reproduces or not trained_here:
            return None
        return skip_reason(champion, version_trained_on(registry, self.model, key), data.raw_sha256, key)

    def tracked(self, data: Prepared, tags: dict[str, str]) -> PipelineResult:
        """The MLflow run: the data logged, then the training judged against the champion, or the skip."""
        cfg, root = self.cfg, self.root
        # A reproduction never reads or touches the registry: it verifies a run, it never competes.
        key, registry = train_key(cfg, data), tracking_client(root)
        champion = None if self.reproduces else current_champion(registry, self.model)
        skip = self.skip(data, key, registry, champion)
        where = {"train.pool": self.pool} if self.pool else {}
        if self.reproduces:
            where["reproduces"] = self.reproduces
        # A skipped run says so in its name: it would otherwise share the name of the run that trained.
        name = f"{cfg.recipe}-{key[:8]}" + ("-skipped" if skip else "")
        trained = evaluation = None
        samples: dict[str, list[str]] = {}
        with RunTracker(cfg, root, tags={**tags, **where}, run_name=name) as run:
            changes = log_inputs(run, cfg, root, data)
            if skip:
                outcome = log_skipped(run.run_id, quote(cfg), root, quote(champion), skip)
            else:
                trained = run_training(cfg, data, root, run.run_id, self.pool)
                evaluation, samples = with_results(evaluate, root)(cfg, trained, data)
                outage.check_back(trained.run_dir)
                args = (trained, evaluation, samples, data, champion, self.reproduces, self.model)
                outcome = judge(run.run_id, cfg, root, *args)
        return PipelineResult(
            recipe=cfg.recipe,
            storage=root,
            data=data,
            decision=outcome.decision,
            reason=outcome.reason,
            trained=trained,
            evaluation=evaluation,
            samples=samples,
            mlflow_run_id=run.run_id,
            champion=outcome,
            corpus_changes=changes,
        )


def log_inputs(run: RunTracker, cfg: RunConfig, root: str, data: Prepared) -> dict[str, int]:
    """The run's data and lineage, skipped runs too; a corpus's changes since its sources were last
    read (a schedule's question), which it returns."""
    # quote() every object a task of this flow takes: Prefect walks an unquoted argument down
    # to its last string and records any piece that came out of a subflow (the prepare flow
    # hands the config's source URL back unchanged) as a "flow_run" input, which Prefect 3.8's
    # UI cannot read ("Invalid TaskInputResponse": the Task Runs tab lists no task run).
    log_data(run.run_id, quote(cfg), root, quote(data))
    run.set_tags(lineage_tags(cfg, data))  # for `lineage`
    changes = corpus_changes(data, root)
    run.log_params({f"corpus.{k}": v for k, v in changes.items()})
    if (dropped := data.tokens.dropped_share()) is not None:
        run.log_params({"corpus.chars_dropped": round(dropped, 4)})  # by the tokenizer's normalisation
    return changes


def judge(
    run_id: str,
    cfg: RunConfig,
    root: str,
    trained: Trained,
    evaluation: Evaluation,
    samples: dict[str, list[str]],
    data: Prepared,
    champion: Champion | None,
    reproduces: str | None = None,
    model: str | None = None,
) -> Outcome:
    """Register the challenger under `model` (default: the recipe); it becomes champion only if it
    beats the champion on the same validation split (the champion's checkpoint is scored on this
    run's split when its own differs), and is not judged at all against a champion whose corpus
    shares no file with its own. A reproduction is logged the same way but registered and judged
    not at all."""
    score = None
    files = None if family_of(cfg).data == "generated" else file_identities(data)
    rival = champion is not None and shares_files(champion, files)
    if rival and champion.checkpoint and champion.splits_key != data.splits.key and storage.exists(champion.checkpoint):
        scorer = evaluation_stage.score_champion.with_options(result_storage=result_storage(root))
        score = scorer(champion.checkpoint, quote(cfg), quote(data))
    return log_outcome(
        run_id,
        quote(cfg),
        root,
        quote(trained),
        quote(evaluation),
        quote(samples),
        quote(data),
        score,
        reproduces,
        model,
        quote(files),
    )
