"""Background services on this machine: a command leading a process group of its own, started,
checked (its pid still runs the command we started; its health URL answers) and stopped with its
children; and the loopback port checks the stack and the tests share."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from mllm.settings import environment

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now. With SO_REUSEADDR, as the servers
    themselves bind (uvicorn, PostgreSQL): connections closed moments ago (TIME_WAIT, for about a
    minute after `stack down`) do not count, a listening socket does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def unix_url(sock: str | Path, path: str) -> str:
    """A URL for `path` on the HTTP server of the Unix socket `sock` (as health URLs are kept)."""
    return "http+unix://" + urllib.parse.quote(str(sock), safe="") + path


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, sock: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._sock_path = sock

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._sock_path)


def unix_request(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None, timeout: float = 30.0
) -> tuple[int, bytes]:
    """(status, body) of a request to an `http+unix://` URL (unix_url)."""
    parts = urllib.parse.urlsplit(url)
    conn = _UnixHTTP(urllib.parse.unquote(parts.netloc), timeout)
    try:
        conn.request(
            method,
            parts.path + (f"?{parts.query}" if parts.query else ""),
            body=body,
            headers={"Host": "localhost", **(headers or {})},
        )
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def answers(url: str, timeout: float = 2.0) -> bool:
    if url.startswith("http+unix://"):
        try:
            return unix_request(url, timeout=timeout)[0] == 200
        except OSError:
            return False
    try:
        with _DIRECT.open(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def tail(path: str | Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Service:
    """A background command leading its own process group, ready when `health_url` answers
    200 (or, with no URL, when `ready` says so)."""

    name: str
    cmd: list[str]
    log: str
    health_url: str | None = None
    url: str | None = None  # what to show the user
    pid: int | None = None
    env: dict[str, str] = field(default_factory=dict, repr=False)  # not saved: may hold secrets

    def start(self) -> "Service":
        # Logs carry flow runs' output: the stack's user's alone (0600 in a 0700 folder).
        Path(self.log).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "ab") as out:
            popen = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**environment(), **self.env},
                start_new_session=True,
                cwd=Path(self.log).parent,
            )
        self.pid = popen.pid
        self._popen = popen
        return self

    def alive(self) -> bool:
        """Whether our process still runs: its pid exists and runs the command we started."""
        if self.pid is None:
            return False
        popen = getattr(self, "_popen", None)
        if popen is not None:
            return popen.poll() is None
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            try:
                os.kill(self.pid, 0)  # no /proc (macOS): trust the pid
                return True
            except OSError:
                return False
        return [c.decode(errors="replace") for c in cmdline if c] == self.cmd

    def healthy(self) -> bool:
        return self.alive() and (self.health_url is None or answers(self.health_url))

    def wait_ready(self, timeout: float = 120.0, ready=None) -> None:
        """Block until healthy (and `ready()` if given); raise with the log's tail if never."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                code = getattr(self, "_popen", None) and self._popen.returncode
                raise RuntimeError(
                    f"{self.name} exited (status {code}) before it was ready; "
                    f"its log {self.log} ends:\n{tail(self.log)}"
                )
            if (self.health_url is None or answers(self.health_url)) and (ready is None or ready()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} was not ready within {timeout:.0f} s; its log {self.log} ends:\n{tail(self.log)}"
                )
            time.sleep(0.25)

    def stop(self, grace: float = 15.0) -> bool:
        """SIGTERM the process group, then SIGKILL what is left. False if it was not running."""
        if not self.alive():
            self._stop_orphans()
            return False
        # A worker starts each flow run in a session of its own: signal those too.
        others = [p for p in descendants(self.pid) if _pgid(p) != self.pid]
        # `runuser` answers SIGTERM by SIGKILLing its command 2 s later, whatever it is doing: a
        # PostgreSQL server amid a shutdown checkpoint slowed by load is cut off, and its
        # postmaster.pid names a pid that a new start can take for a running server until someone
        # reaps it. So its command is asked to stop, and runuser ends when that command does.
        through = self.cmd[:1] == ["runuser"]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for pid in others + (children(self.pid) if through and sig == signal.SIGTERM else []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if not through or sig == signal.SIGKILL:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                popen = getattr(self, "_popen", None)
                if popen is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        popen.wait(timeout=0.2)
                else:
                    time.sleep(0.2)
                # The whole group: `runuser` returns before the PostgreSQL server under it has
                # finished its shutdown checkpoint (whose lock file a new start would then meet).
                if not self.alive() and not group(self.pid):
                    return True
        return not self.alive()

    def _stop_orphans(self) -> None:
        """Stop what is left of our process group once its leader is gone: `mlflow server` killed
        by its pid leaves its uvicorn listening on the port. A pid that runs again belongs to
        another process, and so would its group. A leader that is a zombie is gone too: killed, it
        waits for whoever adopted it to reap it (a container's first process may never do so)."""
        if self.pid is None or not Path("/proc/self").exists() or _runs(self.pid):
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + 5.0
            while group(self.pid) and time.monotonic() < deadline:
                time.sleep(0.2)

    def saved(self) -> dict:
        d = asdict(self)
        d.pop("env")
        return d


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command's name) of each process (Linux)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue


def _runs(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    return [pid for pid, f in _stats() if len(f) > 2 and f[2] == str(pgid) and f[0] != "Z"]


def children(pid: int) -> list[int]:
    """The processes `pid` started itself (Linux /proc)."""
    return [child for child, f in _stats() if len(f) > 1 and f[1] == str(pid)]


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, its children's children included (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for child, fields in _stats():
        with contextlib.suppress(ValueError, IndexError):
            children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
