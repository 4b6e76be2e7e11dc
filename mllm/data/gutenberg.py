"""Project Gutenberg's header and licence taken off a stream of text: every book's body in a file of one or several."""

from __future__ import annotations

import re
from typing import Generator, Iterable, Iterator

# Marker lines are short; bounding them lets the stream move on past a long line at once
# instead of waiting for its end to see whether it is a marker.
_START = re.compile(r"^\*\*\*[ \t]{0,8}START OF\b[^\n]{0,300}?\*\*\*[ \t\r]{0,8}(?:\n|\Z)", re.M)
_END = re.compile(r"^\*\*\*[ \t]{0,8}END OF\b[^\n]{0,300}?\*\*\*[ \t\r]{0,8}$", re.M)
_MARKER_MAX = 340  # longer than any line the two patterns match
# The START line of a Gutenberg book is near the top (the licence header is a few kB); text with
# no START line there is not a Gutenberg book and passes through unchanged, without our holding
# the whole corpus in memory looking for one.
_HEADER_CHARS = 100_000


def strip_gutenberg(chunks: Iterable[str]) -> Iterator[str]:
    """Keep only the books' text: drop each Project Gutenberg header (through its START line) and
    licence (from its END line up to the next book's START line).

    A file of several books one after the other keeps every book's body. Text with no START line
    near its top is not from Gutenberg and passes through unchanged; a book with no END line
    keeps everything after its START.
    """
    it = iter(chunks)
    head, scanned = "", 0
    for chunk in it:
        head += chunk
        start = _START.search(head, scanned)
        if start and start.group().endswith("\n") and start.start() < _HEADER_CHARS:
            break
        if len(head) >= _HEADER_CHARS + _MARKER_MAX:
            yield head
            yield from it
            return
        scanned = head.rfind("\n") + 1  # the complete lines have no START: skip them next time
    else:
        start = _START.search(head, scanned)  # the last line may be a START with no newline
        if not start or start.start() >= _HEADER_CHARS:
            if head:
                yield head
            return
    rest: str | None = head[start.end() :]
    while rest is not None:
        rest = yield from _through(_END, rest, it, keep=True)
        if rest is None:
            return
        # Licence and the next book's header: dropped up to its START line, if there is one.
        rest = yield from _through(_START, rest, it, keep=False)


def _find(marker: re.Pattern, buf: str, at_line_start: bool, endpos: int) -> re.Match | None:
    pos = 0 if at_line_start else buf.find("\n") + 1
    if pos == 0 and not at_line_start:
        return None
    return marker.search(buf, pos, endpos)


def _through(marker: re.Pattern, buf: str, it: Iterator[str], keep: bool) -> Generator[str, None, str | None]:
    """Pass on (keep) or drop the text up to the first `marker` line; return the text after that
    line, or None when the stream ended first. `buf` begins at the start of a line.

    Only complete lines are searched, and the last one is held back (it may be a marker still
    arriving), so memory stays at one chunk plus one marker line.
    """
    at_line_start = True
    while True:
        chunk = next(it, None)
        if chunk is None:
            found = _find(marker, buf, at_line_start, len(buf))
            if found:
                if keep and found.start():
                    yield buf[: found.start()]
                return buf[found.end() :]
            if keep and buf:
                yield buf
            return None
        buf += chunk
        cut = buf.rfind("\n") + 1
        found = _find(marker, buf, at_line_start, cut)
        if found:
            if keep and found.start():
                yield buf[: found.start()]
            return buf[found.end() :]
        if cut:
            at_line_start = True
        if len(buf) - cut > _MARKER_MAX:
            cut, at_line_start = len(buf), False  # too long to be a marker: let it go now
        if keep and cut:
            yield buf[:cut]
        buf = buf[cut:]
