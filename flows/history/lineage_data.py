"""A model's chain, its data links: the split, the vocabulary, the token chunks and the corpus
(flows/history/lineage.py reads the rest), each checked against storage."""

from __future__ import annotations

from typing import Any

from flows.history.lineage_corpus import manifest_link, packs_link
from flows.history.links import CHANGED, MISSING, OK, UNRECORDED, make_link
from mllm import storage
from mllm.data.vocab import Vocab
from mllm.runtime.epochs import ids_digest, missing_piece


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


def split_link(t: dict[str, str]) -> dict[str, Any]:
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


def vocab_link(t: dict[str, str]) -> dict[str, Any]:
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


def tokens_link(t: dict[str, str]) -> dict[str, Any]:
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


def corpus_link(t: dict[str, str], files: bool = False) -> dict[str, Any]:
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
