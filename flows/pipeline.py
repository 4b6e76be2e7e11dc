"""The pipeline flow: download, tokenize, build the vocabulary, split, train, evaluate, sample,
and decide about the champion. Its body reads as that stage table: a straight line of steps with
plain arguments; caching, retries and where results live are configured on the tasks and in
`flows.launch`, where training runs in `flows.training`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote
from pydantic import BaseModel

from flows import dispatch
from flows.launch import check_model_name, data_runner, preflight, storage_root, training_pool, with_results
from flows.settings import process_defaults
from flows.stack import orphans
from flows.training import run_training, train
from mllm import UserError, layout, storage
from mllm.config import RunConfig
from mllm.families.base import family_of
from mllm.resolve import recipe_names, resolve
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
from tasks.model.evaluate import describe
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
from tasks.tracking.store import run_url
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


class PipelineResult(BaseModel):
    recipe: str
    storage: str
    data: Prepared
    decision: Literal["promoted", "kept", "skipped", "reproduction"]
    reason: str
    trained: Trained | None  # None when skipped
    evaluation: Evaluation | None
    samples: dict[str, list[str]]
    mlflow_run_id: str
    champion: Outcome
    corpus_changes: dict[str, int] = {}  # a corpus of many files: files new, changed, removed, reused since last read


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
    overrides: list[str] = [],
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
    model_name = model or cfg.recipe
    root = storage_root(storage_url)
    preflight(root)
    pool = training_pool(recipe, train_on)
    if pool:
        dispatch.ensure_deployment(train, pool)  # no such pool: say so before the data stages
    # A full disk (storage, or the MLflow store beside it) is one line naming the root: no retry
    # makes room, and the same command goes on from what was kept.
    with storage.room_on(root):
        data = with_results(prepare, root, data_runner(cfg.data.task_runner))(cfg, root)
        key = train_key(cfg, data)
        registry = tracking_client(root)
        # A reproduction never reads or touches the registry: it verifies a run, it never competes.
        champion = None if reproduces else current_champion(registry, model_name)
        # Storage roots may share a tracking store (mlflow.db beside sibling roots, a server): a
        # run skips only when this root holds the finished training, so a new --storage trains.
        trained_here = storage.exists(layout.folder(root, layout.RUNS, key, "trained.json"))
        skip = (
            None
            if force or reproduces or not trained_here
            else skip_reason(champion, version_trained_on(registry, model_name, key), data.raw_sha256, key)
        )
        trained = evaluation = None
        samples: dict[str, list[str]] = {}
        where = {"train.pool": pool} if pool else {}
        if reproduces:
            where["reproduces"] = reproduces
        # A skipped run says so in its name: it would otherwise share the name of the run that trained.
        name = f"{cfg.recipe}-{key[:8]}" + ("-skipped" if skip else "")
        with RunTracker(cfg, root, tags={**tags, **where}, run_name=name) as run:
            # quote() every object a task of this flow takes: Prefect walks an unquoted argument down
            # to its last string and records any piece that came out of a subflow (the prepare flow
            # hands the config's source URL back unchanged) as a "flow_run" input, which Prefect 3.8's
            # UI cannot read ("Invalid TaskInputResponse": the Task Runs tab lists no task run).
            log_data(run.run_id, quote(cfg), root, quote(data))
            run.set_tags(lineage_tags(cfg, data))  # for `lineage`, skipped runs too
            # A corpus of many files: what changed since its sources were last read (a schedule's question).
            changes = corpus_changes(data, root)
            run.log_params({f"corpus.{k}": v for k, v in changes.items()})
            if (dropped := data.tokens.dropped_share()) is not None:
                run.log_params({"corpus.chars_dropped": round(dropped, 4)})  # by the tokenizer's normalisation
            if skip:
                outcome = log_skipped(run.run_id, quote(cfg), root, quote(champion), skip)
            else:
                trained = run_training(cfg, data, root, run.run_id, pool)
                evaluation, samples = with_results(evaluate, root)(cfg, trained, data)
                outage.check_back(trained.run_dir)
                outcome = judge(
                    run.run_id, cfg, root, trained, evaluation, samples, data, champion, reproduces, model_name
                )
    result = PipelineResult(
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
    publish(result)
    return result


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


def publish(result: PipelineResult) -> None:
    """The decision, and for a trained model a summary, as Prefect markdown artifacts."""
    slug = "".join(c if c.isalnum() else "-" for c in result.recipe.lower())
    link = _mlflow_link(result.storage, result.mlflow_run_id)
    create_markdown_artifact(
        decision_table(result, link), key=f"decision-{slug}", description=f"{result.recipe}: {result.decision}"
    )
    if result.trained is not None:
        create_markdown_artifact(
            summary(result, link), key=f"pipeline-{slug}", description=f"{result.recipe}: data, training and samples"
        )


def _mlflow_link(root: str, run_id: str) -> str:
    """The MLflow run as a link into the MLflow UI when the runs go to a server, else its id."""
    with contextlib.suppress(Exception):  # an artifact is no reason to fail a finished run
        if url := run_url(root, run_id):
            return f"[{run_id}]({url})"
    return f"`{run_id}`"


# The artifacts' tables hold short cells only (Prefect's UI cuts a long one at the right edge);
# the reason and the paths go below them as text, which wraps. The first row is the header: a
# table with an empty header row shows as an empty first row.
def decision_table(r: PipelineResult, link: str | None = None) -> str:
    c = r.champion
    cfg = resolve(r.recipe)
    rows = [("corpus sha256", f"`{r.data.raw_sha256[:16]}`"), ("MLflow run", link or f"`{r.mlflow_run_id}`")]
    if r.corpus_changes:
        rows.insert(1, ("corpus files", files_line(r.corpus_changes)))
    if r.decision == "skipped":
        rows.append(("champion", f"{c.name} v{c.version}"))
    elif r.decision == "reproduction":
        rows.append(("evaluation", describe(r.evaluation, cfg)))
    else:
        rows.append(("this model", f"{c.name} v{c.version}"))
        rows.append(("evaluation", describe(r.evaluation, cfg)))
        if c.previous:
            cs = c.champion_score
            measured = (
                f"{c.previous.headline} {_f(c.previous.score)} on the same split"
                if cs is None
                else f"{cs.headline} {cs.value:.4f} on this split"
            )
            rows.append(("previous champion", f"v{c.previous.version}, {measured}"))
    return "\n".join(
        [
            f"# {r.recipe}: {r.decision}",
            "",
            f"| decision | **{r.decision}** |",
            "|---|---|",
            *[f"| {k} | {v} |" for k, v in rows],
            "",
            f"**Why:** {r.reason}",
            "",
        ]
    )


def summary(r: PipelineResult, link: str | None = None) -> str:
    d, t, e = r.data, r.trained, r.evaluation
    cfg = resolve(r.recipe)
    lines = [
        f"# {r.recipe}",
        "",
        f"| model | {_model_cell(r.champion)} |",
        "|---|---|",
        f"| corpus | {d.raw_bytes:,} bytes, sha256 `{d.raw_sha256[:12]}` |",
        *([f"| corpus files | {files_line(r.corpus_changes)} |"] if r.corpus_changes else []),
        f"| tokens | {d.tokens.n_tokens:,} |",
        f"| vocabulary | {d.vocab.size} entries |",
        f"| split | train {d.splits.train.n_tokens:,} / val {d.splits.val.n_tokens:,}"
        + (f" / test {d.splits.test.n_tokens:,}" if d.splits.test else "")
        + " tokens |",
        f"| steps | {t.steps} ({t.stop_reason}), {t.tokens_per_s:,.0f} tokens/s |",
        f"| precision | {t.precision()} |",
        f"| compiled | {'yes' if t.compile_used else 'no'} ({t.compile_reason}) |",
        *([f"| attention | {t.attention} |"] if t.attention else []),
        *([f"| Muon's Newton-Schulz | {t.muon_precision} |"] if t.muon_precision else []),
        f"| MFU | {_mfu(t)} |",
        *([f"| threads | {t.threads_reason} |"] if t.threads_reason else []),
        *([f"| busy machine | {t.busy_line()} |"] if t.busy else []),
        f"| train loss | {_f(t.train_loss)} |",
        f"| evaluation | {describe(e, cfg)} |",
        f"| MLflow run | {link or f'`{r.mlflow_run_id}`'} |",
        "",
        f"**Source:** {d.source}",
        "",
        f"**Outputs:** `{t.run_dir}`",
        "",
        "## Samples",
        "",
    ]
    for method, texts in r.samples.items():
        shown = "\n".join(t.strip() for t in texts) or "(no prompt fits the vocabulary)"
        lines += [f"**{method}**", "", "```", shown, "```", ""]
    return "\n".join(lines)


def files_line(c: dict[str, int]) -> str:
    """A corpus's files against the last read of its sources: '12 files: 1 new, 0 changed, 0 removed, 11 reused; 1 tokenized'."""
    line = (
        f"{c['files']} files: {c['new']} new, {c['changed']} changed, {c['removed']} removed, {c['reused']} reused; "
        f"{c['tokenized']} tokenized"
    )
    return (
        line
        + (f"; {c['duplicates']} the same bytes as another, read once" if c.get("duplicates") else "")
        + (f"; {c['skipped']} left out" if c.get("skipped") else "")
        + (f" ({c['empty']} empty)" if c.get("empty") else "")
    )


def _mfu(t: Any) -> str:
    if t.mfu is None or not t.peak_flops:
        return "n/a"
    return f"{t.mfu:.1%} of {t.peak_flops / 1e12:.3g} TFLOP/s ({t.peak_source})"


def _model_cell(c: Outcome) -> str:
    if c.decision == "reproduction":
        return "not registered (a reproduction)"
    return f"{c.name} v{c.version}, {'now champion' if c.promoted else 'champion kept'}"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
