"""The stack's Prefect server: Prefect's own `prefect server start`, except that a request which
could not reach the server's database answers 503 rather than 500 (docs/stack.md)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from prefect.server.api import server as _api

from mllm.failures import exception_chain

# What connecting to the database raises when nothing listens there, or it cannot be reached.
_UNREACHABLE = (ConnectionError, TimeoutError, socket.gaierror)

_prefects_own = _api.is_client_retryable_exception


def database_unreachable(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a connection to the server's database that failed."""
    return any(isinstance(e, _UNREACHABLE) for e in exception_chain(exc))


def retryable(exc: Exception) -> bool:
    return _prefects_own(exc) or database_unreachable(exc)


def main() -> None:
    # Prefect's exception handler looks the test up in its module each time it answers a failure.
    _api.is_client_retryable_exception = retryable
    if sys.argv[1:2] == ["uds"]:
        import uvicorn

        os.umask(0o077)
        Path(sys.argv[2]).unlink(missing_ok=True)
        uvicorn.run(_api.create_app(final=True), uds=sys.argv[2], log_config=None, timeout_keep_alive=5)
        return
    from prefect.cli import app

    app()


if __name__ == "__main__":
    main()
