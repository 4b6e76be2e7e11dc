"""MLflow tracking: one run per training, in an experiment per recipe (docs/tracking.md)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from typing import Any

from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.entities.lifecycle_stage import LifecycleStage
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.exceptions import TerminationSignal

from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.redact import ScrubFilter, scrub
from tasks.caching import forget_exception
from tasks.tracking import outage
from tasks.tracking import servers as tracking_servers
from tasks.tracking.datasets import MAX_DIGEST, TokenDataset, dataset_source
from tasks.tracking.provenance import code_git_info, run_tags
from tasks.tracking.store import artifact_root, client

log = logging.getLogger(__name__)
log.addFilter(ScrubFilter())

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
# MLflow 3's UI opens an experiment without this tag in its GenAI view (traces, token usage);
# with it, in the view of runs, metrics and models that a training pipeline's runs need.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """Nested dict -> {"a.b.c": "value"}; non-strings as JSON (true, null, 0.001, ["a"])."""
    flat: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


# --- the run -------------------------------------------------------------------------------


def deleted_run(client: MlflowClient, run_id: str) -> bool:
    """Whether the run is in MLflow's trash, or gone from it (`mlflow gc`)."""
    try:
        return client.get_run(run_id).info.lifecycle_stage == LifecycleStage.DELETED
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return True
        raise


def log_records(client: MlflowClient, run_id: str, records: list[dict]) -> None:
    """Metric records ({"step": int, name: float, ...}) into a run, one log_batch request per
    1000 metrics."""
    now = int(time.time() * 1000)
    metrics = []
    for record in records:
        if "step" not in record:
            raise ValueError(f"metric record without a step: {record}")
        step = int(record["step"])
        values = {k: float(v) for k, v in record.items() if k != "step" and v is not None and not isinstance(v, bool)}
        metrics += [Metric(k, v, now, step) for k, v in values.items()]
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])


