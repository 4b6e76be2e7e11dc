"""How a run is launched: its storage root, where Prefect keeps task results, and the work pool
its training goes to (`--train-on`, else the recipe's `pipeline.pool`, else this process)."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import urllib.error
import urllib.request
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

from flows.settings import settings
from mllm import UserError, storage
from mllm.redact import strip_userinfo
from mllm.resolve import LAUNCH_SECTION, Overrides, recipe_dict, resolve


def storage_root(storage_url: str | None = None) -> str:
    """The storage root: --storage, else $MLLM_STORAGE, else ./storage."""
    root = storage_url or settings().storage or "storage"
    if "://" not in root:
        # The real folder: a stage Prefect finds cached hands back the paths of the run that made
        # it, and a root given once through a symlink and once not would mix two names for one folder.
        root = os.path.realpath(os.path.expanduser(root))
    return root.rstrip("/")


def with_results(fl: Any, root: str, task_runner: Any = None) -> Any:
    """The flow with its task results (and so Prefect's cache records) kept under `root`, and its
    mapped tasks on `task_runner` when one is given."""
    from tasks.caching import forget_exception, result_storage  # imports Prefect: not on the CLI's fast paths

    # The flows themselves persist no result; their tasks take this storage for their results
    # and cache records. Prefect also writes a failed run's exception there: the hooks remove it.
    options: dict[str, Any] = {"task_runner": task_runner} if task_runner is not None else {}
    return fl.with_options(
        result_storage=result_storage(root),
        persist_result=False,
        on_failure=[forget_exception],
        on_crashed=[forget_exception],
        **options,
    )


def data_runner(name: str) -> Any:
    """The task runner of the data stages' per-file work (`data.task_runner`): a process pool
    with a worker per core (tokenizing is CPU work that holds the GIL), threads, or an existing
    Dask cluster through prefect-dask."""
    if name == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=len(os.sched_getaffinity(0)))
    if name.startswith("dask://"):
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise UserError(
                "data.task_runner dask://... needs prefect-dask: pip install 'mllm-pipeline\\[dask]'"
            ) from None
        return DaskTaskRunner(address="tcp://" + name.removeprefix("dask://"))
    from prefect.task_runners import ProcessPoolTaskRunner

    return ProcessPoolTaskRunner(max_workers=len(os.sched_getaffinity(0)))


def training_pool(recipe: str | None, train_on: str | None) -> str | None:
    """Where a recipe trains: the pool asked for, else the one its recipe file names under
    `pipeline: {pool: NAME}`, else None (this process). Not part of the run's config: where a
    model trains is not what it is."""
    if train_on:
        return train_on
    if recipe is None:
        return None
    return (recipe_dict(recipe).get(LAUNCH_SECTION) or {}).get("pool")


def preflight(root: str) -> None:
    """Check, before any stage runs, what would otherwise fail minutes into a run: a storage root
    that cannot be a folder or cannot be written, and a tracking server that does not answer."""
    check_storage(root)
    check_tracking_server()
    check_prefect_server()


# The local folders this process made for a storage root, deepest first: a command that ends in
# a mistake takes away those still empty (`remove_empty_roots`), so that it leaves nothing behind.
made_roots: list[Path] = []


def check_storage(root: str) -> None:
    if "://" in root and not root.startswith("file://"):
        storage.check_writable(root, "choose another --storage (or MLLM_STORAGE)")
        return
    path = Path(root.removeprefix("file://"))
    fix = "choose another folder with --storage or MLLM_STORAGE"
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists():
            if not folder.is_dir():
                what = "is" if folder == path else f"is under {folder}, which is"
                raise UserError(f"storage root {root} {what} a file, not a folder: {fix}")
            break
        missing.append(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        made_roots.extend(f for f in missing if f not in made_roots)
        probe = path / f".mllm-write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"storage root {root} cannot be written ({e.strerror or type(e).__name__}): {fix}") from None


def remove_empty_roots() -> None:
    """The storage folders this process made that are still empty, removed."""
    for folder in made_roots:
        try:
            folder.rmdir()  # only when empty
        except OSError:
            pass
    made_roots.clear()


def check_tracked(root: str) -> None:
    """For the commands that read tracked runs: the tracking server answers, or the local store
    exists (reading must not create an empty store, and an empty one answers every question with
    "not found" where the real mistake is the folder)."""
    check_tracking_server()
    uri = settings().mlflow_tracking_uri.strip()
    if uri and not uri.startswith("sqlite:///"):
        return
    from tasks.tracking.store import local_store

    path = uri[len("sqlite:///") :] if uri else local_store(root)
    if not os.path.exists(path):
        where = "MLFLOW_TRACKING_URI names it" if uri else "beside the storage root"
        raise UserError(
            f"no runs are tracked here: the MLflow store {path} ({where}) does not exist; "
            "give the --storage root (or MLFLOW_TRACKING_URI) that `run` used"
        )


def check_tracking_server(timeout: float = 5.0) -> None:
    """An MLflow server named by MLFLOW_TRACKING_URI must answer its health check within seconds
    (MLflow's own client would retry for minutes before failing)."""
    uri = settings().mlflow_tracking_uri.strip()
    if uri:
        from tasks.tracking.store import check_not_a_folder

        check_not_a_folder(uri)
    if not uri.startswith(("http://", "https://")):
        return
    from flows.stack.auth_errors import _tls, mlflow_refused, tls_line
    from tasks.tracking.servers import health_request

    clean, _ = strip_userinfo(uri)
    req, ctx = health_request(f"{clean.rstrip('/')}/health")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx):
            return
    except urllib.error.HTTPError as e:
        if e.code == 401 and "mllm stack" in e.headers.get("WWW-Authenticate", ""):
            raise UserError(mlflow_refused(401)) from None
        return  # it answered (a proxy in front may guard /health): the server is there
    except (OSError, ValueError) as e:
        why = _tls(getattr(e, "reason", None) or e)
        if why:
            raise UserError(tls_line(True, why)) from None
        reason = getattr(e, "reason", None) or e
        raise UserError(
            f"the MLflow tracking server {clean} does not answer ({reason}): start it "
            "(`mllm-pipeline stack up` starts one) or point MLFLOW_TRACKING_URI at one that "
            "runs (unset, runs are tracked in an SQLite file beside the storage root)"
        ) from None


def check_prefect_server(timeout: float = 5.0) -> None:
    """A Prefect server named by PREFECT_API_URL: its certificate, this client's credential, and
    its Prefect version, the one this client runs. Its /admin/version route (which Prefect's
    client reads too) shows all three."""
    s = settings()
    api = s.prefect_api_url.strip().rstrip("/")
    if not api.startswith(("http://", "https://")):
        return  # Prefect's temporary server, started by this command: the same version
    from flows.stack.auth_errors import _tls, prefect_refused, tls_line, version_line

    clean, _ = strip_userinfo(api)
    req = urllib.request.Request(f"{api}/admin/version")
    if auth := s.prefect_api_auth_string:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    ca = s.prefect_api_ssl_cert_file
    ctx = ssl.create_default_context(cafile=ca or None) if api.startswith("https") else None
    if ctx and s.prefect_api_tls_insecure_skip_verify:
        ctx.check_hostname, ctx.verify_mode = (
            False,
            ssl.CERT_NONE,
        )  # the user's own choice, as Prefect's client takes it
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            server = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise UserError(prefect_refused(e.code)) from None
        return  # it answered: what else is wrong, Prefect's client reports
    except (OSError, ValueError) as e:
        why = _tls(getattr(e, "reason", None) or e)
        if why:
            raise UserError(tls_line(False, why)) from None
        return  # no answer: the command's own handling of a Prefect server that is away says so
    line = version_line(clean, str(server), version("prefect"))
    if line:
        raise UserError(line)


# A registered model's name, as `models:/NAME@champion` takes it.
MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


def check_model_name(name: str) -> None:
    if not re.fullmatch(MODEL_NAME, name):
        raise UserError(
            f"--model {name!r} is not a model name: use letters, digits, '.', '_' and '-' (at most 128, "
            "the first a letter or digit), e.g. --model stdlib-smoke"
        )


def checked_config(
    recipe: str,
    sets: Overrides,
    source: str | list[str] | None,
    storage: str | None,
    train_here: bool = True,
    trains: bool = True,
):
    """The config, checked before Prefect starts: a bad recipe, --set, storage root or tracking
    server, a source that is missing, unreachable, or (a local file) not usable text, a local
    corpus's file whose head is not, and a device this machine lacks, all fail at once in one line."""
    from mllm.data import corpus, files, heads
    from mllm.families.base import family_of
    from mllm.runtime.devices import resolve_device

    cfg = resolve(recipe, overrides=sets, source=source)

    family = family_of(cfg)
    if trains and train_here:
        resolve_device(cfg.train.device)  # a worker on a pool has its own devices
    # (Data made from the config has no source to open; parallel text may be made too: numbers.)
    if cfg.data.source or family.data == "corpus":
        single = cfg.data.source
        if family.data == "corpus":
            # A folder, prefix or glob is listed: an empty folder or a glob that matches nothing
            # fails here. A corpus of many files is checked file by file by the download stage.
            found, _ = files.list_files(cfg.data.sources)
            single = found[0].url if len(found) == 1 and found[0].format == "text" else None
            empty = {f.url for f in heads.empty_files(found, cfg.data.bad_files, cfg.data.sources)}
            if not single and cfg.data.bad_files != "skip":
                # Each local file's head: a bad file is this one line, before Prefect or storage
                # are touched, not a stage's failure half a minute in (the standard library's 168
                # top-level modules, 4.7 MB: 0.06 s on 2 cores at load 5). Empty ones are left out.
                for f in (f for f in found if f.url not in empty):
                    if "://" not in f.url or f.url.startswith("file://"):
                        heads.check_head(f, cfg.data.text_field)
        if single:
            try:
                heads.open_local(single).close()  # a missing file or unreachable host: seconds, not minutes
            except corpus.SourceServerError:
                pass  # a server error may pass: the download stage retries it
            if "://" not in single or single.startswith("file://"):
                # A local file is read through once here, as the download stage will read it.
                corpus.download(single, None, cfg.data.sha256)
                family.check_source(cfg)
    # Last: it makes the storage folder, which a mistake found above must not leave behind.
    preflight(storage_root(storage))
    return cfg
