"""MLflow tracking: one run per training, in an experiment per recipe.

A `RunTracker` records the resolved config (params and `config.yaml`), the git state, the
Prefect flow run, package versions and device as tags, the data stages as datasets with our
digests, metrics in batches, a loss curve, and the model in the registry with a `champion`
alias that moves only when a new version beats it.

Everything goes through an `MlflowClient` bound to an explicit run id rather than MLflow's
thread-local "active run": Prefect may call the tracker from worker threads. Nothing that
looks like a secret reaches a param, tag, artifact or log line: it all passes `scrub` first.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
import mlflow
import mlflow.pyfunc
import pandas as pd
import torch
from fsspec.implementations.local import LocalFileSystem
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import register_dataset_source, resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from mlflow.tracking import MlflowClient
from prefect import task

import mllm
from mllm import UserError, storage
from mllm.checkpoint import read_checkpoint
from mllm.config import RunConfig

log = logging.getLogger(__name__)

CHAMPION = "champion"
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_DIGEST = 36  # the datasets table's digest column
TRAINING_ONLY = ("optimizer", "scheduler", "rng", "data_state")  # checkpoint keys


# --- secrets -------------------------------------------------------------------------------

_SECRET_ENV = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "credentials")
# Values too short or too common to be a secret: replacing them would garble every text.
_NOT_SECRETS = {"true", "false", "none", "null", "yes", "no", "on", "off"}
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^\s/@'\"]+@")
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_.\-]*)(\s*[:=]\s*)([\"']?)([^\s\"',}]+)")
REDACTED = "***"


def _secret_name(name: str) -> bool:
    """Names like aws_secret_access_key, sessionToken, api-key (not tokenizer, max_new_tokens)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower()
    return any(w.endswith(_SECRET_WORDS) for w in re.split(r"[^a-z0-9]+", spaced) if w)


def _secret_values() -> list[str]:
    values = {v for k, v in os.environ.items()
              if any(s in k.upper() for s in _SECRET_ENV)
              and len(v) >= 4 and v.lower() not in _NOT_SECRETS}
    return sorted(values, key=len, reverse=True)  # longest first: one secret may contain another


def _scrub_text(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, REDACTED)
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)

    def assignment(m: re.Match) -> str:
        # A bare `key=` is a sort key or a dict key far more often than a credential.
        if m.group(1).lower() == "key" or not _secret_name(m.group(1)) or m.group(4) == REDACTED:
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{m.group(3)}{REDACTED}"

    return _ASSIGNMENT.sub(assignment, text)


def scrub(obj: Any, _secrets: list[str] | None = None) -> Any:
    """`obj` with every secret replaced by "***": values of secret-named environment variables,
    userinfo in URLs, and the values of dict entries named like secrets (storage options)."""
    secrets = _secret_values() if _secrets is None else _secrets
    if isinstance(obj, str):
        return _scrub_text(obj, secrets)
    if isinstance(obj, dict):
        return {k: REDACTED if _secret_name(k) and obj[k] not in (None, "")
                else scrub(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, secrets) for v in obj]
    return obj


class _ScrubFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = scrub(record.getMessage()), None
        return True


log.addFilter(_ScrubFilter())


# --- where runs go -------------------------------------------------------------------------

def _local_path(url: str) -> str | None:
    if fsspec.utils.get_protocol(url) not in ("file", "local"):
        return None
    return os.path.abspath(LocalFileSystem._strip_protocol(url))


_derived_uri: str | None = None


def tracking_uri(storage_root: str) -> str:
    """MLFLOW_TRACKING_URI when set, else an SQLite store beside a local storage root (or
    ./mlflow.db for an object-store root). Credentials in the URI move to MLflow's own
    username/password variables so that MLflow never prints them."""
    global _derived_uri
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri and uri != _derived_uri:  # set_tracking_uri exports what we chose: not the user's
        parts = urlsplit(uri)
        if parts.username or parts.password:
            os.environ.setdefault("MLFLOW_TRACKING_USERNAME", parts.username or "")
            os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", parts.password or "")
            uri = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    else:
        root = _local_path(storage_root)
        folder = os.path.dirname(root.rstrip(os.sep)) if root else os.getcwd()
        os.makedirs(folder, exist_ok=True)
        uri = _derived_uri = f"sqlite:///{os.path.join(folder, 'mlflow.db')}"
    mlflow.set_tracking_uri(uri)
    return uri


