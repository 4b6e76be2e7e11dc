"""What kind of failure an exception is (storage unreachable, disk full, I/O, a server's passing
failure, no answer): the one list every layer asks."""

from __future__ import annotations

import errno
from typing import Iterator

from mllm.settings import settings


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and what caused it, in turn."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


# --- storage ---------------------------------------------------------------------------------


# Exceptions (by class name: botocore and aiohttp are optional here) that mean the storage
# endpoint could not be reached or dropped the connection.
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ConnectionRefusedError",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "FSTimeoutError",
}


def unreachable(exc: BaseException) -> str | None:
    """If `exc` (or what caused it) says the storage endpoint could not be reached, one line
    saying so and what to do; else None. httpx's errors are not storage's (fsspec reaches its
    stores through aiohttp and botocore): there the orchestrator's client met no server."""
    if any(type(e).__module__.split(".")[0] in ("httpx", "httpcore") for e in exception_chain(exc)):
        return None
    for e in exception_chain(exc):
        if {c.__name__ for c in type(e).__mro__} & _UNREACHABLE:
            endpoint = settings().s3_endpoint
            where = f"the store at {endpoint}" if endpoint else "the storage endpoint"
            detail = " ".join(str(e).split())[:200] or "no answer in time"
            return (
                f"storage unreachable ({type(e).__name__}: {detail}): check that {where} is up and "
                "reachable, then run the same command again (finished stages are reused)"
            )
    return None


def disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) says a disk is full: ENOSPC, a quota, SQLite's "database
    or disk is full" (torch's checkpoint writer wraps the OSError in a RuntimeError)."""
    for e in exception_chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e) for t in ("No space left on device", "database or disk is full")):
            return True
    return False


# Libraries whose exceptions all mean the storage or the network failed.
_IO_MODULES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3", "requests"}


def io_failure(exc: BaseException) -> bool:
    """Whether `exc` itself is storage or the network failing: an OSError, a time-out, or any
    error of the libraries that reach object stores and servers."""
    return isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.split(".")[0] in _IO_MODULES


# --- servers (Prefect's and MLflow's) --------------------------------------------------------


# Exceptions that mean nothing answered (urllib3's, requests', the stdlib's), by name: MLflow
# wraps them in an MlflowException whose message names the server.
_NO_ANSWER = {
    "ConnectionError",
    "MaxRetryError",
    "NewConnectionError",
    "ConnectTimeout",
    "ReadTimeout",
    "ConnectionRefusedError",
    "RemoteDisconnected",
    "ProtocolError",
    "TimeoutError",
}
_NO_ANSWER_TEXT = ("Max retries exceeded", "Connection refused", "Connection aborted", "timed out")


# A server's own failure, as Prefect's client (httpx) and MLflow's (its retries of 5xx) report it.
_SERVER_ERROR_TEXT = (
    "500 Internal Server Error",
    "503 Service Unavailable",
    "500 error responses",
    "503 error responses",
)


def server_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is a 5xx answer of a server."""
    for e in exception_chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if (isinstance(status, int) and status >= 500) or any(t in str(e) for t in _SERVER_ERROR_TEXT):
            return True
    return False


# What a retry may mend: a server that is busy, restarting or overloaded (its proxy's 502/503/504,
# 429, 408; the stack's Prefect server whose database is down answers 503 too), a connection
# refused, dropped or timed out. Not a 500 (a bug; a database that is down, on a server not
# the stack's: flows/stack/database.py says so in one line) and not a 4xx (the request is wrong).
_TRANSIENT_STATUS = {408, 429, 502, 503, 504}
_TRANSIENT_TEXT = (
    "502 Bad Gateway",
    "503 Service Unavailable",
    "504 Gateway Timeout",
    "429 Too Many Requests",
    "502 error responses",
    "503 error responses",
    "504 error responses",
    "429 error responses",
)
_DROPPED = _NO_ANSWER | {
    "ConnectError",
    "ReadError",
    "WriteError",
    "RemoteProtocolError",
    "PoolTimeout",
    "ConnectionResetError",
    "BrokenPipeError",
}


def transient(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is a server's passing failure, which a retry may mend."""
    for e in exception_chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in _TRANSIENT_STATUS or any(t in str(e) for t in _TRANSIENT_TEXT):
            return True
        if {c.__name__ for c in type(e).__mro__} & _DROPPED:
            return True
    return False


def no_answer(exc: BaseException) -> bool:
    """Whether `exc` itself (not its causes) says a server gave no answer: refused, timed out, or
    the client's retries ran out."""
    return bool({c.__name__ for c in type(exc).__mro__} & _NO_ANSWER) or any(t in str(exc) for t in _NO_ANSWER_TEXT)


def dropped(exc: BaseException) -> bool:
    """Whether `exc` itself is a connection that was refused, dropped or timed out."""
    return bool({c.__name__ for c in type(exc).__mro__} & _DROPPED)


def from_http_client(exc: BaseException) -> bool:
    """Whether `exc` is httpx's (Prefect's client), not storage's: fsspec reaches its stores
    through aiohttp and botocore."""
    return type(exc).__module__.split(".")[0] in ("httpx", "httpcore")
