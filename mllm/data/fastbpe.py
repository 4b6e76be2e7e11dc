"""A faster encoder for the byte-level BPE tokenizers mllm trains: tiktoken over the same merges,
checked against Hugging Face's ids on the first text, with Hugging Face as the fallback."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

# GPT-2's pre-tokenization (Hugging Face's ByteLevel with use_regex, tiktoken's r50k): contractions,
# letters, numbers, other symbols, each with an optional leading space; then whitespace.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order (GPT-2's table, read backwards)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _byte_level(hf_json: dict[str, Any]) -> bool:
    """Whether the tokenizer is the plain byte-level BPE of mllm.data.text.BpeTokenizer.train."""
    pre, model = hf_json.get("pre_tokenizer") or {}, hf_json.get("model") or {}
    return (
        model.get("type") == "BPE"
        and hf_json.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and not hf_json.get("added_tokens")
    )


class FastEncoder:
    """Ids of text pieces as Hugging Face's `encode_batch` gives them, by tiktoken where it agrees."""

    def __init__(self, hf: Any):
        self.hf = hf
        self.tiktoken: Any = None
        self.checked = False
        self.threads = len(os.sched_getaffinity(0))
        self._pool: Any = None
        try:
            import tiktoken
        except ImportError:
            return
        state = json.loads(hf.to_str())
        if not _byte_level(state):
            return
        to_byte = _unicode_to_byte()
        try:
            ranks = {bytes(to_byte[c] for c in piece): i for piece, i in hf.get_vocab().items()}
        except KeyError:  # a piece outside the byte-level alphabet
            return
        if len(ranks) != hf.get_vocab_size() or sorted(ranks.values()) != list(range(len(ranks))):
            return
        self.tiktoken = tiktoken.Encoding("mllm-bpe", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})

    def _hf(self, pieces: list[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips the offsets, which are not needed here.
        encode: Callable = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [np.asarray(e.ids, dtype=np.int32) for e in encode(pieces, add_special_tokens=False)]

    def _one(self, piece: str) -> np.ndarray:
        # encode_ordinary: no special tokens to look for (encode_to_numpy looks, and was 30% slower).
        return np.asarray(self.tiktoken.encode_ordinary(piece), dtype=np.int32)

    def encode(self, pieces: list[str]) -> list[np.ndarray]:
        if self.tiktoken is None:
            return self._hf(pieces)
        if len(pieces) > 1 and self.threads > 1:
            # A pool of our own, kept: tiktoken's batch call starts threads on every call, which
            # cost more than a 16 kB piece's encoding. The Rust side lets go of the GIL.
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mllm-bpe")
            fast = list(self._pool.map(self._one, pieces))
        else:
            fast = [self._one(p) for p in pieces]
        if not self.checked and pieces:
            self.checked = True
            if not np.array_equal(fast[0], self._hf(pieces[:1])[0]):
                log.warning("tiktoken's ids differ from Hugging Face's for this BPE: encoding with Hugging Face")
                self.tiktoken = None
                return self._hf(pieces)
        return fast