def _artifact_root(uri: str) -> str | None:
    """A local SQLite store keeps its artifacts beside the database, not in ./mlruns of
    whichever folder the process happens to start in. Servers choose their own."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(os.path.dirname(uri[len("sqlite:///"):]), "mlruns").resolve().as_uri()


# --- what a run is -------------------------------------------------------------------------

def _git(path: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_info(path: str = ".") -> dict[str, Any]:
    """commit, branch, dirty and the diff against HEAD (with untracked files listed) when
    dirty; None values outside a git checkout. Remote URL too, for finding the commit."""
    info: dict[str, Any] = {"commit": None, "branch": None, "dirty": None, "diff": None,
                            "remote": None}
    commit = _git(path, "rev-parse", "--verify", "HEAD")
    if commit is None:
        return info
    info["commit"] = commit.strip()
    branch = (_git(path, "rev-parse", "--abbrev-ref", "HEAD") or "").strip()
    info["branch"] = branch if branch and branch != "HEAD" else None  # HEAD: detached
    remote = (_git(path, "config", "--get", "remote.origin.url") or "").strip()
    info["remote"] = remote or None
    status = _git(path, "status", "--porcelain") or ""
    info["dirty"] = bool(status.strip())
    if info["dirty"]:
        diff = _git(path, "diff", "HEAD") or ""
        untracked = [line[3:] for line in status.splitlines() if line.startswith("??")]
        if untracked:
            diff += "".join(f"# untracked: {name}\n" for name in untracked)
        info["diff"] = diff
    return info


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


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device(requested: str) -> str:
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _prefect_flow_run() -> tuple[str | None, str | None]:
    # Importing prefect costs a second and creates its home folder: only ask when a flow run
    # can exist, i.e. prefect is already loaded or a worker started this process for one.
    if "prefect" not in sys.modules and not os.environ.get("PREFECT__FLOW_RUN_ID"):
        return None, None
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    run_id = flow_run.id
    if run_id is None:
        return None, None
    return run_id, (flow_run.ui_url if PREFECT_UI_URL.value() else None)


def run_tags(cfg: RunConfig, storage_root: str, git: dict[str, Any]) -> dict[str, str]:
    tags = {
        "storage.root": storage_root,
        "device": _device(cfg.train.device),
        "version.python": sys.version.split()[0],
        "version.torch": _version("torch"),
        "version.prefect": _version("prefect"),
        "version.mlflow": _version("mlflow"),
        "version.mllm": mllm.__version__,
    }
    if cfg.paths is not None:
        tags.update({f"storage.{k}": v for k, v in cfg.paths.model_dump().items() if v})
    if git["commit"]:
        tags.update({
            "git.commit": git["commit"],
            "git.dirty": str(git["dirty"]).lower(),
            "mlflow.source.git.commit": git["commit"],
        })
        if git["branch"]:
            tags["git.branch"] = tags["mlflow.source.git.branch"] = git["branch"]
        if git["remote"]:
            tags["mlflow.source.git.repoURL"] = git["remote"]
    flow_run_id, flow_run_url = _prefect_flow_run()
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
        if flow_run_url:
            tags["prefect.flow_run_url"] = flow_run_url
    return tags


# --- datasets ------------------------------------------------------------------------------

class StorageDatasetSource(DatasetSource):
    """Any fsspec URL that MLflow has no source type for (memory://, gcs://, ...)."""

    def __init__(self, uri: str):
        self.uri = uri

    @staticmethod
    def _get_source_type() -> str:
        return "fsspec"

    def load(self, dst_path=None) -> str:
        dst = os.path.join(dst_path or tempfile.mkdtemp(), os.path.basename(self.uri.rstrip("/")))
        storage.filesystem(self.uri)[0].get(storage.filesystem(self.uri)[1], dst, recursive=True)
        return dst

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False  # never chosen over MLflow's own types; registered only to be read back

    @classmethod
    def _resolve(cls, raw_source: Any) -> "StorageDatasetSource":
        return cls(raw_source)

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri}

    @classmethod
    def from_dict(cls, source_dict: dict[Any, Any]) -> "StorageDatasetSource":
        return cls(source_dict["uri"])


register_dataset_source(StorageDatasetSource)


