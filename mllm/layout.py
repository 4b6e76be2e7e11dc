"""Where each stage keeps its output under the storage root, and what its key is made of.

A stage's folder is `<root>/<stage>/<key>`: `tasks` write there and `flows.history` reads there,
both through this module. A key hashes the stage's inputs, its config and the source of the code
that does the work; that source is read as it was before the modules moved into `mllm/data` and
`mllm/runtime`, so that a move alone keeps every key and every stage already in storage.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from pathlib import Path, PurePosixPath
from typing import Any

import mllm
from mllm import storage

# The folder of each stage under the storage root (README's storage tree shows them).
RAW = "raw"
CORPORA = "corpora"
TOKENS = "tokens"
VOCAB = "vocab"
SPLITS = "splits"
SPLIT_PIECES = "splits/pieces"
NUMBERS = "numbers"
PAIRS = "pairs"
GENERATED = "generated"
RUNS = "runs"
TOKENIZERS = "tokenizers"  # a BPE tokenizer trained on a sample of a many-file corpus
REPRODUCTIONS = "reproductions"
TRACKING = "tracking"  # MLflow runs left unfinished while the tracking server was away
SWEEPS = "sweeps"
PREFECT_RESULTS = "prefect-results"


def folder(root: str, stage: str, *parts: str) -> str:
    """Where a stage keeps an output under the storage root: `folder(root, SPLITS, key)`."""
    return storage.join(root, stage, *parts)


# --- keys ----------------------------------------------------------------------------------------


@functools.cache
def code_digest(*objects: Any) -> str:
    """Digest of the source of the modules or classes a stage runs, and the package version."""
    h = hashlib.sha256(mllm.__version__.encode())
    for obj in objects:
        h.update(source_before_moves(inspect.getsource(obj)).encode())
    return h.hexdigest()[:16]


# No model runs these: what a stage's folder is called, and what kind of failure an exception is.
_NOT_MODEL_CODE = {"layout.py", "failures.py"}


# A module that is its docstring alone (a package's __init__.py, say). Matched as text: parsing it
# with `ast` here raced Prefect's own parsing in another thread of a flow run ("AST constructor
# recursion depth mismatch", a CPython 3.11 bug fixed in 3.12).
_DOCSTRING_ONLY = re.compile(r'\s*(?:"""|\'\'\')(?:(?!"""|\'\'\').)*(?:"""|\'\'\')\s*', re.S)


def _is_docstring_only(text: str) -> bool:
    return _DOCSTRING_ONLY.fullmatch(text) is not None


@functools.cache
def package_digest() -> str:
    """Digest of every source file of the `mllm` package and its version: what the training,
    evaluation and sample keys take, so that no change to the code a model runs (a batcher, a
    loader, a decoder) leaves a model made by other code looking current."""
    root = Path(mllm.__file__).parent
    files = []
    for path in root.rglob("*.py"):
        relative, text = path.relative_to(root).as_posix(), path.read_bytes().decode()
        if relative in _NOT_MODEL_CODE or _is_docstring_only(text):  # a package's __init__, say
            continue
        # Each file as it was named and written before the modules moved: a move is no change.
        previous = previous_path(relative)
        files.append((PurePosixPath(previous).parts, previous, source_before_moves(text)))
    h = hashlib.sha256(mllm.__version__.encode())
    for _, relative, text in sorted(files):
        h.update(relative.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def config_digest(cfg: Any) -> str:
    """The part of the training key that the model and training config make."""
    return storage.digest([cfg.model.model_dump(), cfg.train.model_dump()])


def train_key(splits_key: str, vocab_digest: str, cfg: Any, code_digest: str) -> str:
    """The training key from its parts (`lineage` recomputes it from what a run recorded).
    The model section holds the chosen family's fields only: another family's cannot change it."""
    return storage.digest(["train", splits_key, vocab_digest, cfg.model.model_dump(), cfg.train.model_dump(),
                           code_digest])


# Each moved module's name before the layout of November 2026. Only imports of these names were
# rewritten by that move, so writing them back gives the source each key was made from.
PREVIOUS_NAMES = {
    "mllm.runtime.epochs": "mllm.data",
    "mllm.data.corpus": "mllm.corpus",
    "mllm.data.files": "mllm.files",
    "mllm.data.text": "mllm.text",
    "mllm.data.fastbpe": "mllm.fastbpe",
    "mllm.data.gutenberg": "mllm.gutenberg",
    "mllm.data.tokens": "mllm.tokens",
    "mllm.data.packs": "mllm.packs",
    "mllm.data.vocab": "mllm.vocab",
    "mllm.data.splits": "mllm.splits",
    "mllm.runtime.inputs": "mllm.inputs",
    "mllm.runtime.checkpoint": "mllm.checkpoint",
    "mllm.runtime.speed": "mllm.speed",
    "mllm.runtime.compiling": "mllm.compiling",
    "mllm.runtime.devices": "mllm.models",
    "mllm.runtime.distributed": "mllm.distributed",
}
_FROM = re.compile(r"^(?P<ind>[ \t]*)from (?P<mod>[\w.]+) import (?P<names>[^\n#(]*?)(?P<comment>[ \t]*#[^\n]*)?$")


def previous_path(relative: str) -> str:
    """A file's path inside `mllm/` before the move (`data/text.py` -> `text.py`)."""
    module = "mllm." + relative.removesuffix(".py").replace("/", ".")
    return PREVIOUS_NAMES.get(module, module).removeprefix("mllm.").replace(".", "/") + ".py"


def source_before_moves(text: str) -> str:
    """The source with its imports of moved modules written as they were before the move.

    The move split `from mllm import UserError, speed, storage` into a line for `mllm` and one
    for `mllm.runtime`; the two are merged back, names sorted as they were."""
    out: list[str] = []
    for line in text.split("\n"):
        m = _FROM.match(line)
        if m and m["mod"] in PREVIOUS_NAMES:
            line = f"{m['ind']}from {PREVIOUS_NAMES[m['mod']]} import {m['names']}{m['comment'] or ''}"
        elif m and m["mod"] in ("mllm.data", "mllm.runtime"):
            back = []
            for name in (n.strip() for n in m["names"].split(",")):
                base, _, alias = name.partition(" as ")
                old = PREVIOUS_NAMES[f"{m['mod']}.{base}"].rpartition(".")[2]
                back.append(old if not alias or alias == old else f"{old} as {alias}")
            prev = _FROM.match(out[-1]) if out else None
            if prev and prev["mod"] == "mllm" and prev["ind"] == m["ind"]:
                merged = sorted([n.strip() for n in prev["names"].split(",")] + back)
                out[-1] = f"{prev['ind']}from mllm import {', '.join(merged)}{prev['comment'] or m['comment'] or ''}"
                continue
            line = f"{m['ind']}from mllm import {', '.join(back)}{m['comment'] or ''}"
        out.append(line)
    return "\n".join(out)
