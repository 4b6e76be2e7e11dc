"""Where a model came from: from a registered version (or a run) back to the corpus bytes, and from
a corpus forward to every run and version trained on it.

The chain is read from what the pipeline recorded (the run's tags, the registered version's tags)
and every link that lives in storage is checked there: a stage folder that was deleted, or whose
content no longer has the recorded digest, is reported as such, never skipped. Nothing here
trusts a tag that storage can contradict.
"""

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

from flows.history.lineage_corpus import manifest_link, packs_link
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
from mllm.data.vocab import Vocab
from mllm.export import MANIFEST
from mllm.resolve import validate
from mllm.runtime.epochs import ids_digest, missing_piece
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
        _split_link(tags),
        _vocab_link(tags),
        _tokens_link(tags),
        _corpus_link(tags, files),
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


def _stage_folder(link: str, what: str, url: str | None, key: str | None) -> tuple[dict[str, Any], dict | None]:
    """The first checks of a stage folder written with staged_dir: recorded, there, complete.
    (the link's fields, the folder's manifest) when they pass; else (the finished link, None)."""
    fields: dict[str, Any] = {"key": key, "uri": url}
    if not url:
        return make_link(link, UNRECORDED), None
    if not storage.exists(url):
        return make_link(link, MISSING, **fields, detail=f"the {what} folder is gone"), None
    if not storage.is_complete(url) or not storage.exists(storage.join(url, "manifest.json")):
        return make_link(
            link, MISSING, **fields, detail=f"the {what} folder is incomplete (no {storage.DONE} or manifest.json)"
        ), None
    return fields, storage.read_json(storage.join(url, "manifest.json"))


def _split_link(t: dict[str, str]) -> dict[str, Any]:
    key = t.get("data.splits_key")
    fields, manifest = _stage_folder("split", "split", t.get("data.splits"), key)
    if manifest is None:
        return fields
    recorded = manifest.get("key") or (manifest.get("splits") or {}).get("key")
    splits = manifest.get("splits", manifest)
    fields["tokens"] = {
        name: part["n_tokens"] for name in ("train", "val", "test") if isinstance(part := splits.get(name), dict)
    }
    if key and recorded != key:
        return make_link("split", CHANGED, **fields, detail=f"its manifest names key {recorded}")
    for name in fields["tokens"]:
        part = splits[name]
        if not storage.exists(part["ids"]):
            return make_link("split", MISSING, **fields, detail=f"{part['ids']} is gone")
        if part["ids"].endswith(".json") and (gone := missing_piece(part["ids"])):
            return make_link("split", MISSING, **fields, detail=f"{gone} is gone")
        if part.get("sha256"):
            if (now := ids_digest(part["ids"])) != part["sha256"]:
                return make_link(
                    "split",
                    CHANGED,
                    **fields,
                    detail=f"{part['ids']} now has sha256 {now[:16]}, its manifest {part['sha256'][:16]}",
                )
        elif part["ids"].endswith(".npy"):  # written before split digests were recorded
            n = _npy_length(part["ids"])
            if n != part["n_tokens"]:
                return make_link(
                    "split",
                    CHANGED,
                    **fields,
                    detail=f"{part['ids']} holds {n} tokens, its manifest {part['n_tokens']}",
                )
    return make_link("split", OK, **fields)


def _npy_length(url: str) -> int | None:
    """The length of a flat .npy array, read from its header (not its data)."""
    import numpy as np

    fs, path = storage.filesystem(url)
    with fs.open(path, "rb") as f:
        try:
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
        except ValueError:
            return None
        data_bytes = fs.size(path) - f.tell()
    # A truncated file holds fewer tokens than its header says.
    return min(shape[0], data_bytes // dtype.itemsize) if len(shape) == 1 else None


def _vocab_link(t: dict[str, str]) -> dict[str, Any]:
    url, digest = t.get("data.vocab"), t.get("data.vocab_digest")
    fields = {"key": t.get("data.vocab_key"), "uri": url, "digest": digest}
    if not url:
        return make_link("vocabulary", UNRECORDED, **fields)
    if not storage.exists(url):
        return make_link("vocabulary", MISSING, **fields, detail=f"{url} is gone")
    vocab = Vocab.load(url)
    fields["size"] = len(vocab)
    if digest and vocab.digest != digest:
        return make_link("vocabulary", CHANGED, **fields, detail=f"{url} now has digest {vocab.digest}")
    return make_link("vocabulary", OK, **fields)


def _tokens_link(t: dict[str, str]) -> dict[str, Any]:
    key = t.get("data.tokens_key")
    if t.get("data.tokens_corpus"):
        return packs_link(t["data.tokens_corpus"], key)
    fields, manifest = _stage_folder("tokens", "token chunks", t.get("data.tokens"), key)
    if manifest is None:
        return fields
    fields["n_tokens"] = manifest.get("n_tokens")
    if key and manifest.get("key") != key:
        return make_link("tokens", CHANGED, **fields, detail=f"its manifest names key {manifest.get('key')}")
    return make_link("tokens", OK, **fields)


def _corpus_link(t: dict[str, str], files: bool = False) -> dict[str, Any]:
    """The stored copy of the corpus, hashed again where it holds the source's bytes unchanged
    (UTF-8, not compressed); its metadata (raw/<sha256>.json) for the source and byte count.
    A corpus of many files: its manifest (flows.history.lineage_corpus.manifest_link)."""
    if t.get("data.raw_files", "1") != "1" or (t.get("data.raw_url") or "").endswith(".json"):
        return manifest_link(t, files)
    sha, url = t.get("data.raw_sha256"), t.get("data.raw_url")
    fields: dict[str, Any] = {
        "sha256": sha,
        "uri": url,
        "source": t.get("data.source"),
        "bytes": int(t["data.raw_bytes"]) if t.get("data.raw_bytes") else None,
    }
    if not sha or not url:
        return make_link("corpus", UNRECORDED, **fields)
    meta_url = url[: -len(".txt")] + ".json" if url.endswith(".txt") else None
    meta = storage.read_json(meta_url) if meta_url and storage.exists(meta_url) else {}
    fields.update(source=meta.get("source") or fields["source"], bytes=meta.get("bytes") or fields["bytes"])
    if not storage.exists(url):
        return make_link("corpus", MISSING, **fields, detail=f"the stored copy {url} is gone")
    if meta.get("encoding", "utf-8") not in ("utf-8", "ascii") or meta.get("compression") or not meta:
        return make_link("corpus", OK, **fields, detail="stored converted or made: present, not hashed again")
    if (now := storage.sha256_file(url)) != sha:
        return make_link("corpus", CHANGED, **fields, detail=f"the stored copy now has sha256 {now}")
    return make_link("corpus", OK, **fields)


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
