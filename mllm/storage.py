"""Object storage through fsspec (a local path, file://, s3://, https:// to read), writes atomic: a
reader never sees half a file."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from mllm import UserError
from mllm.failures import disk_full, exception_chain, unreachable
from mllm.redact import strip_userinfo
from mllm.settings import settings

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
    auth = _CREDENTIALS.get(url) or next(
        (a for prefix, a in _CREDENTIALS.items() if url.startswith(prefix.rstrip("/") + "/")), None
    )
    if protocol in ("s3", "s3a"):
        endpoint = settings().s3_endpoint
        options: dict[str, Any] = {"config_kwargs": s3_timeouts()}
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
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


# Every S3 request gives up after MLLM_S3_CONNECT_TIMEOUT seconds (5) without a connection or
# MLLM_S3_READ_TIMEOUT (10) without a byte (mllm/settings.py), and is tried S3_ATTEMPTS times in all (botocore's standard retries; AWS_MAX_ATTEMPTS and
# AWS_RETRY_MODE, when set, win): a store that hangs fails a storage call in about
# attempts * READ_S seconds, as one that is down does; Prefect's retries of the stage come on
# top (README, "Object storage", gives the whole bound). The two timeouts are set higher for a
# store known to be slower, or, in the tests, lower to wait out a hung store in seconds.
S3_ATTEMPTS = 3
MIN_UPLOAD_BYTES_PER_S = 1 << 20


def attempts() -> int:
    return settings().aws_max_attempts or S3_ATTEMPTS


def transfer_deadline(nbytes: int) -> float:
    """Seconds an upload of `nbytes` may take in all: every attempt's timeouts, and a second
    per MiB (a store that takes less than 1 MiB/s on average counts as hung)."""
    s = settings()
    return attempts() * (s.s3_connect_timeout + s.s3_read_timeout) + nbytes / MIN_UPLOAD_BYTES_PER_S


def s3_timeouts() -> dict[str, Any]:
    """botocore's client config for S3 (JSON: Prefect saves it in its result-storage block)."""
    import botocore.handlers
    import s3fs

    # s3fs retries a timed-out request 5 times on top of botocore's attempts, and a read again
    # around that: 25 to 125 attempts, half an hour of silence on a hung store. botocore's
    # retries are the one layer.
    s3fs.S3FileSystem.retries = 1
    # botocore sends every upload with "Expect: 100-continue", and aiohttp waits for the
    # "100 Continue" with no timeout at all (its read timeout starts once the body is sent): a
    # store that hangs would hold any upload, Prefect's results included, for ever. Without
    # it the body goes at once and the read timeout applies. (Set before the first S3 client.)
    botocore.handlers.BUILTIN_HANDLERS[:] = [
        h for h in botocore.handlers.BUILTIN_HANDLERS if h[1] is not botocore.handlers.add_expect_header
    ]
    s = settings()
    config: dict[str, Any] = {"connect_timeout": s.s3_connect_timeout, "read_timeout": s.s3_read_timeout}
    if not (s.aws_max_attempts or s.aws_retry_mode):
        config["retries"] = {"mode": "standard", "max_attempts": S3_ATTEMPTS}
    return config


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
    if isinstance(fs, AsyncFileSystem):
        # Written here, then uploaded in one call with a deadline: aiohttp times out a silent
        # read, never a body that a hung store stops taking (nor the wait for its 100-continue).
        with tempfile.TemporaryDirectory(prefix="mllm-upload-") as tmp:
            local = os.path.join(tmp, "part")
            with open(local, mode) as f:
                yield f
            fs.put_file(local, path, timeout=transfer_deadline(os.path.getsize(local)))
        fs.invalidate_cache(path)
        return
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


def _code(exc: BaseException) -> str:
    """botocore's error code (NoSuchBucket, AccessDenied, ...), or ""."""
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


# What an object store answers about its credentials: none found, not accepted, not allowed.
_REFUSED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId"}
_DENIED = {"AccessDenied", "Forbidden", "403", "AllAccessDisabled"}


def credentials_problem(exc: BaseException, url: str) -> str | None:
    """If `exc` (or what caused it) says the credentials for `url` are missing, refused or not
    allowed there, one line saying so and where they were read from; else None."""
    for e in exception_chain(exc):
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return (
                f"no credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                "naming a profile of ~/.aws/credentials (botocore reads them from there)"
            )
        if (code := _code(e)) in _REFUSED | _DENIED:
            what = "were refused" if code in _REFUSED else "may not do this"
            return (
                f"the credentials for {url} {what} ({code}: {_detail(e)}): they were read from "
                f"{_credentials_source(url)}; fix them there, or give ones allowed to use {url}"
            )
    return None


def _detail(exc: BaseException) -> str:
    error = getattr(exc, "response", {}).get("Error", {})
    return " ".join(str(error.get("Message") or exc).split())[:160]


def _credentials_source(url: str) -> str:
    if url in _CREDENTIALS:
        return "the user:password in the URL"
    import botocore.session

    method = getattr(botocore.session.Session().get_credentials(), "method", None)
    return {
        "env": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment",
        "shared-credentials-file": "~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE)",
        "config-file": "~/.aws/config (AWS_CONFIG_FILE, AWS_PROFILE)",
    }.get(method, f"botocore's {method} provider")


def check_writable(root: str, fix: str) -> None:
    """Write and remove a small object under an object-store `root`: a missing bucket, missing or
    refused credentials and an unreachable store each end here in one UserError, before any
    stage runs and before anything is made (a later write through Prefect would create the
    bucket). `fix` says how to choose another root."""
    fs, path = filesystem(root)
    probe = f"{path}/.mllm-write-test-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(probe, b"", timeout=transfer_deadline(0))
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 (whatever the store raised is judged below)
        message = credentials_problem(e, root) or unreachable(e)
        if message is None and any(_code(x) == "NoSuchBucket" for x in exception_chain(e)):
            message = f"bucket {path.split('/')[0]} does not exist: create it or {fix}"
        if message is None:
            message = f"storage root {root} cannot be written ({type(e).__name__}: {_detail(e)}): {fix}"
        raise UserError(message) from None


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


def full_disk_message(root: str) -> str:
    """One line for a full disk under the storage root, with the space left there."""
    space = ""
    fs, path = filesystem(root)
    if isinstance(fs, LocalFileSystem):
        folder = next((p for p in [path, *map(str, Path(path).parents)] if os.path.isdir(p)), "/")
        usage = shutil.disk_usage(folder)
        space = f" ({usage.free / 1e6:,.1f} MB free of {usage.total / 1e6:,.0f} MB)"
    return (
        f"storage root {root} is on a full disk{space}: free space there or give another --storage (or "
        "MLLM_STORAGE); finished stages and checkpoints are kept, and the same command goes on from them"
    )


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
