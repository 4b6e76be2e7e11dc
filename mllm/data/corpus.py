"""A corpus source: opened, checked to be text by one decoder for the download and every later read,
copied into storage as UTF-8 and read back as a stream of text."""

from __future__ import annotations

import bz2
import codecs
import contextlib
import errno
import gzip
import hashlib
import io
import lzma
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from mllm import UserError, storage
from mllm.storage import filesystem

BLOCK = 1 << 20

# UTF-32 first: its little-endian BOM begins with UTF-16's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_BOM_MAX = 4


class SourceUnreachable(UserError):
    """The source could not be read for a reason that may pass (network): worth a retry."""

    transient = True


class SourceServerError(SourceUnreachable):
    """The source's server answered with an error of its own (HTTP 5xx, 429): it may pass."""


def describe(source: str) -> str:
    """How to name a source to the user: a URL as given, a path made absolute."""
    return source if "://" in source else os.path.abspath(source)


def open_source(source: str) -> tuple[Any, str, Any]:
    """Open a corpus for reading: (filesystem, path, binary file). A missing file or a folder is
    a UserError; a network failure is SourceUnreachable, which a caller may retry."""
    if not source:
        raise UserError("no data source: pass --source URL (a path, file://, s3:// or https://)")
    local = source.removeprefix("file://") if "://" not in source or source.startswith("file://") else None
    if local is not None:
        _check_link_loop(source, local)
    if "://" not in source:
        if os.path.isdir(source):
            raise UserError(
                f"source {describe(source)} is a folder: give the text file in it, e.g. --source path/to/book.txt"
            )
        if not os.path.isfile(source):
            raise UserError(f"source file {describe(source)} not found: check the path")
    try:
        fs, path = storage.filesystem(source)
        # (HTTP has no folders: isdir there would fetch and parse the page.)
        if not source.startswith(("http://", "https://")) and fs.isdir(path):
            raise UserError(f"source {source} is a folder: give the URL of a text file in it")
        return fs, path, fs.open(path, "rb")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (what it was is told below)
        # fsspec's HTTP filesystem reports a refused connection or a failed DNS lookup as
        # FileNotFoundError too; its cause tells them from a real 404.
        cause = e.__cause__ if isinstance(e, FileNotFoundError) else e
        status = getattr(cause, "status", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            # The server is there but failing: that may pass, as a cut connection may.
            raise SourceServerError(
                f"the server of {source} answered HTTP {status} ({short(cause)}): a server "
                "error, not a missing file; try again later or pass a local copy with --source"
            ) from None
        if isinstance(e, FileNotFoundError) and (cause is None or _is_http_status(cause)):
            raise UserError(f"source {source} not found: check the URL or path") from None
        if credentials := storage.credentials_problem(e, source):
            raise UserError(credentials) from None  # no retry or local copy mends it
        raise SourceUnreachable(
            f"cannot download {source} ({short(cause)}): pass a local copy with "
            "--source path/to/file.txt (make run SOURCE=path/to/file.txt)"
        ) from None


class TextDecoder:
    """Bytes of a text file to str, fed in blocks of any size, checking as it goes.

    The encoding is decided by the first bytes: a BOM names it (and is dropped), no BOM means
    UTF-8. Decoding is strict: a byte that does not belong is a UserError naming its offset in
    the file, never a replacement character in the corpus.
    """

    def __init__(self, name: str):
        self.name = name
        self.encoding: str | None = None  # known once the first bytes are in
        self.bom = 0
        self._head = b""
        self._decoder: Any = None
        self._offset = 0  # bytes handed to the decoder so far, to say where a bad byte is

    def decode(self, block: bytes, final: bool = False) -> str:
        if self._decoder is None:
            self._head += block
            if len(self._head) < _BOM_MAX and not final:
                return ""
            block, self._head = self._head, b""
            self.encoding = "utf-8"
            for bom, encoding in _BOMS:
                if block.startswith(bom):
                    self.encoding, self.bom, block = encoding, len(bom), block[len(bom) :]
                    break
            self._decoder = codecs.getincrementaldecoder(self.encoding)("strict")
        if self.encoding == "utf-8" and b"\x00" in block:
            raise UserError(self._nul_message(block))
        pending = len(self._decoder.getstate()[0])
        try:
            text = self._decoder.decode(block, final)
        except UnicodeDecodeError as e:
            where = self.bom + self._offset - pending + e.start
            if final and e.end >= len(e.object) and e.reason.startswith(("unexpected end", "truncated")):
                raise UserError(
                    f"{self.name} ends in the middle of a character: the file is truncated, download it again"
                ) from None
            if self.encoding != "utf-8":
                raise UserError(
                    f"{self.name} is not valid {self.encoding.upper()} text (its byte order mark "
                    f"says so; bad data at offset {where}): convert it to UTF-8 first"
                ) from None
            raise UserError(
                f"{self.name} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {where}): "
                "convert it, e.g. iconv -f latin1 -t utf-8 in.txt > out.txt"
            ) from None
        self._offset += len(block)
        if "\x00" in text:
            raise UserError(f"{self.name} looks binary (it holds NUL characters): give a plain-text file")
        return text

    @property
    def source_encoding(self) -> str:
        """The file's encoding as found: utf-8, utf-8-sig (with a BOM), utf-16-le, ..."""
        if self.encoding == "utf-8" and self.bom:
            return "utf-8-sig"
        return self.encoding or "utf-8"

    def _nul_message(self, block: bytes) -> str:
        # ASCII text in UTF-16 without a BOM: every other byte is NUL, the odd ones in little
        # endian, the even ones in big endian.
        sample = block[: 1 << 16]
        half = len(sample) // 2
        even, odd = sample[0::2].count(0), sample[1::2].count(0)
        if (self.bom + self._offset) % 2:  # this block starts at an odd offset in the file
            even, odd = odd, even
        if half >= 2 and max(even, odd) >= 0.4 * half and min(even, odd) <= 0.05 * half:
            enc = "utf-16le" if odd > even else "utf-16be"
            return (
                f"{self.name} looks like UTF-16 text without a byte order mark (NUL every other byte): "
                f"convert it, e.g. iconv -f {enc} -t utf-8 in.txt > out.txt"
            )
        return f"{self.name} looks binary (it holds NUL bytes): give a plain-text file"


@dataclass
class Downloaded:
    source: str
    url: str  # where the UTF-8 copy now is
    sha256: str  # of the source's own bytes (what sha256sum prints for it)
    bytes: int  # of the source
    encoding: str  # the source's: utf-8, or the one its byte order mark named (utf-8-sig, utf-16-le, ...)
    compression: str | None = None  # gzip, bzip2, xz or zstd: the source was decompressed
    repaired: bool = False  # the stored copy had changed since it was written, and was written again

    @property
    def converted(self) -> bool:
        return self.encoding != "utf-8" or self.compression is not None


def download(
    source: str,
    dest: Callable[[str], str] | None,
    sha256: str | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> Downloaded:
    """Copy `source` to `dest(sha256)` as UTF-8 text, after checking all of it.

    `sha256` pins the source: the digest of its bytes exactly as they are at the source (what
    `sha256sum file` prints), before any decompression or conversion, so a user can compute it
    without mllm. The copy is named after that same digest. A gzip, bzip2, xz or zstd file is
    decompressed as it is read; a UTF-16 or UTF-32 file (with a byte order mark) is stored
    converted to UTF-8, and a UTF-8 BOM is dropped: every later stage reads plain UTF-8. Nothing
    is written to `dest` unless the whole source passed the checks; with no `dest` the source is
    only checked (the CLI does so for a local file before any stage starts).
    """
    fs, path, src = open_source(source)
    size = _size(fs, path)
    digest = hashlib.sha256()
    decoder = TextDecoder(source)
    n = 0

    def raw_read(k: int) -> bytes:
        # The source's own bytes: digested, counted and reported as they arrive.
        nonlocal n
        try:
            block = src.read(k)
        except Exception as e:  # noqa: BLE001 (any reader's failure mid-stream: the download broke off)
            raise SourceUnreachable(f"download of {source} broke off ({short(e)}): try again") from None
        digest.update(block)
        n += len(block)
        if progress and block:
            progress(n, size)
        return block

    text_seen = chars = False  # any text after a BOM; any but white space
    tmp = tempfile.NamedTemporaryFile(prefix="mllm-download-", suffix=".txt", delete=False) if dest else None
    stored = hashlib.sha256()  # of the UTF-8 copy: a stored copy found under the name must hold it
    try:
        with src, tmp or contextlib.nullcontext():
            read, compression = _decompressed(source, raw_read)
            while True:
                block = read(BLOCK)
                text = decoder.decode(block, final=not block)
                text_seen, chars = text_seen or bool(text), chars or bool(text.strip())
                if tmp:  # strictly decoded UTF-8 encodes back to the same bytes; anything else is converted
                    encoded = text.encode("utf-8")
                    stored.update(encoded)
                    tmp.write(encoded)
                if not block:
                    break
        if n == 0 or not text_seen:  # (a byte order mark alone is no text)
            raise UserError(f"{source} is empty: give a file with text in it")
        if not chars:
            raise UserError(f"{source} holds no text, only white space: give a file with text in it")
        sha = digest.hexdigest()
        if sha256 and sha != sha256:
            raise UserError(
                f"{source} has sha256 {sha}, not the pinned {sha256}: the source changed; "
                "update data.sha256 or remove it"
            )
        url = dest(sha) if dest else ""
        # A copy already there is trusted only if it holds these bytes: one changed in storage
        # (by hand, by a broken disk) is written again.
        repaired = bool(tmp) and storage.exists(url) and storage.sha256_file(url) != stored.hexdigest()
        if tmp and (repaired or not storage.exists(url)):
            with open(tmp.name, "rb") as f, storage.atomic_open(url) as out:
                shutil.copyfileobj(f, out, BLOCK)
        return Downloaded(
            source=describe(source),
            url=url,
            sha256=sha,
            bytes=n,
            encoding=decoder.source_encoding,
            compression=compression,
            repaired=repaired,
        )
    finally:
        if tmp and os.path.exists(tmp.name):
            os.remove(tmp.name)


# The compressions corpora come in, by their first bytes, and the command that undoes each.
_COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", "gunzip"),
    (b"BZh", "bzip2", "bunzip2"),
    (b"\xfd7zXZ\x00", "xz", "unxz"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
)


class _Chained(io.RawIOBase):
    """A read-only stream: `head`, then whatever `more(k)` returns."""

    def __init__(self, head: bytes, more: Callable[[int], bytes]):
        self._head, self._more = head, more

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._head[: len(b)] if self._head else self._more(len(b))
        self._head = self._head[len(data) :] if self._head else b""
        b[: len(data)] = data
        return len(data)


def _decompressed(source: str, raw_read: Callable[[int], bytes]) -> tuple[Callable[[int], bytes], str | None]:
    """A reader of the source's content, decompressed when its first bytes name a compression,
    and that compression's name."""
    head = raw_read(BLOCK)
    found = next(((name, undo) for magic, name, undo in _COMPRESSIONS if head.startswith(magic)), None)
    if found is None:
        pending = [head]
        return (lambda k: pending.pop() if pending else raw_read(k)), None
    name, undo = found
    raw = io.BufferedReader(_Chained(head, raw_read), BLOCK)
    if name == "gzip":
        stream: Any = gzip.GzipFile(fileobj=raw)
    elif name == "bzip2":
        stream = bz2.BZ2File(raw)
    elif name == "xz":
        stream = lzma.LZMAFile(raw)
    else:
        import pyarrow as pa

        stream = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")

    def read(k: int) -> bytes:
        try:
            return bytes(stream.read(k))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 (each decompressor has its own errors)
            raise UserError(
                f"{source} is {name}-compressed but does not decompress ({short(e)}): download it "
                f"again, or check it with `{undo} -t`"
            ) from None

    return read, name


def _size(fs: Any, path: str) -> int | None:
    try:
        return int(fs.size(path))
    except Exception:  # noqa: BLE001 (a server that does not say; progress then just counts)
        return None


def _check_link_loop(source: str, path: str) -> None:
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(
                f"source {describe(source)} is a symbolic link loop (a link that leads back to itself): "
                "point it, or --source, at the file"
            ) from None


def _is_http_status(e: BaseException) -> bool:
    """An answer from the server (404, 403, ...), as opposed to no answer at all."""
    return type(e).__name__ == "ClientResponseError" or getattr(e, "status", None) is not None


def short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:200]


# -----------------------------------------------------------------------------
# reading


def read_chunks(url: str, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """Stream the text at `url` as str chunks of about `chunk_chars`, with universal newlines.

    The bytes are checked as the download checked them (mllm.data.corpus.TextDecoder): a byte order
    mark chooses the encoding and is dropped, and anything that is not text is a UserError.
    """
    fs, path = filesystem(url)
    decoder = TextDecoder(url)
    cr = False  # a chunk ended in "\r": it may be the first half of a "\r\n"
    try:
        f = fs.open(path, "rb")
    except (FileNotFoundError, IsADirectoryError):
        raise UserError(f"no text file at {url}: check the path or URL") from None
    with f:
        while True:
            data = f.read(chunk_chars)
            final = not data
            text = decoder.decode(data, final)
            if cr:
                text = "\r" + text
            cr = not final and text.endswith("\r")
            if cr:
                text = text[:-1]
            if "\r" in text:  # most texts have none: two copies of each chunk saved
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            if text:
                yield text
            if final:
                return
