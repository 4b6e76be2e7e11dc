"""Text in, tokens out: the char, word, BPE and basic_english tokenizers, streaming, the same tokens
for any chunking of the text (docs/tokenizers.md); read_chunks and strip_gutenberg re-exported."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from mllm import UserError
from mllm.config import TokenizerConfig
from mllm.data.corpus import read_chunks  # noqa: F401  (part of this module's API)
from mllm.data.gutenberg import strip_gutenberg  # noqa: F401  (part of this module's API)


def _last_match(pattern: re.Pattern, text: str, end: int | None = None) -> int:
    """Start of the last match of a one-character `pattern` in `text[:end]`, or -1."""
    end = len(text) if end is None else end
    # Natural text has a match near its end: look at the tail before scanning everything.
    for lo in (max(end - 4096, 0), 0):
        last = None
        for last in pattern.finditer(text, lo, end):  # noqa: B007 (the loop keeps the last match)
            pass
        if last:
            return last.start()
        if lo == 0:
            break
    return -1


class Tokenizer(ABC):
    """Text <-> token strings. The vocabulary (mllm.data.vocab) maps the strings to ids."""

    kind: str = ""

    def __init__(self, normalize: bool = True):
        self.normalize = normalize

    @abstractmethod
    def tokenize(self, chunks: Iterable[str]) -> Iterator[list[str]]:
        """Tokens of a stream of text, one list per piece of it, the same for any chunking."""

    def token_arrays(self, chunks: Iterable[str]) -> Iterator[pa.Array]:
        """The tokens as Arrow (dictionary of) string arrays, no Python object a token where it can."""
        for tokens in self.tokenize(chunks):
            yield pa.array(tokens, pa.string())

    @abstractmethod
    def split(self, text: str) -> list[str]:
        """Tokens of a prompt, normalised as the corpus was and nothing else dropped."""

    def detokenize(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def dropped(self, text: str) -> list[str]:
        """The characters of `text` normalisation drops outright (not a case or a run of spaces), once each."""
        return []

    def take_loss(self) -> tuple[int, dict[str, int]] | None:
        """(characters read, dropped by character) since the last call, or None where not measured."""
        return None

    def _state(self) -> dict:
        return {}

    def to_json(self) -> str:
        state = {
            "format": "mllm-tokenizer",
            "version": 1,
            "kind": self.kind,
            "normalize": self.normalize,
            **self._state(),
        }
        return json.dumps(state, sort_keys=True, ensure_ascii=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(normalize={self.normalize})"


# What the normalising char tokenizer keeps: ASCII, so a non-ASCII character's bytes go (docs/tokenizers.md).
_CHAR_KEPT = " !,-.0123456789;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CHAR_DROP = bytes(sorted(set(range(256)) - {ord(c) for c in _CHAR_KEPT + "\n"}))
_CHAR_NEWLINE_TO_SPACE = bytes.maketrans(b"\n", b" ")
_CHAR_KEPT_BYTES = _CHAR_KEPT.encode("ascii")
# The normalised token arrays' dictionary: a kept byte is its own index (readers count what occurs).
_ASCII = pa.array([chr(i) for i in range(128)], pa.string())


class CharTokenizer(Tokenizer):
    """One token per character; normalize=True keeps [A-Za-z0-9 \\-.;,\\n?!], folding space runs into one."""

    kind = "char"

    def __init__(self, normalize: bool = True):
        super().__init__(normalize)
        self._reset_loss()

    def _reset_loss(self) -> None:
        # Characters read, a histogram of bytes dropped outright, spaces read and made (runs fold).
        self._read, self._spaces_read, self._spaces_made = 0, 0, 0
        self._dropped = np.zeros(256, dtype=np.int64)

    def take_loss(self) -> tuple[int, dict[str, int]] | None:
        if not self.normalize:
            return None
        dropped = self._dropped
        lost = {chr(i): int(dropped[i]) for i in range(128) if dropped[i]}
        if (folded := self._spaces_read - self._spaces_made) > 0:  # newlines become spaces too
            lost[" "] = folded
        if beyond := int(dropped[0xC0:].sum()):
            lost["non-ASCII"] = beyond
        n_read = self._read
        self._reset_loss()
        return n_read, lost

    def _normalized(self, chunks: Iterable[str]) -> Iterator[np.ndarray]:
        """The normalised text of each chunk as ASCII bytes (uint8), empty pieces skipped."""
        space = False  # the last token so far was a space: a run may continue into this chunk
        for chunk in chunks:
            raw = chunk.encode("utf-8")
            self._read += len(chunk)
            # np.count_nonzero: bytes.count is 10x slower.
            self._spaces_read += int(np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) == 32))
            if dropped := raw.translate(None, _CHAR_KEPT_BYTES):
                self._dropped += np.bincount(np.frombuffer(dropped, dtype=np.uint8), minlength=256)
            b = np.frombuffer(raw.translate(_CHAR_NEWLINE_TO_SPACE, _CHAR_DROP), dtype=np.uint8)
            if not len(b):
                continue
            is_space = b == 32
            keep = np.empty(len(b), dtype=bool)
            keep[0] = not (space and is_space[0])
            np.logical_not(is_space[1:] & is_space[:-1], out=keep[1:])  # the first of each run stays
            b = b[keep]
            if len(b):
                space = bool(is_space[-1])
                self._spaces_made += int(np.count_nonzero(b == 32))
                yield b

    def tokenize(self, chunks):
        if not self.normalize:
            for chunk in chunks:
                if chunk:
                    yield list(chunk)
            return
        for b in self._normalized(chunks):
            yield list(b.tobytes().decode("ascii"))

    def token_arrays(self, chunks):
        if not self.normalize:
            for chunk in chunks:
                if chunk:
                    yield _utf8_characters(chunk)
            return
        for b in self._normalized(chunks):
            yield pa.DictionaryArray.from_arrays(pa.array(b.view(np.int8)), _ASCII)

    def split(self, text):
        # The corpus's own path: a prompt's ':' or newline becomes what it became in the corpus.
        return [t for piece in self.tokenize([text]) for t in piece]

    def dropped(self, text):
        if not self.normalize:
            return []
        return [c for c in dict.fromkeys(text) if c not in _CHAR_KEPT and c != "\n"]


def _utf8_characters(text: str) -> pa.Array:
    """Each character as a string: the UTF-8 bytes cut where a character starts (not at 0b10xxxxxx)."""
    data = text.encode("utf-8")
    b = np.frombuffer(data, dtype=np.uint8)
    starts = np.flatnonzero((b & 0xC0) != 0x80)
    offsets = np.empty(len(starts) + 1, dtype=np.int32)  # a chunk is far below 2 GB
    offsets[:-1] = starts
    offsets[-1] = len(b)
    return pa.Array.from_buffers(pa.string(), len(starts), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


class _CutTokenizer(Tokenizer):
    """Streams by cutting where no token straddles (`_cut`), carrying the rest to the next chunk."""

    @abstractmethod
    def _cut(self, text: str) -> int: ...

    @abstractmethod
    def _tokens(self, text: str) -> list[str]: ...

    def _pieces(self, chunks: Iterable[str]) -> Iterator[str]:
        carry = ""
        for chunk in chunks:
            text = carry + chunk
            cut = self._cut(text)
            carry = text[cut:]
            yield text[:cut]
        yield carry

    def tokenize(self, chunks):
        for piece in self._pieces(chunks):
            if tokens := self._tokens(piece):
                yield tokens

    def split(self, text):
        return self._tokens(text)


class WordTokenizer(_CutTokenizer):
    """Words and punctuation; normalize=True lower-cases and turns "<br />" into a space."""

    kind = "word"
    _TOKEN = re.compile(r"""['.,()!?";:]|[^\s'.,()!?";:]+""")
    _BR = re.compile(r"<br />", re.I)
    _SPACE = re.compile(r"\s")
    _NO_SPACE_BEFORE = re.compile(r" ([.,!?;:)])")

    def _tokens(self, text: str) -> list[str]:
        if self.normalize:
            text = self._BR.sub(" ", text).lower()
        return self._TOKEN.findall(text)

    def _cut(self, text: str) -> int:
        cut = _last_match(self._SPACE, text)
        # The space in "<br />" separates nothing: cut at the whitespace before that word instead.
        while self.normalize and cut >= 3 and text[cut - 3 : cut].lower() == "<br":
            cut = _last_match(self._SPACE, text, cut - 3)
        return max(cut, 0)

    def detokenize(self, tokens):
        text = " ".join(tokens)
        return self._NO_SPACE_BEFORE.sub(r"\1", text).replace("( ", "(")


