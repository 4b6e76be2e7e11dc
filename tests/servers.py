"""Real servers on free loopback ports for integration tests, started and stopped cleanly.

`serving(cmd, health_url, log)` runs any server command until its health URL answers and stops
its whole process group afterwards; `run_mlflow_server(folder)` is an `mlflow server` with an
SQLite backend and artifacts served through it. The `mlflow_server` fixture gives one per
session (import the fixtures into the test module, or into conftest.py):

    from servers import mlflow_server, mlflow_server_starting  # noqa: F401

    def test_x(mlflow_server): ...  # mlflow_server.url is http://127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_env(home: Path) -> dict[str, str]:
    """The environment for a server process: its home, caches and config in `home`, no
    telemetry, so that a test run writes nothing under ~."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "MPLCONFIGDIR": str(home / "matplotlib"),
        "PREFECT_HOME": str(home / "prefect"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "PYTHONUNBUFFERED": "1",
    }


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def _answers(url: str) -> bool:
    try:
        with _DIRECT.open(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Process:
    """A server command started in the background, leading a process group of its own."""

    def __init__(self, cmd: list[str], health_url: str, log: Path,
                 env: dict[str, str] | None = None):
        self.cmd, self.health_url, self.log = cmd, health_url, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, cwd=log.parent)
        self.ready = False

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the health URL answers 200; raise with the log's tail if it never does."""
        deadline = time.monotonic() + timeout
        while not self.ready:
            if _answers(self.health_url):
                self.ready = True
            elif self.popen.poll() is not None:
                raise RuntimeError(f"{' '.join(self.cmd[:4])} ... exited with {self.popen.returncode} before "
                                   f"{self.health_url} answered:\n{_tail(self.log)}")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"{self.health_url} did not answer within {timeout:.0f} s:\n"
                                   f"{_tail(self.log)}")
            else:
                time.sleep(0.25)

    def stop(self) -> None:
        # The server's workers are its children: signal the group it leads, which we started.
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


@contextlib.contextmanager
def serving(cmd: list[str], health_url: str, log: Path, env: dict[str, str] | None = None,
            timeout: float = 120.0) -> Iterator[Process]:
    """Run `cmd` until `health_url` answers 200, yield it, then stop it."""
    proc = Process(cmd, health_url, log, env)
    try:
        proc.wait_ready(timeout)
        yield proc
    finally:
        proc.stop()


@dataclass
class MlflowServer:
    url: str
    backend_uri: str
    artifacts: Path
    process: Process

    def wait_ready(self, timeout: float = 120.0) -> "MlflowServer":
        self.process.wait_ready(timeout)
        return self


@contextlib.contextmanager
def run_mlflow_server(folder: Path, wait: bool = True) -> Iterator[MlflowServer]:
    """`mlflow server` on a free loopback port: SQLite in `folder`, artifacts proxied by the
    server into `folder/artifacts` (clients upload over HTTP, as they would to a remote one).
    wait=False returns while it starts (10-30 s): call `wait_ready()` before the first request."""
    folder.mkdir(parents=True, exist_ok=True)
    env = quiet_env(folder / "home")
    # The job runner starts a dozen consumer processes for GenAI jobs that no test uses.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    backend = f"sqlite:///{folder / 'mlflow.db'}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
           "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    server = MlflowServer(url, backend, folder / "artifacts",
                          Process(cmd, f"{url}/health", folder / "mlflow-server.log", env))
    try:
        if wait:
            server.wait_ready()
        yield server
    finally:
        server.process.stop()


@pytest.fixture(scope="session")
def mlflow_server_starting(tmp_path_factory) -> Iterator[MlflowServer]:
    """The session's server, not yet waited for: request it early to start it in the
    background while other tests run."""
    with run_mlflow_server(tmp_path_factory.mktemp("mlflow-server"), wait=False) as server:
        yield server


@pytest.fixture(scope="session")
def mlflow_server(mlflow_server_starting) -> MlflowServer:
    return mlflow_server_starting.wait_ready()
