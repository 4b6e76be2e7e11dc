"""A checkpoint as an MLflow model: the pyfunc that serves it (tasks/tracking/served_model.py and
`mllm` its code) with its signature and pinned requirements, and the LoggedModels of a training's
best and last checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import torch
from mlflow.models import Model, ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

import mllm
from mllm.config import RunConfig
from mllm.families.base import family_of
from mllm.redact import scrub
from mllm.runtime.checkpoint import read_checkpoint
from tasks.tracking import served_model
from tasks.tracking.provenance import version
from tasks.tracking.tracker import RunTracker

TRAINING_ONLY = ("optimizer", "scheduler", "rng", "data_state")  # checkpoint keys the model needs not


def log_pyfunc(run: RunTracker, checkpoint_url: str) -> tuple[Any, int]:
    """Log the checkpoint at `checkpoint_url` as the run's pyfunc model; (its ModelInfo, its step)."""
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
    return info, best_step


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