class RunTracker:
    """One MLflow run for one training: `with RunTracker(cfg, root) as run: ...`.

    Everything goes through an `MlflowClient` bound to an explicit run id rather than MLflow's
    thread-local "active run": Prefect may call the tracker from worker threads."""

    def __init__(self, cfg: RunConfig, storage_root: str, tags: dict | None = None, run_name: str | None = None):
        self.cfg = cfg
        self.storage_root = storage_root
        self.extra_tags = dict(tags or {})
        self.run_name = run_name
        self.client = client(storage_root)
        self.uri = self.client.tracking_uri
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    @classmethod
    def attach(cls, run_id: str, cfg: RunConfig, storage_root: str) -> "RunTracker":
        """The tracker of a run started elsewhere (the pipeline), e.g. in a training worker."""
        tracker = cls(cfg, storage_root)
        tracker.run_id = run_id
        return tracker

    # context manager

    def __enter__(self) -> "RunTracker":
        self.experiment_id = self._experiment(self.cfg.recipe)
        git = code_git_info()
        tags = scrub({**run_tags(self.cfg, self.storage_root, git), **{k: str(v) for k, v in self.extra_tags.items()}})
        tags = {k: v[:MAX_TAG_VALUE] for k, v in tags.items()}
        outage.settle_unfinished(
            self.client,
            self.storage_root,
            functools.partial(log_records, self.client),
            functools.partial(deleted_run, self.client),
        )
        run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        log.info("mlflow run %s (%s) in experiment %s at %s", run.info.run_name, self.run_id, self.cfg.recipe, self.uri)
        try:
            params = scrub(flatten(self.cfg.to_dict()))
            entries = [
                Param(k, v if len(v) <= MAX_PARAM_VALUE else v[: MAX_PARAM_VALUE - 3] + "...")
                for k, v in params.items()
            ]
            for i in range(0, len(entries), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=entries[i : i + MAX_PARAMS_PER_BATCH])
            self.log_text(self.cfg.to_yaml(paths=False), "config.yaml")
            if git["dirty"] and git["diff"]:
                self.log_text(git["diff"], "git.diff")
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)  # not left RUNNING forever
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.run_id is None:
            return
        error = None
        if exc_type is None:
            status = RunStatus.to_string(RunStatus.FINISHED)
        else:
            killed = issubclass(exc_type, (KeyboardInterrupt, TerminationSignal))  # Ctrl-C, SIGTERM
            status = RunStatus.to_string(RunStatus.KILLED if killed else RunStatus.FAILED)
            message = str(exc).splitlines()[0] if str(exc) else ""
            error = scrub(f"{exc_type.__name__}: {message}")[:MAX_TAG_VALUE]
        if not tracking_servers.answers():
            # Not minutes of MLflow's retries: closed by the next run that reaches the server.
            outage.note_unfinished(self.storage_root, self.run_id, status, error or "")
            return
        if error:
            # A failing run is closed without MLflow's minutes of retries (a server whose database
            # is down answers 500 to each): if it cannot be closed now, the next run closes it.
            try:
                with outage.fail_fast():
                    with contextlib.suppress(Exception):  # the training error matters more than ours
                        self.client.set_tag(self.run_id, "error", error)
                    self.client.set_terminated(self.run_id, status)
            except Exception:  # noqa: BLE001 (the run's own error is the one to raise)
                outage.note_unfinished(self.storage_root, self.run_id, status, error)
                return
        else:
            with contextlib.suppress(Exception):  # still kept: the next run sends them
                outage.send_unsent(
                    self.storage_root,
                    functools.partial(log_records, self.client),
                    functools.partial(deleted_run, self.client),
                )
            self.client.set_terminated(self.run_id, status)
        log.info("mlflow run %s ended %s", self.run_id, status)

    def _experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(
                    name, artifact_location=artifact_root(self.uri), tags={EXPERIMENT_KIND: MODEL_TRAINING}
                )
            except MlflowException:
                exp = self.client.get_experiment_by_name(name)  # another run created it first
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise UserError(
                f"MLflow experiment {name!r} is deleted: restore it in the MLflow UI or purge it "
                f"with `mlflow gc --experiment-ids {exp.experiment_id}`"
            )
        if EXPERIMENT_KIND not in exp.tags:  # made before the kind was set: open it as training too
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return exp.experiment_id

    # metrics

    def log_metrics(self, records: list[dict]) -> None:
        """Records as mllm.train's on_metrics sends them: {"step": int, name: float, ...}.
        One log_batch request per call (per 1000 metrics)."""
        log_records(self.client, self.run_id, records)

    def metrics_after_resume(self) -> outage.HeldMetrics:
        """`log_metrics` for a training that may resume: records at steps this run already holds
        (logged between its last checkpoint and a crash, and trained again identically since
        resume is exact) are left out, so the history holds each step once. What a tracking
        server that is away cannot take is held for when it answers again."""
        history = [
            m.step for name in ("train_loss", "val_loss") for m in self.client.get_metric_history(self.run_id, name)
        ]
        logged = max(history, default=-1)

        def log(records: list[dict]) -> None:
            fresh = [r for r in records if int(r["step"]) > logged]
            if fresh:
                self.log_metrics(fresh)

        every = self.cfg.train.checkpoint_interval
        return outage.HeldMetrics(
            log,
            every_s=outage.retry_every_s(),
            pace_s=outage.metrics_every_s(),
            urgent=lambda step: step % every == 0,
            keep=lambda records: outage.keep_unsent(self.storage_root, self.run_id, records),
        )

    def log_loss_curve(self) -> str | None:
        """loss_curve.png: train and val loss against step (None while there is no loss)."""
        from matplotlib.figure import Figure  # no pyplot: no global backend, no GUI

        # From the server: training may have logged from another process (a worker).
        curves = {
            name: sorted((m.step, m.value) for m in self.client.get_metric_history(self.run_id, name))
            for name in ("train_loss", "val_loss")
        }
        if not any(curves.values()):
            return None
        fig = Figure(figsize=(7, 4.5), dpi=100)
        ax = fig.subplots()
        for name, points in curves.items():
            if points:
                steps, losses = zip(*points)
                ax.plot(steps, losses, label=name.replace("_", " "), marker="o" if name == "val_loss" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(self.cfg.recipe)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        self.client.log_figure(self.run_id, fig, "loss_curve.png")
        return "loss_curve.png"

    # artifacts and inputs

    def log_file(self, url: str, artifact_file: str) -> None:
        """A file from storage (any fsspec URL) as an artifact."""
        with tempfile.TemporaryDirectory(prefix="mllm-artifact-") as tmp:
            local = os.path.join(tmp, os.path.basename(artifact_file))
            with open(local, "wb") as f:
                f.write(storage.read_bytes(url))
            self.client.log_artifact(self.run_id, local, os.path.dirname(artifact_file) or None)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, scrub(text), artifact_file)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, scrub(d), artifact_file)

    def log_params(self, params: dict[str, Any]) -> None:
        """Params found out while the run ran (the precision training chose), beside the config's."""
        entries = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in scrub({k: str(v) for k, v in params.items()}).items()]
        for i in range(0, len(entries), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=entries[i : i + MAX_PARAMS_PER_BATCH])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in scrub({k: str(v) for k, v in tags.items()}).items():
            self.client.set_tag(self.run_id, k, v[:MAX_TAG_VALUE])

    def log_dataset(self, name: str, source: str, digest: str, context: str, n_tokens: int | None = None) -> None:
        """A data stage's output as an MLflow dataset: its URI and our digest (a digest longer
        than MLflow's 36 characters is shortened there and kept whole in the input tags)."""
        uri = scrub(source)
        dataset = TokenDataset(dataset_source(uri), name=name, digest=digest[:MAX_DIGEST], n_tokens=n_tokens)
        tags = {"mlflow.data.context": context, "digest": digest}
        if n_tokens is not None:
            tags["n_tokens"] = str(n_tokens)
        inputs = DatasetInput(
            dataset=dataset._to_mlflow_entity(), tags=[InputTag(key=k, value=v) for k, v in tags.items()]
        )
        try:
            self.client.log_inputs(self.run_id, datasets=[inputs])
        except MlflowException as e:
            if not lost_dataset_race(e):
                raise
            # Another run logged the same dataset in the same instant: MLflow's server looks the
            # dataset up, then inserts it, and the other insert came between (a sweep's points log
            # one corpus at once). Its transaction was rolled back; the dataset exists now, so the
            # same call links this run to it.
            self.client.log_inputs(self.run_id, datasets=[inputs])

    # the model


