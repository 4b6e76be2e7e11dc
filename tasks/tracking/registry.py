"""The model registry: a registered model per recipe, and the `champion` alias that moves only
when a new version beats it.

The policy is two pure functions of typed inputs, `skip_reason` (is there anything to train?)
and `decide` (does the new version beat the champion?), so it is tested without a server. The
rest registers a checkpoint as an MLflow model (`tasks/tracking/served_model.py` and `mllm` are its code)
and records the decision as tags on the run and the version.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import mlflow
import mlflow.pyfunc
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from prefect import task
from pydantic import BaseModel

import mllm
from mllm import storage
from mllm.config import RunConfig
from mllm.families.base import family_of
from mllm.redact import scrub
from mllm.runtime.checkpoint import read_checkpoint
from tasks.caching import forget_exception
from tasks.tracking import served_model
from tasks.tracking.provenance import version
from tasks.tracking.tracker import RunTracker

CHAMPION = "champion"
TRAINING_ONLY = ("optimizer", "scheduler", "rng", "data_state")  # checkpoint keys the model needs not

Decision = Literal["promoted", "kept", "skipped", "reproduction"]


class Champion(BaseModel):
    """The version that holds the `champion` alias, with what it was trained and measured on."""

    name: str
    version: str
    run_id: str | None = None
    checkpoint: str | None = None
    val_loss: float | None = None
    train_key: str | None = None
    splits_key: str | None = None
    raw_sha256: str | None = None
    headline: str | None = None  # the family's headline metric, and its value for this version
    score: float | None = None
    files: list[str] | None = None  # its corpus's file digests, shortened (FILES_TAG); None: not recorded


class ChampionScore(BaseModel):
    """The champion's checkpoint scored on a challenger's validation split: its family's headline
    metric (`headline`, `value`) and loss there."""

    checkpoint: str
    split: str
    splits_key: str
    loss: float
    tokens: int
    headline: str
    value: float


class Outcome(BaseModel):
    """What a pipeline run did about the recipe's model."""

    name: str
    version: str  # the new version; the champion's when skipped; "" for a reproduction
    decision: Decision
    reason: str
    promoted: bool = False
    run_id: str | None = None
    model_uri: str | None = None
    val_loss: float | None = None
    previous: Champion | None = None  # the champion before this run
    champion_score: ChampionScore | None = None


# --- the policy ------------------------------------------------------------------------------


def skip_reason(champion: Champion | None, trained_version: str | None, raw_sha256: str, train_key: str) -> str | None:
    """Why there is nothing to train (a version was trained on this very key), or None."""
    if champion is None or trained_version is None:
        return None
    if trained_version == champion.version:
        why = f"data, config and code unchanged since champion v{champion.version} was trained"
    else:
        why = (
            f"data, config and code unchanged since v{trained_version} was trained, which did not "
            f"beat champion v{champion.version}"
        )
    # What --force does: the training of this key is found in storage and reused, not repeated.
    return (
        f"{why} (corpus sha256 {raw_sha256[:12]}, training key {train_key}); --force evaluates, registers and "
        "judges it again, reusing that training (another --storage trains anew)"
    )


# The version tag that lists a corpus's files, each by the first FILE_DIGEST hex digits of its
# sha256 (2**64 digests: no two files of two corpora meet by chance), for a corpus of at most
# FILES_TAGGED files (17 characters a file); a larger one is judged against any champion.
FILES_TAG = "data.files"
FILE_DIGEST = 16
FILES_TAGGED = 5000


def files_tag(files: list[str]) -> str | None:
    """A corpus's file digests as the value of FILES_TAG, or None when there are too many."""
    short = sorted({f[:FILE_DIGEST] for f in files})
    return " ".join(short) if short and len(short) <= FILES_TAGGED else None


def shares_files(champion: Champion, files: list[str] | None) -> bool:
    """Whether the challenger's corpus (its file digests) and the champion's have a file in
    common; True when either is not known, so that a model is judged as it was before."""
    if files is None or champion.files is None:
        return True
    return not {f[:FILE_DIGEST] for f in files}.isdisjoint(champion.files)


# A challenger must beat the champion by more than this fraction of the champion's value: the
# same weights scored on another machine or thread count differ in the last digits, and a model
# must never beat itself.
TIE_TOLERANCE = 1e-4


