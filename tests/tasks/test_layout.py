"""Every data stage's key, recorded: a change of any of them is a change every user's storage
pays for (its stages run again), so it must be on purpose. First recorded at commit 20f4bb3,
before the modules moved into mllm/data and mllm/runtime (storage made then was found, and
reused, after the move); recorded again when the char tokenizer began to count the characters
its normalisation drops (mllm/data/text.py, mllm/data/packs.py): tokenize and pairs run again
once, the vocabulary, split and route keys stayed.

A key hashes the source of the code that does the stage's work, so an edit of that code changes
the key on purpose and every user's stage runs again. Such a change fails here: record the new
keys in the same commit, and say in its message that the stage runs again.
"""

from __future__ import annotations

from mllm.config import DataConfig, SplitConfig, TokenizerConfig, VocabConfig
from mllm.layout import previous_path, source_before_moves
from tasks.data import RawText, Tokens, Vocabulary
from tasks.data.pairs import _pairs_key
from tasks.data.split import PackRows, _route_key, _split_key
from tasks.data.tokenize import _corpus_tokens_key, _tokens_key
from tasks.data.vocabulary import _vocab_key

RECORDED = {
    "corpus tokens basic_english": "8d8134bcd72156cc",
    "corpus tokens bpe": "c75deeef8884d13c",
    "corpus tokens char": "836b6f34a0496aff",
    "corpus tokens word": "c9ca887ce0d0c44c",
    "pairs": "e849726f16e96bea",
    "route": "18038ec01c93fd81",
    "split": "a797d45b88e44105",
    "tokens basic_english": "c72c0016741df7b0",
    "tokens bpe": "cf91f47eb2c8d12e",
    "tokens char": "e3218a39f20939cf",
    "tokens word": "f0c65fc26f0b75bf",
    "vocab": "589829a747382ffd",
}


def test_every_data_stage_key_is_the_one_recorded() -> None:
    raw = RawText(source="file:///corpus.txt", url="/s/raw/ab.txt", sha256="ab" * 32, bytes=1000)
    tokens = Tokens(key="t" * 16, url="/s/tokens/t", tokenizer="/s/tokens/t/tokenizer.json", n_tokens=900,
                    n_chunks=1, raw_sha256="ab" * 32)
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


def test_a_moved_modules_source_is_read_with_its_old_import_names() -> None:
    moved = ("from mllm import UserError, storage\n"
             "from mllm.runtime import speed\n"
             "from mllm.data.text import Tokenizer  # why\n"
             "from mllm.runtime.epochs import EpochOrder as Order\n")
    assert source_before_moves(moved) == ("from mllm import UserError, speed, storage\n"
                                          "from mllm.text import Tokenizer  # why\n"
                                          "from mllm.data import EpochOrder as Order\n")
    assert previous_path("data/text.py") == "text.py" and previous_path("runtime/epochs.py") == "data.py"
    assert previous_path("lm/gpt.py") == "lm/gpt.py"