class TokenDataset(MetaDataset):
    """Metadata only: where a data stage's output lives, its digest and its size in tokens."""

    def __init__(self, source: DatasetSource, name: str, digest: str, n_tokens: int | None):
        self.n_tokens = n_tokens
        super().__init__(source=source, name=name, digest=digest)

    @property
    def profile(self) -> dict[str, int] | None:
        return {"num_tokens": self.n_tokens} if self.n_tokens is not None else None

    def to_dict(self) -> dict[str, str]:
        d = super().to_dict()
        if self.profile:
            d["profile"] = json.dumps(self.profile)
        return d


def _dataset_source(uri: str) -> DatasetSource:
    """MLflow's own source type where it has one (local, s3, http...), else ours."""
    with warnings.catch_warnings():
        # "can be interpreted in multiple ways": MLflow registers local paths twice itself.
        warnings.simplefilter("ignore", UserWarning)
        try:
            return resolve_dataset_source(uri)
        except MlflowException:
            return StorageDatasetSource(uri)


# --- the run -------------------------------------------------------------------------------

class RunTracker:
    """One MLflow run for one training: `with RunTracker(cfg, root) as run: ...`."""

    def __init__(self, cfg: RunConfig, storage_root: str, tags: dict | None = None,
                 run_name: str | None = None):
        self.cfg = cfg
        self.storage_root = storage_root
        self.extra_tags = dict(tags or {})
        self.run_name = run_name
        self.uri = tracking_uri(storage_root)
        self.client = MlflowClient(self.uri)
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
        git = git_info(".")
        if git["commit"] is None:  # a worker starts a flow run in a temporary folder: the code's checkout
            git = git_info(str(Path(__file__).resolve().parents[1]))
        tags = scrub({**run_tags(self.cfg, self.storage_root, git), **{
            k: str(v) for k, v in self.extra_tags.items()}})
        tags = {k: v[:MAX_TAG_VALUE] for k, v in tags.items()}
        run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        log.info("mlflow run %s (%s) in experiment %s at %s", run.info.run_name, self.run_id,
                 self.cfg.recipe, self.uri)
        try:
            params = scrub(flatten(self.cfg.to_dict()))
            entries = [Param(k, v if len(v) <= MAX_PARAM_VALUE else v[:MAX_PARAM_VALUE - 3] + "...")
                       for k, v in params.items()]
            for i in range(0, len(entries), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=entries[i:i + MAX_PARAMS_PER_BATCH])
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
        if exc_type is None:
            status = RunStatus.to_string(RunStatus.FINISHED)
        else:
            killed = issubclass(exc_type, KeyboardInterrupt)
            status = RunStatus.to_string(RunStatus.KILLED if killed else RunStatus.FAILED)
            with contextlib.suppress(Exception):  # the training error matters more than ours
                message = str(exc).splitlines()[0] if str(exc) else ""
                self.client.set_tag(self.run_id, "error",
                                    scrub(f"{exc_type.__name__}: {message}")[:MAX_TAG_VALUE])
        self.client.set_terminated(self.run_id, status)
        log.info("mlflow run %s ended %s", self.run_id, status)

    def _experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, artifact_location=_artifact_root(self.uri))
            except MlflowException:
                exp = self.client.get_experiment_by_name(name)  # another run created it first
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise UserError(
                f"MLflow experiment {name!r} is deleted: restore it in the MLflow UI or purge it "
                f"with `mlflow gc --experiment-ids {exp.experiment_id}`")
        return exp.experiment_id

    # metrics

    def log_metrics(self, records: list[dict]) -> None:
        """Records as mllm.train's on_metrics sends them: {"step": int, name: float, ...}.
        One log_batch request per call (per 1000 metrics)."""
        now = int(time.time() * 1000)
        metrics = []
        for record in records:
            if "step" not in record:
                raise ValueError(f"metric record without a step: {record}")
            step = int(record["step"])
            values = {k: float(v) for k, v in record.items()
                      if k != "step" and v is not None and not isinstance(v, bool)}
            metrics += [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def log_loss_curve(self) -> str | None:
        """loss_curve.png: train and val loss against step (None while there is no loss)."""
        from matplotlib.figure import Figure  # no pyplot: no global backend, no GUI

        # From the server: training may have logged from another process (a worker).
        curves = {name: sorted((m.step, m.value) for m in self.client.get_metric_history(self.run_id, name))
                  for name in ("train_loss", "val_loss")}
        if not any(curves.values()):
            return None
        fig = Figure(figsize=(7, 4.5), dpi=100)
        ax = fig.subplots()
        for name, points in curves.items():
            if points:
                steps, losses = zip(*points)
                ax.plot(steps, losses, label=name.replace("_", " "),
                        marker="o" if name == "val_loss" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(self.cfg.recipe)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        self.client.log_figure(self.run_id, fig, "loss_curve.png")
        return "loss_curve.png"

    # artifacts and inputs

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, scrub(text), artifact_file)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, scrub(d), artifact_file)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in scrub({k: str(v) for k, v in tags.items()}).items():
            self.client.set_tag(self.run_id, k, v[:MAX_TAG_VALUE])

    def log_dataset(self, name: str, source: str, digest: str, context: str,
                    n_tokens: int | None = None) -> None:
        """A data stage's output as an MLflow dataset: its URI and our digest (a digest longer
        than MLflow's 36 characters is shortened there and kept whole in the input tags)."""
        uri = scrub(source)
        dataset = TokenDataset(_dataset_source(uri), name=name, digest=digest[:MAX_DIGEST],
                               n_tokens=n_tokens)
        tags = {"mlflow.data.context": context, "digest": digest}
        if n_tokens is not None:
            tags["n_tokens"] = str(n_tokens)
        inputs = DatasetInput(dataset=dataset._to_mlflow_entity(),
                              tags=[InputTag(key=k, value=v) for k, v in tags.items()])
        self.client.log_inputs(self.run_id, datasets=[inputs])

    # the model

    def log_model(self, checkpoint_url: str, val_loss: float, model_name: str | None = None,
                  version_tags: dict[str, str] | None = None, champion_score: Any = None,
                  bits_per_byte: float | None = None) -> dict[str, Any]:
        """Log the checkpoint as a pyfunc TextGenerator, register a version under `model_name`
        (default: the recipe) and move `champion` to it only if it is better.

        Better: a lower val_loss than the champion's, when both were measured on the same
        split; `champion_score` is the champion scored on this run's split when its own was
        another (then bits per byte decide, comparable across vocabularies)."""
        name = model_name or self.cfg.recipe
        with tempfile.TemporaryDirectory(prefix="mllm-model-") as tmp:
            # Any fsspec URL, not just those MLflow can fetch; the registry keeps what sampling
            # needs, not the optimizer state that doubles or triples a checkpoint's size.
            state = read_checkpoint(checkpoint_url)
            local = os.path.join(tmp, "checkpoint.pt")
            torch.save({k: v for k, v in state.items() if k not in TRAINING_ONLY}, local)
            del state
            with warnings.catch_warnings():
                # "no input example": the signature says what goes in, and an example would
                # make MLflow generate text with the model here just to check it.
                warnings.filterwarnings("ignore", message=".*input example", category=UserWarning)
                info = Model.log(
                    artifact_path=None,
                    name="model",
                    flavor=mlflow.pyfunc,
                    flavor_name="pyfunc.ModelFromCode",
                    python_model=_model_script(tmp),
                    artifacts={"checkpoint": local},
                    code_paths=_model_code(tmp),
                    signature=_signature(self.cfg),
                    pip_requirements=_requirements(),
                    run_id=self.run_id,
                )
        version = mlflow.register_model(info.model_uri, name, tags={
            "val_loss": repr(float(val_loss)), "run_id": self.run_id,
            "checkpoint": scrub(checkpoint_url), **(version_tags or {})})
        return self._champion(name, version.version, float(val_loss), info.model_uri, champion_score, bits_per_byte)

    def _champion(self, name: str, version: str, val_loss: float, model_uri: str,
                  champion_score: Any = None, bpb: float | None = None) -> dict:
        previous = current_champion(self.client, name)
        if not math.isfinite(val_loss):
            promoted, reason = False, f"val_loss {val_loss} is not finite"
        elif previous is None:
            promoted, reason = True, "no champion yet"
        elif champion_score is not None and bpb is not None:
            promoted = bpb < champion_score.bits_per_byte
            reason = (f"{bpb:.6g} {'<' if promoted else '>='} {champion_score.bits_per_byte:.6g} bits/byte for "
                      f"champion v{previous['version']}, both on this run's validation split")
        elif previous["val_loss"] is None:
            promoted, reason = True, f"champion v{previous['version']} has no val_loss"
        elif val_loss < previous["val_loss"]:
            promoted, reason = True, (f"val_loss {val_loss:.6g} < champion v{previous['version']}"
                                      f" {previous['val_loss']:.6g}")
        else:
            promoted, reason = False, (f"val_loss {val_loss:.6g} >= champion "
                                       f"v{previous['version']} {previous['val_loss']:.6g}")
        if promoted:
            self.client.set_registered_model_alias(name, CHAMPION, version)
        decision = "promoted" if promoted else "kept"
        self.set_decision(decision, reason)
        self.client.set_model_version_tag(name, version, "champion.decision",
                                          f"{decision}: {reason}")
        result = {"name": name, "version": str(version), "promoted": promoted, "decision": decision,
                  "previous": previous, "val_loss": val_loss, "reason": reason,
                  "model_uri": model_uri}
        if champion_score is not None:
            result["champion_score"] = champion_score.model_dump(mode="json")
        self.log_dict(result, "champion.json")
        log.info("model %s v%s %s: %s", name, version, decision, reason)
        return result

    def set_decision(self, decision: str, reason: str) -> None:
        """What this run did about the champion: promoted, kept, or skipped (not trained)."""
        self.set_tags({"decision": decision, "decision.reason": reason,
                       "champion.decision": f"{decision}: {reason}"})


