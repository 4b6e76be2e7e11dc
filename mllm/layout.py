"""Where each stage keeps its output under the storage root, and what its key is made of.

A stage's folder is `<root>/<stage>/<key>`: `tasks` write there and `flows.history` reads there,
both through this module. A key hashes the stage's inputs, its config and the source of the code
that does the work; that source is read as it was before the modules moved into `mllm/data` and
`mllm/runtime`, so that a move alone keeps every key and every stage already in storage.
"""

from __future__ import annotations

import re

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
SWEEPS = "sweeps"
PREFECT_RESULTS = "prefect-results"


def stage_dir(root: str, stage: str, key: str | None = None) -> str:
    """The folder of one stage's output (or of the stage, without a key)."""
    return storage.join(root, stage, key) if key else storage.join(root, stage)


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