def lost_dataset_race(e: MlflowException) -> bool:
    """Whether MLflow refused a dataset input because another request inserted the same dataset
    (name and digest) between its lookup and its insert: PostgreSQL's duplicate key on the
    datasets table (SQLite serialises its writers, so it never sees this)."""
    text = str(e)
    return "dataset" in text and ("duplicate key value" in text or "UniqueViolation" in text)


# --- the pipeline's tracking tasks ---------------------------------------------------------


@task(name="log-data", on_failure=[forget_exception], retries=2, retry_delay_seconds=2)
def log_data(run_id: str, cfg: RunConfig, root: str, data: Any) -> None:
    """The data stages as MLflow datasets (source URI and our digest), and the vocabulary."""
    run = RunTracker.attach(run_id, cfg, root)
    run.log_dataset("corpus", data.source, data.raw_sha256, "raw", None)
    run.log_dataset("tokens", data.tokens.url, data.tokens.key, "tokens", data.tokens.n_tokens)
    for split in ("train", "val", "test"):
        part = getattr(data.splits, split)
        if part is not None:
            context = {"train": "training", "val": "validation", "test": "testing"}[split]
            run.log_dataset(split, part.ids, f"{data.splits.key}-{split}", context, part.n_tokens)
    run.log_text(storage.read_text(data.vocab.url), "vocab.json")  # parallel text: the target side's
    if getattr(data, "source_side", None) is not None:
        run.log_text(storage.read_text(data.source_side.vocab.url), "src_vocab.json")
    run.set_tags(
        {"data.raw_sha256": data.raw_sha256, "data.vocab_digest": data.vocab.digest, "data.splits": data.splits.url}
    )
