"""Prefect's temporary server as the CLI starts it: in the background while the command imports
the rest, in a process group of its own (the terminal's Ctrl-C is the command's to handle), its
lines in `$PREFECT_HOME/temporary-server.log`, and its start not announced on the terminal."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Any, Callable

servers: list[Any] = []  # the temporary Prefect servers this process started


def start_temporary_server() -> Callable[[], None] | None:
    """Start Prefect's own temporary server (the one its client would start on first use) in a
    thread; return what waits for it to answer, re-raising a failure to start. None when a
    server is named: there is nothing to start."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    # Imported here, not in the thread: two threads importing Prefect's modules at once can see
    # each other's half-initialised modules.
    from prefect.server.api.server import SubprocessASGIServer

    failure: list[BaseException] = []
    _hide_start_line()
    server = SubprocessASGIServer()
    servers.append(server)
    _own_group_and_log(server)

    def start() -> None:
        try:
            server.start()
        except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
            failure.append(e)

    thread = threading.Thread(target=start, name="prefect-temporary-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failure:
            raise failure[0]

    return wait


class _StartLine(logging.Filter):
    """Prefect's "Starting temporary server on http://127.0.0.1:PORT / See https://docs.prefect.io/..."
    at INFO: this command starts that server on purpose, and whether the line reached the terminal
    depended on whether Prefect's logging was configured by then (`sweep` imports its flows first
    and showed it; `run` did not)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Starting temporary server on ")


def _hide_start_line() -> None:
    from prefect.server.api.server import subprocess_server_logger as log

    if not any(isinstance(f, _StartLine) for f in log.filters):
        log.addFilter(_StartLine())


class _InItsOwnGroup:
    """`subprocess` as Prefect's server module sees it: the process it starts (the temporary
    server) leads a process group of its own. A signal to this command's group (the terminal's
    Ctrl-C, `timeout`, a scheduler's SIGTERM, `kill -TERM -PGID`) would otherwise end the server
    too, and this command would wait minutes on a dead server to record how its runs ended. It is
    stopped with SIGTERM when this process ends (atexit), or killed after a second signal; it ends
    itself once this process is gone however it went, `kill -9` too (flows/cli/temporary_server.py)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
        command = list(kwargs.pop("args") if "args" in kwargs else args[0])
        args = args[1:]
        if command[1:3] == ["-m", "uvicorn"]:
            command[1:3] = ["-m", "flows.cli.temporary_server", str(os.getpid())]
        kwargs.setdefault("process_group", 0)
        kwargs.setdefault("stdin", subprocess.DEVNULL)  # a background group reading the terminal would stop
        return subprocess.Popen(command, *args, **kwargs)


def _own_group_and_log(server: Any) -> None:
    """The temporary server in a process group of its own (`_InItsOwnGroup`), its own lines in
    `$PREFECT_HOME/temporary-server.log`, not the terminal: stopped right after a run failed, its
    services log the events they could not flush with a traceback, around the one `error:` line.
    Its process takes stderr when it is started, so stderr is that file for the moment of the
    start."""
    import prefect.server.api.server as server_module
    from prefect.settings import PREFECT_HOME

    server_module.subprocess = _InItsOwnGroup()  # only that module's calls: ours are as they were
    start = server._run_uvicorn_command

    def started_with_log() -> Any:
        path = PREFECT_HOME.value() / "temporary-server.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as log:
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                return start()
            finally:
                os.dup2(saved, 2)
                os.close(saved)

    server._run_uvicorn_command = started_with_log
