"""A local corpus looked at before any stage starts: each file there and readable, and its head
read, so that a bad file is one line in seconds rather than a stage's failure half a minute in.

Kept apart from the stages' own modules (mllm/data/files.py, mllm/data/corpus.py), whose source is
in their storage keys: a check here changes no key, and no user's stage runs again for it."""

from __future__ import annotations

from typing import Any

from mllm import UserError
from mllm.data.corpus import TextDecoder, _decompressed, describe, open_source
from mllm.data.files import SourceFile, _record_text


def open_local(source: str) -> Any:
    """The opened file of a local source; a file this user may not read is one line."""
    try:
        return open_source(source)[2]
    except PermissionError as e:
        raise UserError(f"source file {describe(source)} cannot be read ({e.strerror}): check its permissions, "
                        "or leave it out of the source") from None


# How much of each file of a local corpus is read before any stage starts (`check_head`).
HEAD = 1 << 16


def check_head(f: SourceFile, text_field: str) -> None:
    """A look at a file's first HEAD bytes, before the download stage reads it all: a file gone or
    unreadable, bytes that are not text, an empty file, a JSONL line among them that is not a
    record with the field, a Parquet file that is not one. Each is the UserError that stage
    would raise, seconds earlier; what lies past the head is still that stage's to find."""
    if f.format == "parquet":
        src = open_local(f.url)
        with src:
            parquet = src.read(4)
        if parquet != b"PAR1":
            raise UserError(f"{f.url} is not a readable Parquet file (it does not start with PAR1): download it again")
        return
    src = open_local(f.url)
    with src:
        read, _ = _decompressed(f.url, lambda k: src.read(min(k, HEAD)))
        block = read(HEAD)
        whole = len(block) < HEAD or not read(1)
    if not block:
        raise UserError(f"{f.url} is empty: give a file with {'records' if f.format == 'jsonl' else 'text'} in it")
    text = TextDecoder(f.url).decode(block, final=whole)
    if f.format == "jsonl":
        lines = text.split("\n")
        for line_no, line in enumerate(lines if whole else lines[:-1], 1):  # (the last may be cut short)
            if line.strip():
                _record_text(f.url, line_no, line, text_field)
    elif whole and not text.strip():
        raise UserError(f"{f.url} {'is empty' if not text else 'holds no text, only white space'}: give a file "
                        "with text in it")
