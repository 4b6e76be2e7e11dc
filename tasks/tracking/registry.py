"""The model registry: a registered model per recipe, and the `champion` alias that moves only
when a new version beats it (the policy: tasks/tracking/champion.py); the pipeline's tasks that
record a run's outcome, its model among it (tasks/tracking/logged_model.py)."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

import mlflow
from prefect import task

from mllm import storage
from mllm.config import RunConfig
from mllm.redact import scrub
from tasks.caching import forget_exception
from tasks.tracking.champion import (
    CHAMPION,
    FILES_TAG,
    Champion,
    ChampionScore,
    Outcome,
    current_champion,
    decide,
    files_tag,
)
from tasks.tracking.logged_model import checkpoint_models, log_pyfunc
from tasks.tracking.tracker import RunTracker


def log_model(
    run: RunTracker,
    evaluation: Any,
    version_tags: dict[str, str] | None = None,
    champion_score: ChampionScore | None = None,
    model_name: str | None = None,
    last_url: str | None = None,
    last_step: int | None = None,
    reproduces: str | None = None,
    files: list[str] | None = None,
) -> Outcome:
    """Log the evaluated checkpoint as a pyfunc model (tasks/tracking/served_model.py), register a version
    under `model_name` (default: the recipe), and move `champion` to it only if `decide` says its
    headline metric beats the champion's. The logged model carries the checkpoint's step and its
    validation metrics; the last checkpoint (`last_url` at `last_step`), when another, is a
    logged model of its own (see `checkpoint_models`). A reproduction (`reproduces`: the run it
    reproduces) logs its model and registers nothing: it verifies, it never competes. `files`:
    the digests of the corpus's files, kept on the version (FILES_TAG) for the next decision."""
    name = model_name or run.cfg.recipe
    checkpoint_url, e = evaluation.checkpoint, evaluation
    info, best_step = log_pyfunc(run, checkpoint_url)
    checkpoint_models(run, info.model_id, best_step, e, last_url, last_step)
    if reproduces:
        outcome = Outcome(
            name=name,
            version="",
            decision="reproduction",
            run_id=run.run_id,
            reason=f"reproduces run {reproduces}: registered nothing, no alias moved",
            model_uri=info.model_uri,
            val_loss=float(e.loss),
        )
        record_decision(run, outcome)
        return outcome
    previous = current_champion(run.client, name)
    tags = {
        "val_loss": repr(float(e.loss)),
        "run_id": run.run_id,
        "checkpoint": scrub(checkpoint_url),
        "headline": e.headline,
        "headline.value": repr(float(e.score)),
        **(version_tags or {}),
    }
    if files and (listed := files_tag(files)):
        tags[FILES_TAG] = listed
    with _quiet_registration():
        registered = mlflow.register_model(info.model_uri, name, tags=tags)
    promoted, reason = decide(e.headline, float(e.score), e.higher_is_better, previous, champion_score, files)
    if promoted:
        run.client.set_registered_model_alias(name, CHAMPION, registered.version)
    outcome = Outcome(
        name=name,
        version=str(registered.version),
        decision="promoted" if promoted else "kept",
        reason=reason,
        promoted=promoted,
        run_id=run.run_id,
        model_uri=info.model_uri,
        val_loss=float(e.loss),
        previous=previous,
        champion_score=champion_score,
    )
    run.client.set_model_version_tag(name, outcome.version, "champion.decision", f"{outcome.decision}: {reason}")
    record_decision(run, outcome)
    return outcome


@contextlib.contextmanager
def _quiet_registration():
    """Without MLflow's own lines about a registration ("Successfully registered model",
    "Waiting up to 300 seconds", "Created version"): the run's outcome says what was registered."""
    waiting = logging.getLogger("mlflow.store.model_registry.abstract_store")
    level = waiting.level
    waiting.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        waiting.setLevel(level)


def record_decision(run: RunTracker, outcome: Outcome) -> None:
    """The decision as run tags (`decision`, `decision.reason`) and as `champion.json`."""
    run.set_tags(
        {
            "decision": outcome.decision,
            "decision.reason": outcome.reason,
            "champion.decision": f"{outcome.decision}: {outcome.reason}",
        }
    )
    run.log_dict(outcome.model_dump(mode="json"), "champion.json")


# --- the pipeline's registry tasks -----------------------------------------------------------


