"""The lineage of corpora: a many-file corpus's links in a model's chain (its manifest and token
packs, checked against storage), and from a corpus forward, every run and model version trained
on a corpus whose digest starts with a prefix, or on one that holds a file whose digest does."""

from __future__ import annotations

import re
import time
from typing import Any

from flows.history.links import CHANGED, MISSING, OK, as_float, as_int, clean, get_or_none, make_link, model_id
from mllm import UserError, layout, storage
from tasks.data.download import corpus_digest, file_key
from tasks.tracking import store as tracking


def packs_link(url: str, key: str | None) -> dict[str, Any]:
    """A many-file corpus's tokens: the packs its tokens list, each still complete."""
    fields: dict[str, Any] = {"key": key, "uri": url}
    if not storage.exists(url):
        return make_link("tokens", MISSING, **fields, detail=f"{url} is gone")
    doc = storage.read_json(url)
    fields.update(n_tokens=doc.get("n_tokens"), packs=len(doc["packs"]))
    for p in doc["packs"]:
        if not storage.is_complete(p["url"]):
            return make_link("tokens", MISSING, **fields, detail=f"the token pack {p['url']} is gone or incomplete")
    return make_link("tokens", OK, **fields)


def manifest_link(t: dict[str, str], files: bool) -> dict[str, Any]:
    """A many-file corpus: its manifest, whose file digests must digest to the corpus's, and every
    stored copy, there and of the size it had."""

    sha, url = t.get("data.raw_sha256"), t.get("data.raw_url")
    fields: dict[str, Any] = {
        "sha256": sha,
        "uri": url,
        "source": t.get("data.source"),
        "bytes": as_int(t.get("data.raw_bytes")),
        "files": as_int(t.get("data.raw_files")),
    }
    if not storage.exists(url):
        return make_link("corpus", MISSING, **fields, detail=f"the corpus manifest {url} is gone")
    doc = storage.read_json(url)
    listed = doc["files"]
    fields["files"] = len(listed)
    if files:
        fields["file_list"] = [{"source": f["source"], "sha256": f["sha256"], "bytes": f["bytes"]} for f in listed]
    if (again := corpus_digest([file_key(f["url"], f["sha256"]) for f in listed])) != sha:
        return make_link("corpus", CHANGED, **fields, detail=f"its files now digest to {again}")
    for f in listed:
        if not storage.exists(f["url"]):
            return make_link("corpus", MISSING, **fields, detail=f"the stored copy {f['url']} of {f['source']} is gone")
        size = storage.filesystem(f["url"])[0].size(storage.filesystem(f["url"])[1])
        if f.get("stored_bytes") is not None and size != f["stored_bytes"]:
            return make_link(
                "corpus", CHANGED, **fields, detail=f"the stored copy {f['url']} of {f['source']} changed size"
            )
    return make_link("corpus", OK, **fields)


def by_corpus(root: str, prefix: str) -> list[dict[str, Any]]:
    """The runs trained (or skipped) on every corpus whose sha256 starts with `prefix`, newest
    first, with the model version each made and its headline metric."""
    prefix = prefix.strip().lower()
    if re.fullmatch(r"[0-9a-f]{65,}", prefix):
        raise UserError(
            f"{prefix!r} has {len(prefix)} hex characters, a sha256 has 64: give the corpus's sha256 "
            "or its first characters (at least 4)"
        )
    if not re.fullmatch(r"[0-9a-f]{4,64}", prefix):
        raise UserError(f"{prefix!r} is no sha256 prefix: give at least 4 hex characters of the corpus's sha256")
    client = tracking.client(root)
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    if not experiments:
        return []
    runs = client.search_runs(
        list(experiments),
        f"tags.`data.raw_sha256` LIKE '{prefix}%'",
        order_by=["attributes.start_time DESC"],
        max_results=1000,
    )
    # A file of a many-file corpus: the corpora (manifests under the storage root) that hold it.
    holding = _corpora_holding(root, prefix)
    seen = {r.info.run_id for r in runs}
    for digest in holding:
        runs += [
            r
            for r in client.search_runs(list(experiments), f"tags.`data.raw_sha256` = '{digest}'", max_results=1000)
            if r.info.run_id not in seen
        ]
    runs.sort(key=lambda r: -r.info.start_time)
    rows = []
    for r in runs:
        t = r.data.tags
        version = None
        if t.get("model_version"):
            name, _, number = t["model_version"].rpartition("/")
            version = get_or_none(client.get_model_version, name, number)
        vt = version.tags if version is not None else {}
        rows.append(
            {
                "sha256": t["data.raw_sha256"],
                "source": t.get("data.source"),
                "run_id": r.info.run_id,
                "run_name": r.info.run_name,
                "recipe": experiments.get(r.info.experiment_id),
                "status": r.info.status,
                "decision": t.get("decision"),
                "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(r.info.start_time / 1000)),
                "model_version": t.get("model_version")
                or (
                    f"{experiments.get(r.info.experiment_id)}/{t['champion.version']} (champion, not retrained)"
                    if t.get("champion.version")
                    else None
                ),
                "aliases": list(version.aliases or []) if version is not None else [],
                "model_id": model_id(version) if version is not None else None,
                "headline": vt.get("headline"),
                "headline_value": as_float(vt.get("headline.value")),
                "holds_file": holding.get(t["data.raw_sha256"]),
            }
        )
    return clean(rows)


def _corpora_holding(root: str, prefix: str) -> dict[str, str]:
    """Corpus digest -> the file (source and sha256) whose digest starts with `prefix`, for every
    corpus manifest under `root/corpora`."""
    fs, path = storage.filesystem(layout.folder(root, layout.CORPORA))
    try:
        names = [p for p in fs.ls(path, detail=False) if not p.rsplit("/", 1)[-1].startswith(("seen-", "last-"))]
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        doc = storage.read_json(layout.folder(root, layout.CORPORA, name.rsplit("/", 1)[-1]))
        hit = next((f for f in doc.get("files", []) if f["sha256"].startswith(prefix)), None)
        if hit:
            found[doc["digest"]] = f"{hit['source']} (sha256 {hit['sha256'][:16]})"
    return found


def render_corpus(prefix: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"no run was trained on a corpus whose sha256 starts with {prefix}"
    out = []
    for sha in dict.fromkeys(r["sha256"] for r in rows):
        mine = [r for r in rows if r["sha256"] == sha]
        out.append(
            f"corpus sha256 {sha}"
            + (f"  {mine[0]['source']}" if mine[0].get("source") else "")
            + (f"\n  holds {mine[0]['holds_file']}" if mine[0].get("holds_file") else "")
        )
        for r in mine:
            metric = f"{r['headline']} {r['headline_value']:.4f}" if r.get("headline_value") is not None else "-"
            model = r.get("model_version") or "-"
            if r.get("aliases"):
                model += " @" + ", @".join(r["aliases"])
            out.append(
                f"  {r['started']}  run {r['run_id']}  {r['recipe']:16} {r['status']:9} "
                f"{r.get('decision') or '-':9} {model}  {metric}"
                + (f"  logged model {r['model_id']}" if r.get("model_id") else "")
            )
    return "\n".join(out)
