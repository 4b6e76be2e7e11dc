"""Where each stage keeps its output under the storage root, and its key: the stage's inputs, config
and code, read as tokens so that moving or formatting a module changes no key."""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import re
import tokenize
from pathlib import Path
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

# What a key takes of a stage's code is its tokens, read with `tokenize` (pure Python: `ast`
# raced Prefect's own parsing in another thread of a flow run on CPython 3.11, "AST constructor
# recursion depth mismatch"), less what cannot change what the code does: comments, blank lines and
# line breaks, docstrings, import statements (the names they bind are still read where they are
# used, so a module that moves, or an import that is reordered, changes no key), a quote style and
# a trailing comma (so a formatter's pass changes none either).
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
_PLAIN_STRING = re.compile(r"^'([^'\"\\]*)'$")
_CLOSING = {")", "]", "}"}


def _logical_lines(text: str) -> list[list[tokenize.TokenInfo]]:
    lines: list[list[tokenize.TokenInfo]] = [[]]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _SKIP:
            continue
        lines[-1].append(tok)
        if tok.type == tokenize.NEWLINE:
            lines.append([])
    return [line for line in lines if line]


def code_tokens(text: str) -> str:
    """The source as the tokens that say what it does, one logical line a line (see above)."""
    out, marks = [], ""
    for line in _logical_lines(text):
        # The indentation a left-out line opened or closed is carried to the next line kept.
        marks += "".join({tokenize.INDENT: ">", tokenize.DEDENT: "<"}.get(t.type, "") for t in line)
        words = [t for t in line if t.type not in (tokenize.INDENT, tokenize.DEDENT)]
        if not words or words[0].type == tokenize.NEWLINE:
            continue
        first = words[0].string
        if first == "import" or (first == "from" and any(t.string == "import" for t in words)):
            continue  # an import statement
        if words[0].type == tokenize.STRING and len(words) == 2:
            continue  # a docstring, or a string standing alone
        kept = []
        for i, t in enumerate(words[:-1]):
            if t.string == "," and words[i + 1].string in _CLOSING:
                continue  # a trailing comma
            kept.append(_PLAIN_STRING.sub(r'"\1"', t.string) if t.type == tokenize.STRING else t.string)
        out.append(marks + " ".join(kept))
        marks = ""
    return "\n".join(out)


@functools.cache
def code_digest(*objects: Any) -> str:
    """Digest of the code of the modules or classes a stage runs (`code_tokens`), and the package
    version."""
    h = hashlib.sha256(mllm.__version__.encode())
    for obj in objects:
        h.update(code_tokens(inspect.getsource(obj)).encode() + b"\0")
    return h.hexdigest()[:16]


# No model runs these: what a stage's folder is called, and what kind of failure an exception is.
_NOT_MODEL_CODE = {"layout.py", "failures.py"}


@functools.cache
def package_digest() -> str:
    """Digest of the code of every module of the `mllm` package (`code_tokens`) and its version:
    what the training, evaluation and sample keys take, so that no change to the code a model runs
    (a batcher, a loader, a decoder) leaves a model made by other code looking current. The
    modules are taken in the order of their own digests, not by their paths: moving one is no
    change."""
    root = Path(mllm.__file__).parent
    digests = []
    for path in root.rglob("*.py"):
        if path.name in _NOT_MODEL_CODE and path.parent == root:
            continue
        tokens = code_tokens(path.read_bytes().decode())
        if tokens:  # a module that is its docstring alone (a package's __init__.py) adds nothing
            digests.append(hashlib.sha256(tokens.encode()).hexdigest())
    h = hashlib.sha256(mllm.__version__.encode())
    for digest in sorted(digests):
        h.update(digest.encode())
    return h.hexdigest()[:16]


def config_digest(cfg: Any) -> str:
    """The part of the training key that the model and training config make."""
    return storage.digest([cfg.model.model_dump(), cfg.train.model_dump()])


def train_key(
    splits_key: str, vocab_digest: str, cfg: Any, code_digest: str, cpu_env: dict[str, str] | None = None
) -> str:
    """The training key from its parts (`lineage` recomputes it from what a run recorded).
    The model section holds the chosen family's fields only: another family's cannot change it.
    `cpu_env`: the variables that change what the CPU computes with (mllm.runtime.machine.cpu_env):
    the precision train.dtype auto and Muon measure follows them, so a training under them is
    another training; without any, the key is what it always was."""
    parts = ["train", splits_key, vocab_digest, cfg.model.model_dump(), cfg.train.model_dump(), code_digest]
    return storage.digest(parts + [{"cpu_env": cpu_env}] if cpu_env else parts)