class BpeTokenizer(_CutTokenizer):
    """Byte-level BPE (GPT-2 style) of Hugging Face `tokenizers`, trained on the corpus; tokens like "Ġthe"."""

    kind = "bpe"
    # GPT-2 pre-tokenization never joins a non-space to the space or newline after it: a safe cut.
    _SAFE_CUT = re.compile(r"(?<=\S)[ \n]")
    _PIECE = 1 << 16

    def __init__(self, hf, vocab_size: int, normalize: bool = True):
        super().__init__(normalize)
        self.hf = hf
        self.vocab_size = vocab_size
        self._itos = [""] * hf.get_vocab_size()
        for piece, i in hf.get_vocab().items():
            self._itos[i] = piece
        self._pieces_arrow = pa.array(self._itos, pa.string())
        self._encoder = None  # mllm.data.fastbpe.FastEncoder, made on first use

    @classmethod
    def train(cls, chunks: Iterable[str], vocab_size: int, normalize: bool = True) -> "BpeTokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        hf.train_from_iterator(chunks, trainer=trainer)
        return cls(hf, vocab_size, normalize)

    def _cut(self, text: str) -> int:
        return max(_last_match(self._SAFE_CUT, text), 0)

    def _ids(self, text: str) -> np.ndarray:
        pieces, i = [], 0
        while len(text) - i > self._PIECE:
            m = self._SAFE_CUT.search(text, i + self._PIECE)
            if not m:
                break
            pieces.append(text[i : m.start()])
            i = m.start()
        pieces.append(text[i:])
        if self._encoder is None:
            from mllm.data.fastbpe import FastEncoder

            self._encoder = FastEncoder(self.hf)
        ids = self._encoder.encode(pieces)
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)

    def _tokens(self, text: str) -> list[str]:
        itos = self._itos
        return [itos[i] for i in self._ids(text).tolist()]

    def token_arrays(self, chunks):
        for piece in self._pieces(chunks):
            ids = self._ids(piece)
            if len(ids):
                yield pa.DictionaryArray.from_arrays(pa.array(ids), self._pieces_arrow)

    def detokenize(self, tokens):
        return self.hf.decoder.decode(list(tokens))

    def _state(self):
        return {"bpe_vocab_size": self.vocab_size, "hf_tokenizer": json.loads(self.hf.to_str())}


