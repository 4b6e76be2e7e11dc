"""`mllm-pipeline stack up|down|status`: a Prefect server, a process worker and an MLflow server
on 127.0.0.1, for trying the whole system on one machine.

What `up` started is written to `<home>/stack.json` (process ids, command lines, URLs, log
files); `down` stops those processes and nothing else (a process id whose command line no longer
matches is left alone), `status` checks each. Each service leads a process group of its own so
that stopping it stops its children too (the worker's flow runs, the servers' workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flows import QUIET_ENV
from mllm import UserError, storage

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def answers(url: str, timeout: float = 2.0) -> bool:
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
        Path(self.log).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env}, start_new_session=True,
                                     cwd=Path(self.log).parent)
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
                raise RuntimeError(f"{self.name} exited (status {code}) before it was ready; "
                                   f"its log {self.log} ends:\n{tail(self.log)}")
            if (self.health_url is None or answers(self.health_url)) and (ready is None or ready()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready within {timeout:.0f} s; its log {self.log} "
                                   f"ends:\n{tail(self.log)}")
            time.sleep(0.25)

    def stop(self, grace: float = 15.0) -> bool:
        """SIGTERM the process group, then SIGKILL what is left. False if it was not running."""
        if not self.alive():
            return False
        # A worker starts each flow run in a session of its own: signal those too.
        others = [p for p in descendants(self.pid) if _pgid(p) != self.pid]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for pid in others:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
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
                if not self.alive():
                    return True
        return not self.alive()

    def saved(self) -> dict:
        d = asdict(self)
        d.pop("env")
        return d


# -- the stack ---------------------------------------------------------------------------------


def stack_home(home: str | None = None) -> Path:
    return Path(home or os.environ.get("MLLM_STACK_HOME") or ".mllm-stack").expanduser().resolve()


def _state_file(home: Path) -> Path:
    return home / "stack.json"


def load(home: Path) -> dict:
    try:
        state = json.loads(_state_file(home).read_text())
    except (OSError, ValueError):
        return {"services": [], "env": {}}
    state["services"] = [Service(**s) for s in state.get("services", [])]
    return state


def _save(home: Path, services: list[Service], env: dict[str, str], pool: str, storage: str,
          worker_env: dict[str, str]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    tmp = _state_file(home).with_suffix(".tmp")
    tmp.write_text(json.dumps({"services": [s.saved() for s in services], "env": env, "pool": pool,
                               "storage": storage, "worker_env": worker_env}, indent=2) + "\n")
    tmp.replace(_state_file(home))


def _port(wanted: int, what: str, option: str) -> int:
    if wanted == 0:
        return free_port()
    if not port_free(wanted):
        raise UserError(f"port {wanted} for the {what} is taken: choose another with {option} PORT "
                        "(0 picks a free one)")
    return wanted


def _quiet_env(home: Path) -> dict[str, str]:
    return {**QUIET_ENV, "PREFECT_HOME": str(home / "prefect"),
            # The MLflow job runner starts a dozen processes for GenAI jobs this stack never runs.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def up(home: Path, storage_root: str, pool: str = "local", prefect_port: int = 4200,
       mlflow_port: int = 5000, worker_env: dict[str, str] | None = None, timeout: float = 180.0,
       database_url: str | None = None, slots: int | None = None) -> dict:
    """Start the stack and return its state (services, env). A stack already running is left
    as it is; a worker that died is started again. `slots`: the pool's concurrency limit (None:
    no limit on a new stack, the limit unchanged on a running one; the CLI gives its default)."""
    state = load(home)
    servers = [s for s in state["services"] if s.name != "worker"]
    if servers and all(s.healthy() for s in servers):
        if not any(s.name == "worker" and s.alive() for s in state["services"]):
            start_worker(home, timeout)
        set_slots(state["env"]["PREFECT_API_URL"], state["pool"], slots)
        return load(home)
    if any(s.alive() for s in state["services"]):
        raise UserError(f"a stack in {home} is partly running: run `mllm-pipeline stack down` first")
    prefect_port = _port(prefect_port, "Prefect server", "--prefect-port")
    mlflow_port = _port(mlflow_port, "MLflow server", "--mlflow-port")
    # -- the database (flows/database.py): PostgreSQL started here, or SQLite ------------------
    from flows import database

    home.mkdir(parents=True, exist_ok=True)
    db = database.choose(home, database_url, timeout)
    db.record(home)
    # ------------------------------------------------------------------------------------------
    logs = home / "logs"
    quiet = _quiet_env(home)
    api = f"http://127.0.0.1:{prefect_port}/api"
    tracking = f"http://127.0.0.1:{mlflow_port}"
    artifacts = storage.join(storage_root, "mlflow-artifacts")
    mlflow_env = dict(quiet)
    if os.environ.get("AWS_ENDPOINT_URL") and not os.environ.get("MLFLOW_S3_ENDPOINT_URL"):
        mlflow_env["MLFLOW_S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    env = {"PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": tracking, "MLLM_STORAGE": storage_root}
    py = sys.executable
    services = [
        Service("prefect-server", [py, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(prefect_port)],
                str(logs / "prefect-server.log"), f"{api}/health", f"http://127.0.0.1:{prefect_port}",
                env={**quiet, "PREFECT_UI_API_URL": api, **db.prefect_env}),
        Service("mlflow-server", [py, "-m", "mlflow", "server", *db.mlflow_args, "--artifacts-destination", artifacts,
                                  "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
                str(logs / "mlflow-server.log"), f"{tracking}/health", tracking, env={**mlflow_env, **db.mlflow_env}),
    ]
    extra = {"pool": pool, "storage": storage_root, "worker_env": worker_env or {}}
    started: list[Service] = list(db.services)  # the database's server, already running
    try:
        for s in services:
            started.append(s.start())
        _save(home, started, env, **extra)
        for s in services:
            s.wait_ready(timeout)
        start_worker(home, timeout)
        set_slots(api, pool, slots)
    except BaseException:
        for s in reversed(load(home)["services"] or started):
            s.stop()
        _state_file(home).unlink(missing_ok=True)
        raise
    return load(home)


def start_worker(home: Path, timeout: float = 180.0) -> Service:
    """Start the stack's process worker (again) and wait until the server sees it online."""
    state = load(home)
    env, pool = state["env"], state["pool"]
    worker = Service("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                "--type", "process", "--name", f"{pool}-{socket.gethostname()}"],
                     str(home / "logs" / "worker.log"), None, f"pool {pool!r} (process)",
                     env={**_quiet_env(home), **env, "PREFECT_HOME": str(home / "worker"),
                          **state.get("worker_env", {})})
    services = [s for s in state["services"] if s.name != "worker"]
    worker.start()
    _save(home, [*services, worker], env, pool, state["storage"], state.get("worker_env", {}))
    worker.wait_ready(timeout, ready=lambda: _worker_online(env["PREFECT_API_URL"], pool, worker.pid))
    return worker


