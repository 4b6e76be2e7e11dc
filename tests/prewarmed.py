"""CLI commands in processes of their own that start without paying for their imports again.

A command of the suite (`conftest.cli`) spends about 5 s of CPU importing torch, MLflow, pandas and
the rest before its first line runs: two thirds of a short command's CPU, for about 160 commands a
suite. Here one process per test process (`python tests/prewarmed.py SOCKET`) imports those
libraries once and then forks a child for each command, as a fork server does:

- the child is a process of its own, with its own PID, exit status, stdin (/dev/null), stdout and
  stderr (the caller's pipes), working directory, environment and signal handlers; it runs
  `python -m MODULE ARGS` as `runpy` does, and ends as an interpreter ends (threads joined, atexit
  handlers run, streams flushed);
- only third-party libraries are imported ahead, and only those that read no setting of this
  project's or Prefect's at import: the project's own modules, Prefect and everything that reads
  the command's environment are imported by the child, after its environment is in place;
- Python's hash seed is the fork server's, one per test process rather than one per command, and
  numpy's global generator is seeded again in each child.

A test whose subject is the process itself (start-up time, what a fresh interpreter imports,
signals sent to a command started in the background) starts a real interpreter instead
(`subprocess`), as it always did.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Imported once, ahead of every command: large, and indifferent to the command's environment.
AHEAD = (
    "torch",
    "numpy",
    "pandas",
    "pyarrow",
    "pyarrow.parquet",
    "mlflow",
    "mlflow.tracking",
    "fsspec",
    "s3fs",
    "httpx",
    "fastapi",
    "sqlalchemy",
    "pydantic",
    "pydantic.v1",
    "typer",
    "rich.console",
    "rich.progress",
    "yaml",
    "mlflow.pyfunc",
)

# Prefect reads its settings (PREFECT_HOME, the API URL, logging) when it is imported. It is imported
# ahead all the same, for about 0.7 s of CPU a command, and each child builds its settings and logging
# again from its own environment (`_own_prefect`), as a fresh import would. A command of this project
# that names no Prefect server (Prefect's temporary-server path) starts a new interpreter instead:
# forked from here, its events client failed against the temporary server on every event.
AHEAD_PREFECT = (
    "prefect.main",
    "prefect.flows",
    "prefect.tasks",
    "prefect.client.orchestration",
    "prefect.deployments",
    "prefect.flow_engine",
    "prefect.task_engine",
    "prefect.runtime",
    "prefect.artifacts",
    "prefect.logging.formatters",
    "prefect.variables",
    "prefect.exceptions",
    "prefect.states",
    "prefect.futures",
    "prefect.results",
)


# --- the fork server ----------------------------------------------------------------------------


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return data


def _run_command(request: dict, out_fd: int, err_fd: int) -> None:
    """In the child: become the command and exit as an interpreter would. Never returns."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (null, out_fd, err_fd):
        os.close(fd)
    if request.get("new_session"):
        os.setsid()
    import faulthandler

    faulthandler.register(STACKS, all_threads=True)  # a command that outlasts its timeout prints its stacks
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile

    tempfile.tempdir = None  # found again from the command's TMPDIR, as a new interpreter would
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"], *request["args"]]
    # The path a new interpreter would have: the working directory, then PYTHONPATH, then the rest.
    ahead = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [request["cwd"], *ahead, *_BASE_PATH]
    if request["module"].split(".")[0] == "flows":
        _process_defaults()
    if "prefect.context" in sys.modules:
        _own_prefect()
    code: int = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 (the command's failure, printed as its interpreter would)
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  (what the interpreter does first at exit)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:  # an uncaught KeyboardInterrupt ends the process by SIGINT, as Python does
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


PROJECT = ("mllm", "tasks", "flows")
STACKS = signal.SIGUSR2  # asks a command for its threads' stacks on stderr (`Command.communicate` at a timeout)


def _process_defaults() -> None:
    """What the console script sets up before it imports Prefect (flows.cli.console), set before
    Prefect is imported (in the server) or its settings are built again (in a child)."""
    try:
        from flows.settings import process_defaults
    except ImportError:  # flows' needs not installed (`pytest tests/mllm`)
        return
    process_defaults()


def _own_prefect() -> None:
    """In the child: Prefect's settings and logging from the command's environment and folder."""
    import prefect.context
    import prefect.logging.configuration as logging_configuration

    prefect.context.refresh_global_settings_context()
    logging_configuration.PROCESS_LOGGING_CONFIG.clear()
    logging_configuration.setup_logging(incremental=False)


def _attend(conn: socket.socket, request: dict, out_fd: int, err_fd: int) -> None:
    """In a child of the server: start the command, tell the caller its PID, wait for it and tell
    its exit status. Never returns."""
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_command(request, out_fd, err_fd)
        os.close(out_fd)
        os.close(err_fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


_BASE_PATH: list[str] = []  # the server's sys.path without its script's folder and its PYTHONPATH


def serve(path: str) -> None:
    own = {entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry}
    _BASE_PATH[:] = [entry for entry in sys.path[1:] if entry not in own]
    # Not this script's folder on the path: tests/mllm would be imported as a namespace package
    # `mllm`, ahead of the installed project.
    sys.path[:] = [str(Path(__file__).resolve().parents[1]), *_BASE_PATH]
    _process_defaults()
    # The project's modules were imported for that alone: each command imports them again.
    for name in [name for name in sys.modules if name.split(".")[0] in PROJECT]:
        del sys.modules[name]
    for name in (*AHEAD, *AHEAD_PREFECT):
        try:
            importlib.import_module(name)
        except ImportError:  # not installed (`pytest tests/mllm` where mllm's own needs alone are)
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the socket appears only once the imports are done
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # attendants are reaped by the kernel
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = listener.accept()
        try:
            header, fds, _, _ = socket.recv_fds(conn, 8, 2)
            size = int.from_bytes(header, "big")
            payload = b""
            while len(payload) < size:
                payload += conn.recv(size - len(payload))
            request = json.loads(payload)
        except Exception:  # noqa: BLE001 (a caller that went away mid-request)
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _attend(conn, request, *fds)
        conn.close()
        for fd in fds:
            os.close(fd)


# --- the caller's side --------------------------------------------------------------------------

_server: list[tuple[subprocess.Popen, str]] = []


def _socket_path() -> str:
    if _server and _server[0][0].poll() is None:
        return _server[0][1]
    import tempfile

    folder = tempfile.mkdtemp(prefix="mllm-prewarmed-", dir=os.environ.get("TMPDIR"))  # in the suite: its home
    path = os.path.join(folder, "socket")
    log = open(os.path.join(folder, "server.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, __file__, path],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # after the kill below (atexit: last in, first run)
    atexit.register(proc.kill)
    deadline = time.monotonic() + 180
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the prewarmed command server did not start: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.05)
    _server[:] = [(proc, path)]
    return path


class Command:
    """A command forked from the prewarmed server, used as a `subprocess.Popen(..., text=True,
    stdout=PIPE, stderr=PIPE)` is: `pid`, `returncode`, `stdout` and `stderr` (text, universal
    newlines), `poll()`, `wait()`, `communicate()`, `send_signal()`, `terminate()`, `kill()`."""

    def __init__(
        self,
        module: str,
        args: list[str],
        env: dict[str, str],
        cwd: str | os.PathLike | None = None,
        new_session: bool = False,
    ):
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: int | None = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_socket_path())
            payload = json.dumps(
                {
                    "module": module,
                    "args": list(args),
                    "env": env,
                    "new_session": new_session,
                    "cwd": str(cwd or os.getcwd()),
                }
            ).encode()
            socket.send_fds(self._conn, [len(payload).to_bytes(8, "big")], [out_w, err_w])
            self._conn.sendall(payload)
        finally:
            os.close(out_w)
            os.close(err_w)
        self.pid: int = json.loads(_read_line(self._conn))["pid"]
        self.stdout = open(out_r, encoding="utf-8", errors="replace", newline=None)
        self.stderr = open(err_r, encoding="utf-8", errors="replace", newline=None)
        self._status = b""

    def _status_line(self, timeout: float | None) -> bool:
        """Read the exit status if it comes within `timeout` seconds (None: wait for it)."""
        if self.returncode is not None:
            return True
        self._conn.settimeout(timeout)
        try:
            while not self._status.endswith(b"\n"):
                chunk = self._conn.recv(4096)
                if not chunk:
                    raise RuntimeError(f"the prewarmed server lost command {self.pid}")
                self._status += chunk
        except (TimeoutError, BlockingIOError):
            return False
        self.returncode = json.loads(self._status)["returncode"]
        self._conn.close()
        return True

    def poll(self) -> int | None:
        self._status_line(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._status_line(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything left on stdout and stderr once the command ends (and its pipes close)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        texts = {self.stdout: [], self.stderr: []}
        with selectors.DefaultSelector() as sel:
            for stream in texts:
                if not stream.closed:
                    sel.register(stream.fileno(), selectors.EVENT_READ, stream)
            if not _read(sel, texts, deadline):
                raise self._timed_out(timeout, sel, texts)  # type: ignore[arg-type]
        for stream in texts:
            if not stream.closed:
                stream.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 1.0))
        return tuple(_text(b"".join(chunks)) for chunks in texts.values())  # type: ignore[return-value]

    def _timed_out(self, timeout: float, sel: selectors.BaseSelector, texts: dict) -> subprocess.TimeoutExpired:
        """The timeout, with what tells why: the command's threads' stacks if it still runs (read
        for up to 5 s more), or that it ended while something it started still holds its pipes."""
        if self.poll() is None:
            os.kill(self.pid, STACKS)
            _read(sel, texts, time.monotonic() + 5)
            why = "still running; its threads' stacks end its stderr"
        else:
            why = f"ended with {self.returncode}, but a process it started still holds its stdout or stderr"
        out, err = (_text(b"".join(texts[stream])) for stream in (self.stdout, self.stderr))
        return Timeout(self.args, timeout, out, err, why)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Timeout(subprocess.TimeoutExpired):
    """A command past its timeout; its message carries why and the end of its output."""

    def __init__(self, cmd: list[str], timeout: float, output: str, stderr: str, why: str):
        super().__init__(cmd, timeout, output, stderr)
        self.why = why

    def __str__(self) -> str:
        # The stacks' dump would crowd out the command's own last lines: those first, then the
        # stack of the thread the dump calls current (the command's main thread).
        err, stacks = _split_stacks(self.stderr)
        last = ("\n".join(text.splitlines()[-40:]) for text in (self.output, err))
        text = f"{super().__str__()}: {self.why}\n--- stdout\n{next(last)}\n--- stderr\n{next(last)}"
        return text + (f"\n--- its main thread\n{stacks}" if stacks else "")


def _split_stacks(stderr: str) -> tuple[str, str]:
    """stderr without faulthandler's dump of the threads' stacks, and the current thread's stack."""
    found = re.search(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", stderr, re.MULTILINE)
    if not found:
        return stderr, ""
    dump = stderr[found.start() :]
    current = re.search(r"^Current thread 0x.*?(?=\n\s*\n|\Z)", dump, re.MULTILINE | re.DOTALL)
    return stderr[: found.start()], current.group(0) if current else dump


def _read(sel: selectors.BaseSelector, texts: dict, deadline: float | None) -> bool:
    """Read the registered pipes into `texts` until all close (True) or the deadline (False)."""
    while sel.get_map():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        for key, _ in sel.select(left):
            data = os.read(key.fd, 65536)
            if data:
                texts[key.data].append(data)
            else:
                sel.unregister(key.fd)
    return True


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def _fresh(module: str, env: dict[str, str]) -> bool:
    """Whether a command starts a new interpreter rather than a fork (see AHEAD_PREFECT)."""
    temporary_server = module.split(".")[0] == "flows" and not env.get("PREFECT_API_URL")
    return temporary_server or os.environ.get("MLLM_TESTS_FRESH") == "1"


def run(
    module: str,
    args: list[str],
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    fresh: bool = False,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` run to its end: what `subprocess.run(..., capture_output=True,
    text=True, timeout=..., check=...)` gives (env None: this process's environment). `fresh=True`,
    or MLLM_TESTS_FRESH=1 in the environment, starts a new interpreter instead (to tell whether a
    failure is the fork's)."""
    env = dict(os.environ) if env is None else env
    if fresh or _fresh(module, env):
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=env,
            check=check,
        )
    command = Command(module, args, env, cwd)
    try:
        out, err = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        raise
    done = subprocess.CompletedProcess(command.args, command.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def start(
    module: str, args: list[str], env: dict[str, str], cwd: str | os.PathLike | None = None, new_session: bool = False
) -> Command | subprocess.Popen:
    """`python -m MODULE ARGS` started in the background, as `subprocess.Popen(..., text=True,
    stdout=PIPE, stderr=PIPE, start_new_session=new_session)` starts it."""
    if _fresh(module, env):
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=new_session,
        )
    return Command(module, args, env, cwd, new_session)


if __name__ == "__main__":
    serve(sys.argv[1])