def current_champion(client: MlflowClient, name: str) -> dict | None:
    """The model version that holds the `champion` alias, with what it was trained and
    measured on (its tags), or None."""
    try:
        mv = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    loss = mv.tags.get("val_loss")
    if loss is None and mv.run_id:
        metrics = client.get_run(mv.run_id).data.metrics
        loss = metrics.get("best_val_loss", metrics.get("val_loss"))
    return {"version": str(mv.version), "val_loss": None if loss is None else float(loss),
            "run_id": mv.run_id, "checkpoint": mv.tags.get("checkpoint"),
            "train_key": mv.tags.get("train.key"), "splits_key": mv.tags.get("data.splits_key"),
            "raw_sha256": mv.tags.get("data.raw_sha256")}


def version_trained_on(cfg: RunConfig, root: str, train_key: str) -> str | None:
    """The newest version of the recipe's model trained with this training key, if any."""
    client = MlflowClient(tracking_uri(root))
    try:
        versions = client.search_model_versions(f"name = '{cfg.recipe}'")
    except MlflowException:
        return None
    same = [int(v.version) for v in versions if v.tags.get("train.key") == train_key]
    return str(max(same)) if same else None


def champion_of(cfg: RunConfig, root: str) -> dict | None:
    """The recipe's current champion (see `current_champion`)."""
    return current_champion(MlflowClient(tracking_uri(root)), cfg.recipe)


