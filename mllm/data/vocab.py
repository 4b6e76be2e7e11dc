"""The vocabulary: token strings <-> ids (id 0 always <unk>), saved as JSON, never a pickle."""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mllm import UserError, storage

UNK = "<unk>"
FORMAT, VERSION = "mllm-vocab", 1


class Vocab:
    def __init__(self, tokens: list[str]):
        tokens = list(tokens)
        if not tokens or tokens[0] != UNK:
            raise ValueError(f"a vocabulary starts with {UNK}, got {tokens[:1]}")
        if any(not isinstance(t, str) for t in tokens):
            raise ValueError("vocabulary tokens must be strings")
        self.itos = tokens
        self.stoi = {t: i for i, t in enumerate(tokens)}
        if len(self.stoi) != len(tokens):
            dup = next(t for i, t in enumerate(tokens) if self.stoi[t] != i)
            raise ValueError(f"token {dup!r} appears twice in the vocabulary")
        self.unk_id = 0
        self._arrow = pa.array(tokens, type=pa.string())

    @classmethod
    def build(
        cls,
        counts: Mapping[str, int],
        min_freq: int = 1,
        max_size: int | None = None,
        specials: Iterable[str] = (),
        order: str = "frequency",
    ) -> "Vocab":
        """<unk>, then `specials`, then tokens seen at least `min_freq` times, most frequent first
        (`order="token"`: the same tokens, in token order).

        Ties go in token order, so the same counts always give the same ids. `max_size` counts
        every entry, <unk> and specials included, and keeps the most frequent in either order.
        """
        head = list(dict.fromkeys([UNK, *specials]))
        if max_size is not None and max_size < len(head):
            raise UserError(
                f"vocab.max_size {max_size} leaves no room for {', '.join(head)}: raise it to at least {len(head)}"
            )
        reserved = set(head)
        kept = sorted(
            ((t, c) for t, c in counts.items() if c >= min_freq and t not in reserved), key=lambda tc: (-tc[1], tc[0])
        )
        kept = kept if max_size is None else kept[: max(max_size - len(head), 0)]
        return cls(head + (sorted(t for t, _ in kept) if order == "token" else [t for t, _ in kept]))

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.itos == other.itos

    __hash__ = None

    def __repr__(self) -> str:
        return f"Vocab({len(self)} tokens, digest {self.digest[:12]})"

    def encode(self, tokens: list[str]) -> list[int]:
        get = self.stoi.get
        return [get(t, 0) for t in tokens]

    def encode_array(self, tokens: pa.Array | pa.ChunkedArray | list[str]) -> np.ndarray:
        """Ids of a whole column of tokens at once (Arrow's hash lookup, no Python loop)."""
        if isinstance(tokens, pa.ChunkedArray):
            parts = [self.encode_array(chunk) for chunk in tokens.chunks]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        if not isinstance(tokens, pa.Array):
            tokens = pa.array(tokens, type=pa.string())
        if pa.types.is_dictionary(tokens.type):
            # Look up each distinct token once, then spread the ids over the indices.
            ids = self.encode_array(tokens.dictionary)
            return ids[tokens.indices.to_numpy(zero_copy_only=False)]
        values = self._arrow if tokens.type == pa.string() else self._arrow.cast(tokens.type)
        ids = pc.fill_null(pc.index_in(tokens, value_set=values), self.unk_id)
        return np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> list[str]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = ids[(ids < 0) | (ids >= len(self))][0]
            raise ValueError(f"id {bad} is outside this vocabulary of {len(self)} tokens")
        itos = self.itos
        return [itos[i] for i in ids.tolist()]

    def missing(self, tokens: Iterable[str]) -> list[str]:
        """Distinct tokens this vocabulary lacks, in first-seen order (to tell the user)."""
        return list(dict.fromkeys(t for t in tokens if t not in self.stoi))

    # -------------------------------------------------------------------------
    # serialisation

    def to_json(self) -> str:
        """Canonical JSON: equal vocabularies give equal text, so it can be hashed."""
        state = {"format": FORMAT, "version": VERSION, "tokens": self.itos}
        return json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    @classmethod
    def from_json(cls, s: str | bytes, source: str = "vocabulary JSON") -> "Vocab":
        fix = "point to the vocab.json the vocabulary stage wrote, or build it again"
        try:
            state = json.loads(s)
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
            raise UserError(f"{source} is not JSON: {fix}") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise UserError(f"{source} is not an mllm vocabulary (no format: {FORMAT}): {fix}")
        if state.get("version") != VERSION:
            raise UserError(
                f"{source} has vocabulary format version {state.get('version')!r}, "
                f"this mllm reads version {VERSION}: upgrade mllm or build it again"
            )
        try:
            return cls(state.get("tokens"))
        except (ValueError, TypeError) as e:
            raise UserError(f"{source} is damaged ({e}): {fix}") from None

    def save(self, url: str) -> None:
        storage.write_text(url, self.to_json() + "\n")

    @classmethod
    def load(cls, url: str) -> "Vocab":
        try:
            data = storage.read_bytes(url)
        except FileNotFoundError:
            raise UserError(f"vocabulary not found at {url}: check the path or URL") from None
        return cls.from_json(data, source=url)
