"""Where a model came from: from a registered version (or a run) back to the corpus bytes, and from
a corpus forward to every run and version trained on it, each link in storage checked there."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows.history.lineage_data import corpus_link, split_link, tokens_link, vocab_link
from flows.history.links import (
    BROKEN,
    CHANGED,
    MISSING,
    OK,
    UNCHECKED,
    UNRECORDED,
    as_float,
    as_int,
    clean,
    get_or_none,
    make_link,
    model_id,
)
from mllm import UserError, layout, storage
from mllm.export import MANIFEST
from mllm.resolve import validate
from tasks.tracking import store as tracking
from tasks.tracking.exports import model_version as _model_version

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


# --- from a model back to the corpus -------------------------------------------------------


def trace(root: str, ref: str, files: bool = False) -> dict[str, Any]:
    """The chain of `ref` (MODEL@ALIAS, MODEL/VERSION or an MLflow run id), newest first, each
    stage's link checked against storage."""
    exported = _export_link(ref)
    if exported is not None:  # an export's folder: the chain of the model it came from
        ref = exported["model"] or exported["mlflow_run"]
    client = tracking.client(root)
    version = _model_version(client, ref)
    run_id = version.run_id if version is not None else ref
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise UserError(f"no MLflow run {run_id} in {tracking.tracking_uri(root)}: see `mllm-pipeline runs`") from None
    tags = run.data.tags
    if version is None and tags.get("model_version"):
        name, _, number = tags["model_version"].rpartition("/")
        version = get_or_none(client.get_model_version, name, number)
    links = [exported, _model_link(version), _run_link(client, run), _prefect_link(tags), _code_link(tags)]
    links += [
        _training_link(tags, version),
        split_link(tags),
        vocab_link(tags),
        tokens_link(tags),
        corpus_link(tags, files),
    ]
    chain = {
        "ref": ref,
        "tracking_uri": tracking.tracking_uri(root),
        "links": [link for link in links if link is not None],
    }
    chain["ok"] = not any(link["status"] in BROKEN for link in chain["links"])
    return clean(chain)


def _export_link(ref: str) -> dict[str, Any] | None:
    """An export folder's manifest (mllm.export.MANIFEST) with each of its files checked, or None
    when `ref` is no such folder."""
    if _RUN_ID.match(ref) or not storage.exists(storage.join(ref, MANIFEST)):
        return None
    m = storage.read_json(storage.join(ref, MANIFEST))
    gone = [f for f in m.get("files", []) if not storage.exists(storage.join(ref, f))]
    fields = {
        "format": m.get("format"),
        "uri": storage.hide_credentials(ref),
        "model": m.get("model"),
        "mlflow_run": m.get("mlflow_run"),
        "libraries": m.get("libraries"),
    }
    if gone:
        return make_link("export", MISSING, **fields, detail=f"{', '.join(gone)} gone from the folder")
    return make_link("export", OK, **fields)


def _model_link(version: Any) -> dict[str, Any] | None:
    if version is None:
        return None
    t = version.tags
    return make_link(
        "model",
        OK,
        name=version.name,
        version=str(version.version),
        aliases=list(version.aliases or []),
        model_id=model_id(version),
        headline=t.get("headline"),
        headline_value=as_float(t.get("headline.value")),
        checkpoint=t.get("checkpoint"),
        decision=t.get("champion.decision"),
    )


def _run_link(client: MlflowClient, run: Any) -> dict[str, Any]:
    t, m = run.data.tags, run.data.metrics
    experiment = get_or_none(client.get_experiment, run.info.experiment_id)
    return make_link(
        "run",
        OK,
        run_id=run.info.run_id,
        name=run.info.run_name,
        experiment=experiment.name if experiment else None,
        run_status=run.info.status,
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.info.start_time / 1000)),
        decision=t.get("decision"),
        final_val_loss=m.get("final_val_loss"),
        model_id=t.get("model_id"),
        best_step=as_int(t.get("model_id.best_step")),
        last_model_id=t.get("model_id.last"),
        last_step=as_int(t.get("model_id.last_step")),
    )