# --- the registered model ------------------------------------------------------------------

class TextGenerator(mlflow.pyfunc.PythonModel):
    """A checkpoint as an MLflow model: prompts in, prompt + continuation out.

    `mlflow.pyfunc.load_model("models:/NAME@champion").predict(["The "], params={...})`.
    """

    def load_context(self, context) -> None:
        from mllm.checkpoint import load_checkpoint

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.loaded = load_checkpoint(context.artifacts["checkpoint"], device=device)

    def predict(self, context, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list[str]:
        from mllm.sample import sample_text

        p = dict(params or {})
        method = p.pop("method", None) or self.loaded.config.sample.methods[0]
        return [sample_text(self.loaded, prompt, method, **p) for prompt in _prompts(model_input)]


def _prompts(model_input: Any) -> list[str]:
    """Prompts from a DataFrame (its "prompt" column, else the first), a Series, a list, a
    dict or a str. MLflow turns {"prompt": [a, b]} into one row holding the list: unpack it."""
    x = model_input
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return _prompts(x.get("prompt", next(iter(x.values()), [])))
    if hasattr(x, "columns"):  # pandas.DataFrame
        x = x["prompt" if "prompt" in x.columns else x.columns[0]]
    if hasattr(x, "tolist"):  # Series, numpy array
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [p for item in x for p in _prompts(item)]
    return [str(x)]


def _signature(cfg: RunConfig) -> ModelSignature:
    s = cfg.sample
    return ModelSignature(
        inputs=Schema([ColSpec("string")]),  # unnamed: a plain list of prompts works too
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([
            ParamSpec("method", "string", s.methods[0]),
            ParamSpec("max_new_tokens", "long", s.max_new_tokens),
            ParamSpec("temperature", "double", s.temperature),
            ParamSpec("top_k", "long", s.top_k),
            ParamSpec("top_p", "double", s.top_p),
            ParamSpec("beam_width", "long", s.beam_width),
            ParamSpec("seed", "long", s.seed),
        ]),
    )


def _model_script(tmp: str) -> str:
    """The model as code, not as a pickle: MLflow runs this file to build it on load."""
    path = Path(tmp, "text_generator.py")
    path.write_text(
        "# An mllm checkpoint that continues prompts: see tasks/tracking.py.\n"
        "import mlflow\n\n"
        "from tasks.tracking import TextGenerator\n\n"
        "mlflow.models.set_model(TextGenerator())\n")
    return str(path)


def _model_code(tmp: str) -> list[str]:
    """mllm and this module travel with the model, so that it loads where neither is
    installed."""
    code = Path(tmp, "code")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(Path(mllm.__file__).parent, code / "mllm", ignore=ignore)
    (code / "tasks").mkdir()
    (code / "tasks" / "__init__.py").write_text("")
    shutil.copy(__file__, code / "tasks" / "tracking.py")
    return [str(code / "mllm"), str(code / "tasks")]


def _requirements() -> list[str]:
    # Pinned from this environment, since MLflow's inference would load the model in a
    # subprocess; without local labels (+cpu, +cu121): the server picks its own torch build.
    return [f"{dist}=={_version(dist).split('+')[0]}" for dist in (
        "mlflow", "torch", "numpy", "pyarrow", "fsspec", "pydantic", "pyyaml", "tokenizers")
        if _version(dist) != "not installed"]


# --- the pipeline's tracking tasks ---------------------------------------------------------

@task(name="log-data", retries=2, retry_delay_seconds=2)
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
    run.log_text(storage.read_text(data.vocab.url), "vocab.json")
    run.set_tags({"data.raw_sha256": data.raw_sha256, "data.vocab_digest": data.vocab.digest,
                  "data.splits": data.splits.url})


@task(name="log-skipped", retries=2, retry_delay_seconds=2)
def log_skipped(run_id: str, cfg: RunConfig, root: str, champion: dict[str, Any], reason: str) -> None:
    """A run that did not train: the champion it deferred to, and why."""
    run = RunTracker.attach(run_id, cfg, root)
    run.set_tags({"champion.version": champion["version"], "champion.run_id": champion["run_id"] or ""})
    run.set_decision("skipped", reason)


@task(name="log-outcome", retries=2, retry_delay_seconds=2)
def log_outcome(run_id: str, cfg: RunConfig, root: str, trained: Any, evaluation: Any,
                samples: dict[str, list[str]], data: Any = None, champion_score: Any = None) -> dict[str, Any]:
    """Final metrics, report, samples, loss curve; the model, and the champion decision."""
    run = RunTracker.attach(run_id, cfg, root)
    e = evaluation
    run.log_metrics([{"step": trained.steps, "final_val_loss": e.loss, "final_val_perplexity": e.perplexity,
                      "final_val_bits_per_token": e.bits_per_token, "final_val_bits_per_byte": e.bits_per_byte,
                      "baseline_unigram_bits_per_token": e.unigram_bits_per_token,
                      "baseline_bigram_bits_per_token": e.bigram_bits_per_token}])
    run.log_text(storage.read_text(e.report), "evaluation.md")
    run.log_dict(e.model_dump(mode="json"), "evaluation.json")
    for method, texts in samples.items():
        run.log_text("\n\n".join(f"--- prompt {p!r}\n{t}" for p, t in zip(cfg.sample.prompts, texts)) + "\n",
                     f"samples/{method}.txt")
    run.log_dict({"prompts": cfg.sample.prompts, "methods": list(samples)}, "samples/prompts.json")
    run.log_loss_curve()
    run.set_tags({"train.steps": trained.steps, "train.stop_reason": trained.stop_reason,
                  "train.run_dir": trained.run_dir, "train.resumed_from_step": trained.resumed_from_step})
    version_tags = {"train.key": trained.key}
    if data is not None:
        version_tags.update({"data.splits_key": data.splits.key, "data.raw_sha256": data.raw_sha256})
    run.set_tags({"train.key": trained.key})
    outcome = run.log_model(e.checkpoint, e.loss, version_tags=version_tags, champion_score=champion_score,
                            bits_per_byte=e.bits_per_byte)
    run.set_tags({"model_uri": outcome["model_uri"], "model_version": f"{outcome['name']}/{outcome['version']}"})
    return outcome
