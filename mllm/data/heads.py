"""A local corpus looked at before any stage starts, so that a bad file is one line in seconds; kept
apart from the stages' modules, so that its checks change no stage's key."""

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
        raise UserError(
            f"source file {describe(source)} cannot be read ({e.strerror}): check its permissions, "
            "or leave it out of the source"
        ) from None


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
        raise UserError(
            f"{f.url} {'is empty' if not text else 'holds no text, only white space'}: give a file with text in it"
        )


# Why an empty file of a many-file source was left out (the corpus manifest's `skipped` reason).
EMPTY = "an empty file"


def empty_files(found: list[SourceFile], bad_files: str, sources: list[str]) -> list[SourceFile]:
    """The files of a source of many that are empty (0 bytes as listed), to leave out under
    data.bad_files skip-empty (the default) or skip: an empty file holds no text to lose. Under
    fail they are refused, all named (the first ten past ten), as is a source whose files are all
    empty. A source of one file is left to the download, where an empty one is an error."""
    if len(found) < 2:
        return []
    empty = [f for f in found if f.size == 0]
    where = ", ".join(sources)
    if empty and len(empty) == len(found):
        raise UserError(f"all {len(found)} files of {where} are empty: give files with text in them")
    if empty and bad_files == "fail":
        names = ", ".join(f.name for f in empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise UserError(
            f"{len(empty)} of the {len(found)} files of {where} are empty: {names}; leave them out of "
            "the source, or drop data.bad_files=fail to skip empty files (the default)"
        )
    return empty