def _prefect_link(t: dict[str, str]) -> dict[str, Any]:
    """The Prefect flow run that ran the pipeline, looked up on the Prefect API this process is
    configured with (PREFECT_API_URL). Missing only where the run was recorded on that very
    server; unchecked where no API is configured, none answers, or the run was recorded on
    another server (its UI url says which; none is recorded on Prefect's temporary server)."""
    flow_run_id, url = t.get("prefect.flow_run_id"), t.get("prefect.flow_run_url")
    if not flow_run_id:
        return make_link("prefect", UNRECORDED, detail="no Prefect flow run recorded")
    fields: dict[str, Any] = {"flow_run_id": flow_run_id, "ui": url}
    status, found, detail = _flow_run(flow_run_id, url)
    return make_link("prefect", status, **fields, **found, detail=detail)


def _flow_run(flow_run_id: str, url: str | None) -> tuple[str, dict[str, Any], str | None]:
    """(status, what the API says about the flow run, why not ok)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, PREFECT_UI_URL, temporary_settings

    try:
        flow_run_uuid = UUID(flow_run_id)
    except ValueError:
        return UNCHECKED, {}, f"{flow_run_id!r} is no flow run id"
    api = PREFECT_API_URL.value()
    if not api:
        return UNCHECKED, {}, "no Prefect API configured (PREFECT_API_URL) to look the flow run up"
    ui = (PREFECT_UI_URL.value() or "").rstrip("/")
    try:
        # No retries: an API that does not answer at once makes this link unchecked, not the
        # command slow.
        with (
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}),
            get_client(sync_client=True, httpx_settings={"timeout": 5.0}) as client,
        ):
            if (failure := client.api_healthcheck()) is not None:
                return UNCHECKED, {}, f"the Prefect API at {api} does not answer ({_short(failure)})"
            if url and ui and not url.startswith(ui + "/"):
                return UNCHECKED, {}, f"recorded on another Prefect server than the one at {api}"
            try:
                run = client.read_flow_run(flow_run_uuid)
            except ObjectNotFound:
                if url:
                    return (
                        MISSING,
                        {},
                        (f"the Prefect server at {api} has no such flow run (deleted, or its database is new)"),
                    )
                return (
                    UNCHECKED,
                    {},
                    (
                        f"not on the Prefect server at {api}; the run recorded no UI url: "
                        "it ran on Prefect's temporary server"
                    ),
                )
    except Exception as e:  # noqa: BLE001  (a link that cannot be checked is reported, never fatal)
        return UNCHECKED, {}, f"the Prefect API at {api} does not answer ({_short(e)})"
    return OK, {"name": run.name, "state": run.state.name if run.state else None, "api": api}, None


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text or type(e).__name__)[:160]


def _code_link(t: dict[str, str]) -> dict[str, Any]:
    if not t.get("git.commit"):
        return make_link("code", UNRECORDED, detail="no git commit recorded (not run from a git checkout)")
    commit = t["git.commit"]
    fields = dict(commit=commit, dirty=t.get("git.dirty") == "true", branch=t.get("git.branch"))
    here = Path(__file__).resolve().parents[1]
    top = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode:
        return make_link("code", UNCHECKED, **fields, detail=f"{here} is no git checkout: the commit was not looked up")
    repo = top.stdout.strip()
    if subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
        return make_link(
            "code",
            MISSING,
            **fields,
            detail=f"commit {commit[:12]} is not in the repository {repo}: "
            "fetch it (git fetch), or its history was rewritten and the code is gone",
        )
    return make_link("code", OK, **fields)


def _training_link(t: dict[str, str], version: Any) -> dict[str, Any]:
    """The training key, recomputed from the run folder's config and the recorded data digests
    and code digest: a config edited in place, or a folder gone, shows here."""
    key = t.get("train.key")
    if not key:
        return make_link("training", UNRECORDED, detail="no training key recorded (the run did not get that far)")
    fields = {"key": key, "config_digest": t.get("train.config_digest"), "code_digest": t.get("train.code_digest")}
    run_dir = t.get("train.run_dir") or (
        layout.folder(t["storage.root"], layout.RUNS, key) if t.get("storage.root") else None
    )
    checkpoint = version.tags.get("checkpoint") if version is not None else None
    fields.update(uri=run_dir, checkpoint=checkpoint)
    if run_dir is None:
        return make_link("training", UNRECORDED, **fields, detail="no run folder recorded")
    config_url = storage.join(run_dir, "config.yaml")
    if not storage.exists(config_url):
        return make_link("training", MISSING, **fields, detail=f"{config_url} is gone")
    if checkpoint and not storage.exists(checkpoint):
        return make_link("training", MISSING, **fields, detail=f"checkpoint {checkpoint} is gone")
    if not (fields["config_digest"] and fields["code_digest"] and t.get("data.splits_key")):
        return make_link("training", OK, **fields, detail="run folder present; key parts not recorded by this run")
    cfg = validate(yaml.safe_load(storage.read_text(config_url)), config_url)
    if layout.config_digest(cfg) != fields["config_digest"]:
        return make_link(
            "training",
            CHANGED,
            **fields,
            detail=f"{config_url} has config digest {layout.config_digest(cfg)}, not the recorded one",
        )
    again = layout.train_key(
        t["data.splits_key"],
        t.get("data.vocab_digest", ""),
        cfg,
        fields["code_digest"],
        json.loads(t.get("train.cpu_env") or "{}"),
    )
    if again != key:
        return make_link("training", CHANGED, **fields, detail=f"the recorded parts digest to {again}, not to the key")
    return make_link("training", OK, **fields)


# --- printing ------------------------------------------------------------------------------


def render(chain: dict[str, Any]) -> str:
    """The chain as a person reads it: one block per link, newest first, its status at the right."""
    out = []
    for each in chain["links"]:
        name, status = each["link"], each["status"]
        head = {
            "model": lambda x: (
                f"{x['name']}/{x['version']}"
                + (f" @{', @'.join(x['aliases'])}" if x.get("aliases") else "")
                + (f"  {x['headline']} {x['headline_value']:.4f}" if x.get("headline_value") is not None else "")
            ),
            "export": lambda x: (
                f"{x['format']}  of {x.get('model') or x.get('mlflow_run')}  "
                + ", ".join(f"{k} {v}" for k, v in (x.get("libraries") or {}).items())
            ),
            "run": lambda x: f"{x['run_id']}  {x.get('name', '')}  {x.get('run_status', '')}  {x.get('started', '')}",
            "prefect": lambda x: (
                f"flow run {x.get('flow_run_id', '?')}"
                + (f"  {x['name']}" if x.get("name") else "")
                + (f"  {x['state']}" if x.get("state") else "")
            ),
            "code": lambda x: (
                f"git {x['commit']}" + (" (dirty: uncommitted changes)" if x.get("dirty") else " (clean)")
                if x.get("commit")
                else ""
            ),
            "training": lambda x: f"key {x.get('key', '?')}",
            "split": lambda x: (
                f"key {x.get('key', '?')}  "
                + " / ".join(f"{k} {v:,}" for k, v in x.get("tokens", {}).items())
                + (" tokens" if x.get("tokens") else "")
            ),
            "vocabulary": lambda x: (
                f"digest {x.get('digest', '?')}" + (f"  {x['size']} entries" if x.get("size") else "")
            ),
            "tokens": lambda x: (
                f"key {x.get('key', '?')}" + (f"  {x['n_tokens']:,} tokens" if x.get("n_tokens") else "")
            ),
            "corpus": lambda x: (
                f"sha256 {x.get('sha256', '?')}"
                + (f"  {x['files']:,} files" if x.get("files") else "")
                + (f"  {x['bytes']:,} bytes" if x.get("bytes") else "")
            ),
        }[name](each)
        mark = "" if status == OK else f"  [{status.upper()}]"
        out.append(f"{name:11} {head}{mark}")
        if name == "run" and each.get("model_id"):
            each = {
                **each,
                "model_id": f"{each['model_id']} (best, step {each.get('best_step')})"
                + (
                    f"; last: {each['last_model_id']} (step {each.get('last_step')})"
                    if each.get("last_model_id")
                    else ""
                ),
            }
        for field, label in (
            ("model_id", "logged model"),
            ("checkpoint", "checkpoint"),
            ("decision", "decision"),
            ("experiment", "experiment"),
            ("ui", "ui"),
            ("api", "checked at"),
            ("branch", "branch"),
            ("config_digest", "config digest"),
            ("code_digest", "code digest"),
            ("uri", "uri"),
            ("source", "source"),
        ):
            if each.get(field) not in (None, "") and not (name == "model" and field == "decision"):
                out.append(f"{'':11} {label}: {each[field]}")
        for f in each.get("file_list", []):
            out.append(f"{'':11} file: {f['sha256'][:16]}  {f['bytes']:>12,} bytes  {f['source']}")
        if each.get("detail"):
            out.append(f"{'':11} {status}: {each['detail']}" if status != OK else f"{'':11} note: {each['detail']}")
    broken = [each["link"] for each in chain["links"] if each["status"] in BROKEN]
    out.append(f"broken links: {', '.join(broken)}" if broken else "every link checked against storage: ok")
    return "\n".join(out)


def as_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