# torchtext.data.utils._patterns / _replacements, in this order after lower-casing, then a split.
# fmt: off
_BASIC_ENGLISH = [(re.compile(p), r) for p, r in [
    (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "), (r"\(", " ( "),
    (r"\)", " ) "), (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "), (r"\:", " "), (r"\s+", " "),
]]
# fmt: on


def basic_english(text: str, lower: bool = True) -> list[str]:
    """torchtext's get_tokenizer("basic_english"), rule for rule."""
    if lower:
        text = text.lower()
    for pattern, replacement in _BASIC_ENGLISH:
        text = pattern.sub(replacement, text)
    return text.split()


def split_paragraphs(chunks: Iterable[str]) -> Iterator[str]:
    """Paragraphs of raw text (blocks of non-blank lines), the same for any chunking."""
    lines: list[str] = []
    carry = ""
    for chunk in chunks:
        text = carry + chunk
        # A chunk ending in "\r" may be half of a "\r\n": wait for the next one.
        end = max(text.rfind("\n"), text.rfind("\r", 0, len(text) - 1)) + 1
        carry = text[end:]
        # Only \n and \r end a line (str.splitlines would also split at form feeds and the like).
        for line in text[:end].replace("\r\n", "\n").replace("\r", "\n").split("\n")[:-1]:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "\n".join(lines)
                lines = []
    if carry.strip():
        lines.append(carry)
    if lines:
        yield "\n".join(lines)


class BasicEnglishTokenizer(Tokenizer):
    """basic_english, one token list per paragraph (CBOW's contexts do not cross them)."""

    kind = "basic_english"

    def tokenize(self, chunks):
        for paragraph in split_paragraphs(chunks):
            if tokens := basic_english(paragraph, self.normalize):
                yield tokens

    def split(self, text):
        return basic_english(text, self.normalize)

    def detokenize(self, tokens):
        return " ".join(tokens)


_KINDS = {"char": CharTokenizer, "word": WordTokenizer, "bpe": BpeTokenizer, "basic_english": BasicEnglishTokenizer}


def build_tokenizer(cfg: TokenizerConfig, training_chunks: Callable[[], Iterable[str]] | None = None) -> Tokenizer:
    """The tokenizer `cfg` describes; BPE is trained on the text `training_chunks()` streams."""
    if cfg.kind == "bpe":
        if training_chunks is None:
            raise ValueError("a BPE tokenizer needs training text: pass training_chunks")
        return BpeTokenizer.train(training_chunks(), cfg.bpe_vocab_size, cfg.normalize)
    return _KINDS[cfg.kind](normalize=cfg.normalize)


def tokenizer_from_json(s: str, source: str = "tokenizer JSON") -> Tokenizer:
    """The tokenizer that `Tokenizer.to_json` saved; anything else is a UserError."""
    fix = "point to the tokenizer.json the tokenize stage wrote, or tokenize again"
    try:
        state = json.loads(s)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
        raise UserError(f"{source} is not JSON: {fix}") from None
    if not isinstance(state, dict) or state.get("format") != "mllm-tokenizer":
        raise UserError(f"{source} is not an mllm tokenizer (no format: mllm-tokenizer): {fix}")
    if state.get("version") != 1:
        raise UserError(
            f"{source} has tokenizer format version {state.get('version')!r}, this "
            f"mllm reads version 1: upgrade mllm or tokenize again"
        )
    kind, normalize = state.get("kind"), state.get("normalize", True)
    if kind not in _KINDS or not isinstance(normalize, bool):
        raise UserError(f"{source} names an unknown tokenizer kind {kind!r}: {fix}")
    if kind != "bpe":
        return _KINDS[kind](normalize=normalize)
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(json.dumps(state["hf_tokenizer"]))
    except Exception:  # noqa: BLE001 (the Rust side raises its own exception type for any malformed field)
        raise UserError(f"{source} holds a damaged BPE tokenizer: {fix}") from None
    return BpeTokenizer(hf, int(state.get("bpe_vocab_size", hf.get_vocab_size())), normalize)