def _worker_online(api: str, pool: str, pid: int | None = None) -> bool:
    """Whether a worker of `pool` has sent the server a heartbeat (since `pid` started)."""
    req = urllib.request.Request(f"{api}/work_pools/{pool}/workers/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(req, timeout=5) as r:
            workers = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    started = _started_at(pid)
    return any(w.get("status") == "ONLINE" and (started is None or _timestamp(w["last_heartbeat_time"]) > started)
               for w in workers)


def default_slots() -> int:
    """Trainings a pool runs at once unless told: one per GPU, else one per two cores."""
    import torch

    return torch.cuda.device_count() or max(1, (os.cpu_count() or 1) // 2)


def set_slots(api: str, pool: str, slots: int | None) -> None:
    """Set the work pool's concurrency limit: flow runs beyond it wait, Scheduled, for a slot."""
    if slots is None:
        return
    req = urllib.request.Request(f"{api}/work_pools/{pool}", data=json.dumps({"concurrency_limit": slots}).encode(),
                                 method="PATCH", headers={"Content-Type": "application/json"})
    # A server on SQLite answers 503 while another write holds the database (the new worker's):
    # such an answer is tried again for a while, anything else is raised.
    deadline = time.monotonic() + 60
    while True:
        try:
            with _DIRECT.open(req, timeout=30):
                return
        except urllib.error.HTTPError as e:
            if e.code < 500 or time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not take the pool's limit of {slots} slots: "
                                   f"HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not take the pool's limit of {slots} slots: {e}") from None
        time.sleep(1.0)


def slots_of(api: str, pool: str) -> int | None:
    try:
        with _DIRECT.open(f"{api}/work_pools/{pool}", timeout=5) as r:
            return json.loads(r.read()).get("concurrency_limit")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _started_at(pid: int | None) -> float | None:
    try:
        return os.stat(f"/proc/{pid}").st_mtime if pid else None
    except OSError:
        return None


def _timestamp(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, its children's children included (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def down(home: Path) -> list[tuple[str, bool]]:
    """Stop what `up` started: (service, whether it was running) for each."""
    state = load(home)
    result = [(s.name, s.stop()) for s in reversed(state["services"])]
    _state_file(home).unlink(missing_ok=True)
    return result


def status(home: Path) -> list[tuple[Service, bool]]:
    return [(s, s.healthy()) for s in load(home)["services"]]