def decide(
    headline: str,
    value: float,
    higher_is_better: bool,
    champion: Champion | None,
    champion_score: ChampionScore | None = None,
    files: list[str] | None = None,
) -> tuple[bool, str]:
    """(promoted, why): the challenger's headline value against the champion's, measured on this
    run's validation split when `champion_score` is given (the champion's data differed), else
    against the value recorded on the champion's version (the same split, or a headline that does
    not depend on the split). Both come from the family's one scoring (`Family.evaluate` and
    `Family.rescore` share their setting); a tie within TIE_TOLERANCE keeps the champion. A
    challenger whose corpus (`files`: its file digests) shares no file with the champion's is no
    rival of it: it is registered and left beside it."""
    if not math.isfinite(value):
        return False, f"{headline} {value} is not finite"
    if champion is None:
        return True, "no champion yet"
    if not shares_files(champion, files):
        return False, (
            f"not judged against champion v{champion.version}, whose corpus shares no file with this "
            "run's (--model NAME registers a model of its own)"
        )

    def beats(theirs: float) -> tuple[bool, str]:
        if abs(value - theirs) <= TIE_TOLERANCE * max(abs(value), abs(theirs)):
            return False, f"ties (within {TIE_TOLERANCE:.2%})"
        better = value > theirs if higher_is_better else value < theirs
        sign = (">" if better else "<=") if higher_is_better else ("<" if better else ">=")
        return better, sign

    if champion_score is not None and champion_score.headline == headline:
        better, sign = beats(champion_score.value)
        return better, (
            f"{headline} {value:.6g} {sign} {champion_score.value:.6g} for champion "
            f"v{champion.version}, both on this run's validation split"
        )
    if champion.score is None or champion.headline != headline:
        return True, f"champion v{champion.version} has no {headline}"
    better, sign = beats(champion.score)
    return better, f"{headline} {value:.6g} {sign} champion v{champion.version} {champion.score:.6g}"


# --- reading the registry ----------------------------------------------------------------------


def current_champion(client: MlflowClient, name: str) -> Champion | None:
    try:
        mv = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    loss = mv.tags.get("val_loss")
    if loss is None and mv.run_id:
        metrics = client.get_run(mv.run_id).data.metrics
        loss = metrics.get("best_val_loss", metrics.get("val_loss"))
    return Champion(
        name=name,
        version=str(mv.version),
        run_id=mv.run_id,
        checkpoint=mv.tags.get("checkpoint"),
        val_loss=None if loss is None else float(loss),
        train_key=mv.tags.get("train.key"),
        splits_key=mv.tags.get("data.splits_key"),
        raw_sha256=mv.tags.get("data.raw_sha256"),
        headline=mv.tags.get("headline"),
        score=float(mv.tags["headline.value"]) if "headline.value" in mv.tags else None,
        files=mv.tags[FILES_TAG].split() if mv.tags.get(FILES_TAG) else None,
    )


def version_trained_on(client: MlflowClient, name: str, train_key: str) -> str | None:
    """The newest version of the model trained with this training key, if any."""
    try:
        found = client.search_model_versions(f"name = '{name}'")
    except MlflowException:
        return None
    same = [int(v.version) for v in found if v.tags.get("train.key") == train_key]
    return str(max(same)) if same else None


# --- registering -----------------------------------------------------------------------------


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
    with tempfile.TemporaryDirectory(prefix="mllm-model-") as tmp:
        # Any fsspec URL, not just those MLflow can fetch; the registry keeps what sampling
        # needs, not the optimizer state that doubles or triples a checkpoint's size.
        state = read_checkpoint(checkpoint_url)
        best_step = int(state["step"])
        local = os.path.join(tmp, "checkpoint.pt")
        torch.save({k: v for k, v in state.items() if k not in TRAINING_ONLY}, local)
        del state
        script = Path(tmp, "served_model_script.py")
        script.write_text(served_model.script())
        # MLflow files the logged model under the process's current experiment, which is otherwise
        # the Default one, with its artifacts in ./mlruns of whatever folder this runs in.
        mlflow.set_experiment(experiment_id=run.client.get_run(run.run_id).info.experiment_id)
        with warnings.catch_warnings():
            # "no input example": the signature says what goes in, and an example would make
            # MLflow run the model here just to check it.
            warnings.filterwarnings("ignore", message=".*input example", category=UserWarning)
            info = Model.log(
                artifact_path=None,
                name="model",
                flavor=mlflow.pyfunc,
                flavor_name="pyfunc.ModelFromCode",
                python_model=str(script),
                artifacts={"checkpoint": local},
                code_paths=_model_code(tmp),
                signature=_signature(run.cfg),
                pip_requirements=_requirements(),
                run_id=run.run_id,
                step=best_step,
                tags={"checkpoint": scrub(checkpoint_url), "checkpoint.kind": "best"},
            )
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


