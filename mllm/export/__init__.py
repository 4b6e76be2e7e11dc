"""Export a checkpoint to a format other runtimes load: `hf` (transformers), `onnx` (onnxruntime) or
`gguf` (llama.cpp), each family saying which function writes which (`python -m mllm.export`)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from mllm import UserError, storage
from mllm.export.pieces import FORMATS
from mllm.families.base import family_of
from mllm.redact import scrub

# The libraries each format needs (the `export` extra), to name in an error and record beside the export.
LIBRARIES = {"hf": ("transformers", "safetensors", "tokenizers"), "onnx": ("onnx", "onnxruntime"), "gguf": ("gguf",)}

VOCAB = "mllm-vocab.json"  # the mllm vocabulary, beside every export
MANIFEST = "mllm-export.json"  # what was exported, with which libraries, from which model and run


def library_versions(fmt: str) -> dict[str, str]:
    """The installed version of torch and of each library the format needs."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", *LIBRARIES[fmt]):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            raise UserError(
                f"--format {fmt} needs {name}, which is not installed: pip install 'mllm-pipeline[export]'"
            ) from None
    return out


def exporter(model_config: Any, fmt: str):
    """The function that writes `fmt` for this model section (its family says which); a
    UserError when none does."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    by_format = family_of(model_config).exports(model_config)
    if fmt not in by_format:
        takers = ", ".join(by_format) or "none"
        raise UserError(
            f"model.arch {getattr(model_config, 'arch', '?')} has no {fmt} export (it exports to "
            f"{takers}): choose --format {next(iter(by_format), 'onnx')}"
        )
    library_versions(fmt)
    module, func = by_format[fmt].split(":")
    return getattr(importlib.import_module(f"mllm.export.{module}"), func)


def _check_out(out: str) -> None:
    fs, path = storage.filesystem(out)
    if fs.exists(path) and (not fs.isdir(path) or fs.ls(path)):
        raise UserError(f"--out {storage.hide_credentials(out)} already holds files: give a new or empty folder")


def export(loaded: Any, fmt: str, out: str, card: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `loaded` (a mllm.runtime.checkpoint.Loaded) as `fmt` into the folder `out` (a path
    or URL), whole or not at all. `card`: lineage for the model card (corpus sha256, run...).
    Returns what it wrote into MANIFEST beside the files: {"format", "files", "libraries", ...card}."""
    write = exporter(loaded.config.model, fmt)
    _check_out(out)
    loaded.model.float().eval()
    with tempfile.TemporaryDirectory(prefix="mllm-export-") as tmp:
        files = write(loaded, tmp, dict(card or {}))
        with open(os.path.join(tmp, VOCAB), "w", encoding="utf-8") as f:
            f.write(loaded.vocab.to_json() + "\n")  # the mllm vocabulary the ids come from
        files = sorted({*files, VOCAB, MANIFEST})
        manifest = scrub(
            {
                "format": fmt,
                "libraries": library_versions(fmt),
                "files": files,
                "step": loaded.step,
                "vocab_sha256": loaded.vocab.digest,
                **(card or {}),
            }
        )
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        fs, _ = storage.filesystem(out)
        with storage.staged_dir(out) as dest:
            for name in files:
                src = os.path.join(tmp, name)
                if isinstance(fs, LocalFileSystem):
                    shutil.copy(src, os.path.join(dest, name))
                else:
                    fs.put(src, storage.filesystem(storage.join(dest, name))[1])
    return manifest
