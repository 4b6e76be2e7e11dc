"""Object storage through fsspec: any URL (a local path, file://, s3://, https:// to read).

Writes are atomic: a reader never sees half a file. Local files are written to a temporary name
in the same folder and renamed; object stores publish an object only when its upload completes,
so they are written in place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mllm import UserError
from mllm.redact import strip_userinfo

# user:password taken out of URLs by `hide_credentials`, by the URL without them: held in this
# process's memory for the requests that need them, and never written anywhere.
_CREDENTIALS: dict[str, tuple[str, str]] = {}


def hide_credentials(url: str) -> str:
    """`url` without its user:password, which is kept in memory for `storage_options(url)`: the
    URL that goes on to logs, stage metadata, configs, checkpoints, MLflow and Prefect holds no
    secret, and the download still authenticates."""
    clean, auth = strip_userinfo(url)
    if auth is not None:
        _CREDENTIALS[clean] = auth
    return clean


def storage_options(url: str) -> dict[str, Any]:
    """Options for the filesystem behind `url`, from the environment (and from credentials that
    `hide_credentials` took out of it).

    For S3 the standard AWS variables are read by botocore itself; only the endpoint (MinIO, moto,
    any S3-compatible store) needs passing on.
    """
    protocol = fsspec.utils.get_protocol(url)
    auth = _CREDENTIALS.get(url)
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        options: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
        if auth:
            options.update(key=auth[0], secret=auth[1])
        return options
    if protocol in ("http", "https"):
        import aiohttp  # fsspec's http filesystem is built on aiohttp

        kwargs: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=None, connect=15, sock_read=60)}
        if auth:
            kwargs["auth"] = aiohttp.BasicAuth(*auth)
        return {"client_kwargs": kwargs}
    return {}


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path within it for `url`."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options(url))
    return fs, path


def join(root: str, *parts: str) -> str:
    root = str(root).rstrip("/")
    return "/".join([root, *[p.strip("/") for p in parts if p]])


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    fs.invalidate_cache(path)  # s3fs caches listings; another client may have written since
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    with fs.open(path, "rb") as f:
        return f.read()


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url))


@contextlib.contextmanager
def atomic_open(url: str, mode: str = "wb") -> Iterator[Any]:
    """Open `url` for writing so that it appears whole or not at all."""
    fs, path = filesystem(url)
    if not isinstance(fs, LocalFileSystem):
        with fs.open(path, mode) as f:
            yield f
        fs.invalidate_cache(path)
        return
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_bytes(url: str, data: bytes) -> None:
    with atomic_open(url, "wb") as f:
        f.write(data)


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode("utf-8"))


def write_json(url: str, obj: Any) -> None:
    write_text(url, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def remove(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.invalidate_cache(path)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(url: str) -> str:
    """The sha256 of a stored file, read in blocks."""
    fs, path = filesystem(url)
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def digest(obj: Any) -> str:
    """A short stable digest of any JSON-able object: names storage folders after their inputs."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def require(url: str, what: str) -> None:
    if not exists(url):
        raise UserError(f"{what} not found at {url}: check the path or URL")


# Exceptions (by class name: botocore and aiohttp are optional here) that mean the storage
# endpoint could not be reached or dropped the connection.
_UNREACHABLE = {"EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
                "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ConnectionRefusedError",
                "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError"}


def unreachable(exc: BaseException) -> str | None:
    """If `exc` (or what caused it) says the storage endpoint could not be reached, one line
    saying so and what to do; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if {c.__name__ for c in type(exc).__mro__} & _UNREACHABLE:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            where = f"the store at {endpoint}" if endpoint else "the storage endpoint"
            detail = " ".join(str(exc).split())[:200]
            return (f"storage unreachable ({type(exc).__name__}: {detail}): check that {where} is up and "
                    "reachable, then run the same command again (finished stages are reused)")
        exc = exc.__cause__ or exc.__context__
    return None


DONE = "_SUCCESS"


def is_complete(url: str) -> bool:
    """Whether a folder written with `staged_dir` was finished."""
    return exists(join(url, DONE))


@contextlib.contextmanager
def staged_dir(url: str) -> Iterator[str]:
    """Write a folder of outputs that readers see only once it is whole.

    Yields the URL to write into. A local folder is filled under a temporary name and renamed
    into place; on an object store the files go straight to `url`. Either way a `_SUCCESS`
    marker is written last, and only a folder with the marker counts as an output. On failure
    whatever was written is removed.
    """
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        parent, name = os.path.split(path.rstrip("/"))
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        os.makedirs(tmp)
        try:
            yield tmp
            with open(os.path.join(tmp, DONE), "w"):
                pass
            if os.path.isdir(path):  # an unfinished earlier attempt, or a concurrent twin
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return
    if fs.exists(path):
        fs.rm(path, recursive=True)
    try:
        yield url
        write_bytes(join(url, DONE), b"")
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(path, recursive=True)
        raise
    finally:
        fs.invalidate_cache(path)


@contextlib.contextmanager
def exclusive(url: str, on_wait: Any = None) -> Iterator[None]:
    """Hold the folder `url` for one process at a time: a second process that asks waits until
    the first lets go (its `on_wait` told once), then finds what the first left there.

    A local folder is held with an advisory lock on `url/.lock` (released by the kernel if the
    holder dies, so a killed run never leaves the folder locked). Object stores have no such
    lock: there two runs of the same training can still overlap.
    """
    fs, path = filesystem(url)
    if not isinstance(fs, LocalFileSystem):
        yield
        return
    import fcntl

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, ".lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_empty(url: str) -> None:
    """Remove a local folder that holds nothing (object stores have no empty folders)."""
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        with contextlib.suppress(OSError):
            os.rmdir(path)  # fails, as it should, on a folder with anything in it


def disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) says a disk is full: ENOSPC, a quota, SQLite's "database
    or disk is full" (torch's checkpoint writer wraps the OSError in a RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(exc) for t in ("No space left on device", "database or disk is full")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def full_disk_message(root: str) -> str:
    """One line for a full disk under the storage root, with the space left there."""
    space = ""
    fs, path = filesystem(root)
    if isinstance(fs, LocalFileSystem):
        folder = next((p for p in [path, *map(str, Path(path).parents)] if os.path.isdir(p)), "/")
        usage = shutil.disk_usage(folder)
        space = f" ({usage.free / 1e6:,.1f} MB free of {usage.total / 1e6:,.0f} MB)"
    return (f"storage root {root} is on a full disk{space}: free space there or give another --storage (or "
            "MLLM_STORAGE); finished stages and checkpoints are kept, and the same command goes on from them")


@contextlib.contextmanager
def room_on(root: str) -> Iterator[None]:
    """A full disk while the block runs ends it with `full_disk_message`, a UserError: no retry
    can make room."""
    try:
        yield
    except Exception as e:
        if disk_full(e):
            raise UserError(full_disk_message(root)) from None
        raise