def training_params(trained: Any) -> dict[str, Any]:
    """What the training found out about this machine: the precision it chose and why, with the
    probe's step times, whether it ran compiled and why, the attention kernel it measured
    fastest, the precision Muon orthogonalised in, the peak its MFU is measured against, its
    threads and whether the machine was busy."""
    params = {
        "train.dtype_used": trained.dtype_used,
        "train.dtype_reason": trained.dtype_reason,
        **{f"train.dtype_probe_{k}_ms": v for k, v in (trained.dtype_probe_ms or {}).items()},
        "train.compile_used": trained.compile_used,
        "train.compile_reason": trained.compile_reason,
    }
    if trained.attention:
        params["train.attention"] = trained.attention
    if trained.muon_precision:
        params["train.muon_precision"] = trained.muon_precision
    if trained.peak_flops:
        params.update(
            {"train.peak_tflops": f"{trained.peak_flops / 1e12:.4g}", "train.peak_source": trained.peak_source}
        )
    # The threads it chose and why, and what a busy machine cost it (steps planned against done).
    machine = {
        "train.threads": trained.threads,
        "train.threads_reason": trained.threads_reason,
        "train.busy": trained.busy,
        "train.cpu_share": trained.cpu_share,
        "train.steps_planned": trained.steps_planned,
        "train.load_average": trained.load_average,
    }
    params.update({k: v for k, v in machine.items() if v is not None})
    return params


@task(name="log-skipped", on_failure=[forget_exception], retries=2, retry_delay_seconds=2)
def log_skipped(run_id: str, cfg: RunConfig, root: str, champion: Champion, reason: str) -> Outcome:
    """A run that did not train: the champion it deferred to, and why."""
    run = RunTracker.attach(run_id, cfg, root)
    run.set_tags({"champion.version": champion.version, "champion.run_id": champion.run_id or ""})
    outcome = Outcome(
        name=champion.name,
        version=champion.version,
        decision="skipped",
        reason=reason,
        run_id=champion.run_id,
        val_loss=champion.val_loss,
        previous=champion,
    )
    record_decision(run, outcome)
    return outcome


@task(name="log-outcome", on_failure=[forget_exception], retries=2, retry_delay_seconds=2)
def log_outcome(
    run_id: str,
    cfg: RunConfig,
    root: str,
    trained: Any,
    evaluation: Any,
    samples: dict[str, list[str]],
    data: Any,
    champion_score: ChampionScore | None = None,
    reproduces: str | None = None,
    model_name: str | None = None,
    files: list[str] | None = None,
) -> Outcome:
    """Final metrics, report, samples, loss curve; the model, and the champion decision."""
    run = RunTracker.attach(run_id, cfg, root)
    e = evaluation
    run.log_metrics(
        [
            {
                "step": trained.steps,
                "final_val_loss": e.loss,
                "final_mfu": trained.mfu,
                **{f"final_{k}": v for k, v in e.metrics.items() if k != "val_loss"},
            }
        ]
    )
    run.log_params(training_params(trained))
    run.log_text(storage.read_text(e.report), "evaluation.md")
    for name in e.files:
        if storage.exists(storage.join(trained.run_dir, name)):
            run.log_file(storage.join(trained.run_dir, name), name)
    run.log_dict(e.model_dump(mode="json"), "evaluation.json")
    for method in samples:
        run.log_text(storage.read_text(trained.samples_url(method)), f"samples/{method}.txt")
    run.log_dict({"prompts": cfg.sample.prompts, "methods": list(samples)}, "samples/prompts.json")
    run.log_loss_curve()
    run.set_tags(
        {
            "train.steps": trained.steps,
            "train.stop_reason": trained.stop_reason,
            "train.run_dir": trained.run_dir,
            "train.resumed_from_step": trained.resumed_from_step,
            "train.key": trained.key,
        }
    )
    version_tags = {"train.key": trained.key, "data.splits_key": data.splits.key, "data.raw_sha256": data.raw_sha256}
    outcome = log_model(
        run,
        e,
        version_tags=version_tags,
        champion_score=champion_score,
        model_name=model_name,
        last_url=trained.checkpoint,
        last_step=trained.steps,
        reproduces=reproduces,
        files=files,
    )
    run.set_tags(
        {
            "model_uri": outcome.model_uri,
            **({"model_version": f"{outcome.name}/{outcome.version}"} if outcome.version else {}),
        }
    )
    return outcome
