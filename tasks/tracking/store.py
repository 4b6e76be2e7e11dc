"""Where MLflow runs go: the store or server MLFLOW_TRACKING_URI names, else an SQLite file beside a
local storage root; a client of it (the store created if new) and a run's page in the UI."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import fsspec
import mlflow
from fsspec.implementations.local import LocalFileSystem
from mlflow.tracking import MlflowClient

from mllm import UserError
from mllm.settings import export_defaults
from tasks.settings import settings


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
    uri = settings().mlflow_tracking_uri.strip()
    if uri and uri != _derived_uri:  # set_tracking_uri exports what we chose: not the user's
        parts = urlsplit(uri)
        check_not_a_folder(uri)
        if parts.username or parts.password:
            export_defaults(
                {"MLFLOW_TRACKING_USERNAME": parts.username or "", "MLFLOW_TRACKING_PASSWORD": parts.password or ""}
            )
            uri = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    else:
        path = local_store(storage_root)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        uri = _derived_uri = f"sqlite:///{path}"
    mlflow.set_tracking_uri(uri)
    return uri


def check_not_a_folder(uri: str) -> None:
    """MLflow 3 refuses a tracking URI that is a folder (its file store is in maintenance mode)
    with a traceback from deep in the run: one line instead, before anything runs."""
    scheme = urlsplit(uri).scheme
    if scheme == "file" or (not scheme and (os.sep in uri or os.path.exists(uri))):
        raise UserError(
            f"MLFLOW_TRACKING_URI={uri} names a folder, which MLflow no longer tracks to: give "
            "sqlite:///PATH/mlflow.db or a server's http(s):// URL, or unset it (runs then go to "
            "mlflow.db beside the storage root)"
        )


def local_store(storage_root: str) -> str:
    """Where runs are tracked when MLFLOW_TRACKING_URI is not set: mlflow.db beside a local
    storage root (in the current folder for an object-store root)."""
    root = _local_path(storage_root)
    folder = os.path.dirname(root.rstrip(os.sep)) if root else os.getcwd()
    return os.path.join(folder, "mlflow.db")


def client(storage_root: str) -> MlflowClient:
    """A client of the run's tracking store (see `tracking_uri`), the store created if new."""
    uri = tracking_uri(storage_root)
    _create_store(uri)
    return MlflowClient(uri)


def run_url(storage_root: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI when the runs go to a server (None for a local store), in
    the model-training view: MLflow 3.17's UI opens in its GenAI view unless a link asks otherwise,
    whatever the experiment's kind tag says (the view is the browser's setting)."""
    c = client(storage_root)
    if not c.tracking_uri.startswith(("http://", "https://")):
        return None
    experiment = c.get_run(run_id).info.experiment_id
    return f"{c.tracking_uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"


_created: set[str] = set()


def _create_store(uri: str) -> None:
    """Create an SQLite store's tables under a file lock: two runs started at once on a new store
    would otherwise both run MLflow's table creation, and one of them fails."""
    if not uri.startswith("sqlite:///") or uri in _created:
        return
    path = uri[len("sqlite:///") :]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            MlflowClient(uri).search_experiments(max_results=1)  # creates and migrates the tables
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _created.add(uri)


def artifact_root(uri: str) -> str | None:
    """A local SQLite store keeps its artifacts beside the database, not in ./mlruns of
    whichever folder the process happens to start in. Servers choose their own."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(os.path.dirname(uri[len("sqlite:///") :]), "mlruns").resolve().as_uri()
