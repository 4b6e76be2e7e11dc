"""Exports recorded in MLflow: which checkpoint a model reference (MODEL@ALIAS, MODEL/VERSION or
a run id) stands for, and an export of it kept as artifacts of the run that trained it
(exports/<format>/) with tags on the run and the registered version naming the folder, the format
and the library versions that wrote it, so `lineage` can follow an export back to its corpus."""

from __future__ import annotations

import re
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mllm import UserError, storage
from mllm.redact import scrub
from tasks.tracking import store as tracking

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _get(fetch, *args) -> Any:
    try:
        return fetch(*args)
    except MlflowException:
        return None


def model_version(client: MlflowClient, ref: str) -> Any:
    """The registered version `ref` names, or None when `ref` is a run id."""
    if "@" in ref:
        name, _, alias = ref.rpartition("@")
        found = _get(client.get_model_version_by_alias, name, alias)
        if found is None:
            raise UserError(f"no model {name!r} with alias {alias!r}: see the MLflow registry, or give MODEL/VERSION")
        return found
    if "/" in ref:
        name, _, number = ref.rpartition("/")
        found = _get(client.get_model_version, name, number) if number.isdigit() else None
        if found is None:
            raise UserError(f"no model version {ref!r}: give MODEL@ALIAS, MODEL/VERSION or an MLflow run id")
        return found
    if not _RUN_ID.match(ref):
        raise UserError(f"{ref!r} is neither MODEL@ALIAS, MODEL/VERSION nor an MLflow run id (32 hex characters)")
    return None


def source(root: str, ref: str) -> dict[str, Any]:
    """{"checkpoint", "run_id", "version" (or None), "card"}: what `ref` stands for, and the
    lineage its export's model card and manifest carry."""
    client = tracking.client(root)
    version = model_version(client, ref)
    run_id = version.run_id if version is not None else ref
    run = _get(client.get_run, run_id)
    if run is None:
        raise UserError(f"no MLflow run {run_id} in {tracking.tracking_uri(root)}: see `mllm-pipeline runs`")
    tags = run.data.tags
    if version is None and tags.get("model_version"):
        name, _, number = tags["model_version"].rpartition("/")
        version = _get(client.get_model_version, name, number)
    checkpoint = version.tags.get("checkpoint") if version is not None else None
    if checkpoint is None and tags.get("train.run_dir"):
        checkpoint = storage.join(tags["train.run_dir"], "checkpoints", "best.pt")
    if checkpoint is None or not storage.exists(checkpoint):
        raise UserError(
            f"{ref} has no checkpoint in storage ({checkpoint or 'none recorded'}): export a finished run's model"
        )
    card = {
        "model": f"{version.name}/{version.version}" if version is not None else None,
        "mlflow_run": run_id,
        "tracking_uri": scrub(tracking.tracking_uri(root)),
        "corpus_sha256": tags.get("data.raw_sha256"),
        "corpus_source": tags.get("data.source"),
        "checkpoint": scrub(checkpoint),
    }
    return {"checkpoint": checkpoint, "run_id": run_id, "version": version, "card": card}


def record(root: str, src: dict[str, Any], manifest: dict[str, Any], out: str) -> str | None:
    """Keep the export written to `out` with the model: its files as artifacts of the run (a
    local folder; one in object storage stays where it is, named by the tags), tags on the run
    and the version. Returns the artifacts' URI, or None when only tagged."""
    client, fmt = tracking.client(root), manifest["format"]
    fs, path = storage.filesystem(out)
    artifact = None
    if isinstance(fs, LocalFileSystem):
        client.log_artifacts(src["run_id"], path, artifact_path=f"exports/{fmt}")
        artifact = f"{client.get_run(src['run_id']).info.artifact_uri}/exports/{fmt}"
    tags = {
        f"export.{fmt}.uri": scrub(out),
        f"export.{fmt}.artifact": artifact,
        f"export.{fmt}.libraries": ", ".join(f"{k}=={v}" for k, v in sorted(manifest["libraries"].items())),
    }
    version = src["version"]
    for key, value in tags.items():
        if value is None:
            continue
        client.set_tag(src["run_id"], key, value)
        if version is not None:
            client.set_model_version_tag(version.name, version.version, key, value)
    return artifact