def checkpoint_models(
    run: RunTracker, best_id: str, best_step: int, evaluation: Any, last_url: str | None, last_step: int | None
) -> None:
    """Each evaluated checkpoint as an MLflow LoggedModel with its step and validation metrics.

    `Model.log` has already made the best one and linked the run's metrics at its step; here it
    gets the whole-split evaluation too. The last checkpoint, when it is another, is a LoggedModel
    of metadata only (its step, its URL, the validation metrics at its step): the registry
    serves the best one, and the last one's file stays in storage where `sample` and a resumed
    training read it. One request per model, and one for the metrics of both."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric, RunTag

    client, now = run.client, int(time.time() * 1000)
    # The final_* metrics are logged at the last step: linked by Model.log already when it is the best's.
    metrics = (
        []
        if last_step in (None, best_step)
        else [
            Metric(f"final_{k}", float(v), now, best_step, model_id=best_id)
            for k, v in {"val_loss": evaluation.loss, **evaluation.metrics}.items()
        ]
    )
    tags = {"model_id": best_id, "model_id.best_step": str(best_step)}
    if last_url and last_step is not None and last_step != best_step:
        exp = client.get_run(run.run_id).info.experiment_id
        last = client.create_logged_model(
            exp,
            name="last",
            source_run_id=run.run_id,
            tags={"checkpoint": scrub(last_url), "checkpoint.kind": "last", "step": str(last_step)},
        )
        client.log_outputs(run.run_id, [LoggedModelOutput(last.model_id, step=last_step)])
        client.finalize_logged_model(last.model_id, LoggedModelStatus.READY)
        history = client.get_run(run.run_id).data.metrics
        for key in (k for k in history if k.startswith("val_")):  # the periodic validation's, any family's
            metrics += [
                Metric(m.key, m.value, m.timestamp, m.step, model_id=last.model_id)
                for m in client.get_metric_history(run.run_id, key)
                if m.step == last_step
            ]
        tags.update({"model_id.last": last.model_id, "model_id.last_step": str(last_step)})
    client.log_batch(run.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])


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


def _signature(cfg: RunConfig) -> ModelSignature:
    # Texts in (unnamed: a plain list works too), texts out; the parameters are the family's,
    # with the run's own sample section as their defaults.
    params = [ParamSpec(name, kind, default) for name, kind, default in family_of(cfg).served_params(cfg.sample)]
    params.append(ParamSpec(served_model.DROP, "boolean", False))  # a prompt that loses characters: refused
    return ModelSignature(
        inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]), params=ParamSchema(params)
    )


def _model_code(tmp: str) -> list[str]:
    """mllm and tasks/tracking/served_model.py travel with the model, and nothing else of this project:
    it loads where neither is installed, and where Prefect is not."""
    code = Path(tmp, "code")
    shutil.copytree(Path(mllm.__file__).parent, code / "mllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (code / "tasks" / "tracking").mkdir(parents=True)
    (code / "tasks" / "__init__.py").write_text("")
    (code / "tasks" / "tracking" / "__init__.py").write_text("")
    shutil.copy(served_model.__file__, code / "tasks" / "tracking" / "served_model.py")
    return [str(code / "mllm"), str(code / "tasks")]


def _requirements() -> list[str]:
    # Pinned from this environment, since MLflow's inference would load the model in a
    # subprocess; without local labels (+cpu, +cu121): the server picks its own torch build.
    return [
        f"{dist}=={version(dist).split('+')[0]}"
        for dist in ("mlflow", "torch", "numpy", "pyarrow", "fsspec", "pydantic", "pyyaml", "tokenizers")
        if version(dist) != "not installed"
    ]


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
