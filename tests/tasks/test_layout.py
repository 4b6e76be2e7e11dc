"""Every data stage's key, recorded: a change of any of them is a change every user's storage
pays for (its stages run again), so it must be on purpose. Recorded again when the keys began to
read a stage's code as tokens without comments, docstrings, imports and layout (mllm/layout.py
`code_tokens`): every stage ran again once, and moving or formatting a module changes no key since.

A key hashes the code that does the stage's work, so an edit of what that code does changes the
key on purpose and every user's stage runs again. Such a change fails here: record the new keys
in the same commit, and say in its message that the stage runs again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mllm.config import DataConfig, SplitConfig, TokenizerConfig, VocabConfig
from tasks.data import RawText, Tokens, Vocabulary
from tasks.data.pairs import _pairs_key
from tasks.data.split import PackRows, _route_key, _split_key
from tasks.data.tokenize import _corpus_tokens_key, _tokens_key
from tasks.data.vocabulary import _vocab_key

ROOT = Path(__file__).resolve().parents[2]

RECORDED = {
    "corpus tokens basic_english": "55ec9af5a105faee",
    "corpus tokens bpe": "f5555a665eda62bd",
    "corpus tokens char": "7203fcc53174c3e4",
    "corpus tokens word": "f858349d854f1ebb",
    "pairs": "9f1bb7974cf36f9f",
    "route": "76214ac61d7f319a",
    "split": "9d401e1b18c4bc73",
    "tokens basic_english": "2d2a26c5838f6cce",
    "tokens bpe": "33b7ec5cfb585c0f",
    "tokens char": "d3a8636699250146",
    "tokens word": "c25422d90d6d2052",
    "vocab": "8ed804efc38e431f",
}


def test_every_data_stage_key_is_the_one_recorded() -> None:
    raw = RawText(source="file:///corpus.txt", url="/s/raw/ab.txt", sha256="ab" * 32, bytes=1000)
    tokens = Tokens(
        key="t" * 16,
        url="/s/tokens/t",
        tokenizer="/s/tokens/t/tokenizer.json",
        n_tokens=900,
        n_chunks=1,
        raw_sha256="ab" * 32,
    )
    vocab = Vocabulary(key="v" * 16, url="/s/vocab/v/vocab.json", digest="d" * 16, size=40)
    now = {}
    for kind in ("char", "word", "bpe", "basic_english"):
        now[f"tokens {kind}"] = _tokens_key(raw, TokenizerConfig(kind=kind), "/s")
        now[f"corpus tokens {kind}"] = _corpus_tokens_key(raw, TokenizerConfig(kind=kind), 4096, kind)
    now["vocab"] = _vocab_key(tokens, VocabConfig(), "/s")
    now["split"] = _split_key(tokens, vocab, SplitConfig(), "/s")
    now["route"] = _route_key(PackRows(url="/s/tokens/t/pack-p", files=None), vocab, "char", SplitConfig(), "/s")
    now["pairs"] = _pairs_key(raw, DataConfig(), 32, 32, "/s")
    assert now == RECORDED


KEYS = """
import json, types
from mllm import layout
from mllm.config import TokenizerConfig, VocabConfig
from mllm.resolve import resolve
from tasks.data import RawText, Tokens
from tasks.data.tokenize import _tokens_key
from tasks.data.vocabulary import _vocab_key
from tasks.model.train import train_key
raw = RawText(source="file:///c.txt", url="/s/raw/ab.txt", sha256="ab" * 32, bytes=10)
tokens = Tokens(key="t" * 16, url="/s/t", tokenizer="/s/t/tokenizer.json", n_tokens=9, n_chunks=1, raw_sha256="ab" * 32)
data = types.SimpleNamespace(splits=types.SimpleNamespace(key="s"), vocab=types.SimpleNamespace(digest="v"))
print(json.dumps({"tokens": _tokens_key(raw, TokenizerConfig(), "/s"), "vocab": _vocab_key(tokens, VocabConfig(), "/s"),
                  "train": train_key(resolve("smoke"), data), "package": layout.package_digest()}))
"""


def _keys(src: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", KEYS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=src,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_moving_a_module_and_formatting_the_code_change_no_key_and_an_edit_does(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for room in ("mllm", "tasks"):
        shutil.copytree(ROOT / room, src / room, ignore=shutil.ignore_patterns("__pycache__"))
    before = _keys(src)
    # The vocabulary module moves and is renamed, every import of it follows; a comment, a
    # docstring, line breaks, another quote style and a trailing comma are added to it.
    (src / "mllm" / "data" / "vocab.py").rename(src / "mllm" / "vocabulary_table.py")
    for path in src.rglob("*.py"):
        text = path.read_text()
        if "mllm.data.vocab" in text:
            path.write_text(text.replace("mllm.data.vocab", "mllm.vocabulary_table"))
    moved = src / "mllm" / "vocabulary_table.py"
    text = moved.read_text().replace('UNK = "<unk>"', "# the unknown token\nUNK = '<unk>'")
    text = text.replace(
        "        tokens = list(tokens)\n",
        '        """Say why."""\n        tokens = list(\n            tokens,\n        )\n',
        1,
    )
    moved.write_text(text)
    assert _keys(src) == before
    # An edit of what the code does changes the keys of the stages that run it.
    moved.write_text(text.replace("self.unk_id = 0", "self.unk_id = 0 * 1"))
    after = _keys(src)
    assert after["vocab"] != before["vocab"] and after["train"] != before["train"]
    assert after["tokens"] == before["tokens"]  # the tokenize stage does not run the vocabulary's code
