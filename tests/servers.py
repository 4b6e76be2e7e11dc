"""Real servers on free loopback ports for integration tests, started and stopped cleanly.

`serving(cmd, health_url, log)` runs any server command (flows.stack.Service) until its health
URL answers and stops its whole process group afterwards; `run_mlflow_server(folder)` is an
`mlflow server` with an SQLite backend and artifacts served through it; `run_s3_server(folder)`
is moto's S3 server behind a proxy that can be switched off. The fixtures here (`mlflow_server`,
one per module; the Docker engine, registry and image) are registered once, as a plugin of
conftest.py: a test names them as arguments, and never imports them (a fixture imported into a
module is made again for that module).

    def test_x(mlflow_server): ...  # mlflow_server.url is http://127.0.0.1:PORT

Every server started here ends with the test process, however that ends (tests/reaper.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pytest

from flows import QUIET_ENV
from flows.stack.processes import Service, free_port, tail


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
        **QUIET_ENV,
        "PREFECT_HOME": str(home / "prefect"),
    }


def background(cmd: list[str], health_url: str, log: Path, env: dict[str, str] | None = None) -> Service:
    """A server command started in the background (a process group of its own), which ends with
    this process however this process ends (tests/reaper.py)."""
    service = Service(
        Path(cmd[2] if cmd[1:2] == ["-m"] else cmd[0]).name, cmd, str(log), health_url, env=env or {}
    ).start()
    reap(service.pid)
    return service


def reap(pgid: int, remove: Iterable[Path] = ()) -> None:
    """End process group `pgid` when this process ends, even by SIGKILL, then remove the folders
    `remove`."""
    subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("reaper.py")), str(os.getpid()), str(pgid), *map(str, remove)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.contextmanager
def serving(
    cmd: list[str], health_url: str, log: Path, env: dict[str, str] | None = None, timeout: float = 120.0
) -> Iterator[Service]:
    """Run `cmd` until `health_url` answers 200, yield it, then stop it."""
    proc = background(cmd, health_url, log, env)
    try:
        proc.wait_ready(timeout)
        yield proc
    finally:
        proc.stop()


class TcpProxy:
    """A TCP forwarder on a free loopback port, to take a server away and bring it back
    (`stop()`, `start()`) while the server itself, and what it holds, stays up."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)  # may be changed: to a server started in its place
        self.port = free_port()
        self.unreached = 0  # connections accepted whose upstream refused them (a dead server)
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "TcpProxy":
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_sockets, self._sockets = list(self._sockets), set()
        for sock in [listener, *open_sockets]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if not self._connect(client, listener):
                return

    def _connect(self, client: socket.socket, listener: socket.socket) -> bool:
        """Forward one accepted connection; False when the proxy was stopped meanwhile."""
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            self.unreached += 1
            client.close()
            return True
        with self._lock:
            if self._listener is not listener:
                client.close()
                server.close()
                return False
            self._sockets |= {client, server}
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
        return True

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@dataclass
class S3Server:
    """moto's S3 server on loopback (as s3fs's own tests run it), reached through a proxy
    that a test can switch off and on."""

    url: str  # the proxy's: what clients are given
    direct_url: str
    proxy: TcpProxy
    env: dict[str, str]
    process: Service  # moto itself: SIGSTOP makes it a store that hangs

    def client(self, direct: bool = True):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.direct_url if direct else self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )


@contextlib.contextmanager
def run_s3_server(folder: Path, env: dict[str, str] | None = None) -> Iterator[S3Server]:
    """moto's S3 server; `env` for moto itself (INITIAL_NO_AUTH_ACTION_COUNT=N: it checks
    credentials after its first N requests)."""
    port = free_port()
    direct = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with serving(
        cmd, f"{direct}/moto-api/", folder / "moto.log", {**quiet_env(folder / "home"), **(env or {})}
    ) as moto:
        proxy = TcpProxy(port).start()
        try:
            env = {
                "AWS_ENDPOINT_URL": proxy.url,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "MLFLOW_S3_ENDPOINT_URL": proxy.url,
            }
            yield S3Server(proxy.url, direct, proxy, env, moto)
        finally:
            proxy.stop()


@dataclass
class MlflowServer:
    url: str
    backend_uri: str
    artifacts: Path
    process: Service

    def wait_ready(self, timeout: float = 120.0) -> "MlflowServer":
        self.process.wait_ready(timeout)
        return self


@contextlib.contextmanager
def run_mlflow_server(folder: Path, wait: bool = True, port: int | None = None) -> Iterator[MlflowServer]:
    """`mlflow server` on a free loopback port (or `port`: one started again after it died):
    SQLite in `folder`, artifacts proxied by the server into `folder/artifacts` (clients upload
    over HTTP, as they would to a remote one). wait=False returns while it starts (10-30 s):
    call `wait_ready()` before the first request."""
    folder.mkdir(parents=True, exist_ok=True)
    env = quiet_env(folder / "home")
    # The job runner starts a dozen consumer processes for GenAI jobs that no test uses.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    backend = f"sqlite:///{folder / 'mlflow.db'}"
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        backend,
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    server = MlflowServer(
        url, backend, folder / "artifacts", background(cmd, f"{url}/health", folder / "mlflow-server.log", env)
    )
    try:
        if wait:
            server.wait_ready()
        yield server
    finally:
        server.process.stop()


# One server per test module: the pipeline names its experiment after the recipe, so on a server
# shared by modules a test met another module's `smoke` experiment, whose artifact root was that
# test's S3 bucket (NoCredentialsError).
@pytest.fixture(scope="module")
def mlflow_server_starting(tmp_path_factory) -> Iterator[MlflowServer]:
    """The module's server, not yet waited for: request it early to start it in the
    background while other tests run."""
    with run_mlflow_server(tmp_path_factory.mktemp("mlflow-server"), wait=False) as server:
        yield server


@pytest.fixture(scope="module")
def mlflow_server(mlflow_server_starting) -> MlflowServer:
    return mlflow_server_starting.wait_ready()


# -- Docker: the engine, a registry, the training image ---------------------------------------

REPO = Path(__file__).resolve().parents[1]
SETUP_HINT = "run `make docker-setup` as root to install and start them"


def skip_docker(reason: str) -> None:
    """Skip a Docker test with its reason; fail it where Docker is required (.ci/run as root
    sets MLLM_REQUIRE_DOCKER=1 after starting the engine)."""
    if os.environ.get("MLLM_REQUIRE_DOCKER") == "1":
        pytest.fail(f"MLLM_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_engine():
    """A docker-py client of the engine that answers on this machine (DOCKER_HOST or the local
    socket); the test skips with the reason when there is none."""
    try:
        import docker
    except ImportError:
        skip_docker("Docker tests: the docker SDK is not installed (pip install -e '.[docker]')")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as e:  # noqa: BLE001 - whatever the reason, there is no engine to use
        skip_docker(f"Docker tests: no Docker engine answers ({type(e).__name__}); {SETUP_HINT}")
    yield client
    client.close()


@dataclass
class Registry:
    host: str  # host:port, what image names start with
    process: Service


@pytest.fixture(scope="session")
def registry(docker_engine, tmp_path_factory) -> Iterator[Registry]:
    """The Distribution registry (Debian's docker-registry) on a free loopback port, storage in
    a temporary folder. Docker pushes to and pulls from 127.0.0.0/8 over plain HTTP."""
    import shutil

    binary = shutil.which("docker-registry") or shutil.which("registry")
    if binary is None:
        skip_docker(f"Docker tests: no image registry (docker-registry) on PATH; {SETUP_HINT}")
    folder = tmp_path_factory.mktemp("registry")
    # Its storage outlives the session and the checkout, as Docker's own layer cache does: the
    # next session's push, from this clone or a fresh one, finds the layers there (the image's
    # dependency layer is 2 GB, 80 s to push). Blobs are named by their digest, so a stale one
    # is never taken for another.
    data = Path(os.environ.get("MLLM_TEST_REGISTRY_CACHE", "/var/tmp/mllm-pipeline-tests/registry"))
    port = free_port()
    config = folder / "config.yml"
    config.write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {data}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    with serving(
        [binary, "serve", str(config)],
        f"http://127.0.0.1:{port}/v2/",
        folder / "registry.log",
        quiet_env(folder / "home"),
        timeout=60,
    ) as proc:
        yield Registry(f"127.0.0.1:{port}", proc)


def local_torch_wheel() -> Path | None:
    """The wheel of the torch that runs these tests, in pip's find-links folders: the image
    installs it rather than PyPI's CUDA build (several GB)."""
    import subprocess

    import torch

    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    )
    folders += out.stdout.split() if out.returncode == 0 else []
    for folder in folders:
        path = Path(folder.removeprefix("file://"))
        found = sorted(path.glob(f"torch-{torch.__version__}-cp311-*.whl")) if path.is_dir() else []
        if found:
            return found[0]
    return None


@dataclass
class BuiltImage:
    name: str  # in the registry: host:port/mllm-pipeline:<commit>
    commit: str
    seconds: float


def build_image(context: Path, registry: Registry, log: Path) -> BuiltImage:
    """infra/docker/build-image.sh on `context`: the local base, the local torch wheel, pushed."""
    import subprocess
    import time

    wheel = local_torch_wheel()
    if wheel is None:
        skip_docker(
            "Docker tests: no local wheel of this torch in pip's find-links; the image would pull "
            "PyPI's CUDA build (several GB)"
        )
    import shutil

    start = time.monotonic()
    base = subprocess.run([str(REPO / "infra/docker/base-image.sh")], capture_output=True, text=True)
    if base.returncode != 0:
        if os.geteuid() != 0 or shutil.which("debootstrap") is None:
            skip_docker(f"Docker tests: no local base image, and making one needs root and debootstrap; {SETUP_HINT}")
        raise AssertionError(f"infra/docker/base-image.sh failed:\n{base.stderr[-3000:]}")
    with open(log, "ab") as out:
        proc = subprocess.run(
            [
                str(REPO / "infra/docker/build-image.sh"),
                "--local-base",
                "--torch-wheel",
                str(wheel),
                "--push",
                registry.host,
                str(context),
            ],
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
        )
    if proc.returncode != 0:
        raise AssertionError(f"image build failed ({proc.returncode}):\n{tail(log, 40)}")
    commit = subprocess.run(
        ["git", "-C", str(context), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return BuiltImage(proc.stdout.strip().splitlines()[-1], commit, time.monotonic() - start)


@pytest.fixture(scope="session")
def training_image(registry, tmp_path_factory) -> BuiltImage:
    """The image of this checkout, built once a session (Docker's layer cache makes a rebuild
    of the same commit take seconds) and pushed to the session's registry."""
    return build_image(REPO, registry, tmp_path_factory.mktemp("image") / "build.log")


class FaultProxy(TcpProxy):
    """An HTTP forwarder on a free loopback port in front of a real server that, when told,
    answers `503 Service Unavailable` for a while (`unavailable(seconds)`) or refuses connections
    (`refuse(seconds)`), as a server behind a load balancer does while it restarts or is
    overloaded. Each request gets a connection of its own upstream (`Connection: close`), so that
    every one is counted and can be refused; a websocket upgrade (Prefect's events) is passed
    through as bytes. `answered_503` counts the 503s it sent."""

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port)
        self.answered_503 = 0
        self.forwarded = 0
        self._unavailable_until = 0.0
        self._window_met, self._open_until_met = 0, 0.0  # see unavailable(until_met=)
        self._only: bytes | None = None
        self._refuse_next = 0  # see unavailable_for()

    def unavailable(self, seconds: float, only: str | None = None, until_met: float = 0.0) -> None:
        """Answer 503 for `seconds` from now: to every request, or to those whose request line
        starts with `only` (`"POST /api/flow_runs/ "`: Prefect creating a flow run). With
        `until_met`, a window that ends before any request met it stays open until one does, for
        at most `until_met` seconds from now (a client that was busy elsewhere all the window)."""
        import time

        self._only = only.encode() if only else None
        now = time.monotonic()
        self._unavailable_until = now + seconds
        self._window_met = self.answered_503
        self._open_until_met = now + until_met

    def unavailable_for(self, requests: int, only: str) -> None:
        """Answer 503 to the next `requests` requests whose request line starts with `only`,
        however late they come (a client's retries, counted rather than timed)."""
        self._only = only.encode()
        with self._lock:
            self._refuse_next = requests

    def refuse(self, seconds: float) -> None:
        """Refuse connections (nothing listens) for `seconds`, then listen again."""
        self.stop()
        timer = threading.Timer(seconds, self.start)
        timer.daemon = True
        timer.start()

    def _connect(self, client: socket.socket, listener: socket.socket) -> bool:
        threading.Thread(target=self._serve, args=(client,), daemon=True).start()
        return True

    def _serve(self, client: socket.socket) -> None:
        import time

        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    client.close()
                    return
                head += chunk
            head, rest = head.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            upgrade = any(line.lower().startswith(b"upgrade:") for line in lines[1:])
            now = time.monotonic()
            window = now < self._unavailable_until or (
                self.answered_503 == self._window_met and now < self._open_until_met
            )
            matches = self._only is None or lines[0].startswith(self._only)
            with self._lock:
                counted = matches and self._refuse_next > 0
                if counted:
                    self._refuse_next -= 1
            if counted or (window and matches):
                with self._lock:
                    self.answered_503 += 1
                body = b'{"detail": "Service Unavailable (test proxy)"}'
                client.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )
                client.close()
                return
            if not upgrade:
                lines = [
                    lines[0],
                    *(h for h in lines[1:] if not h.lower().startswith((b"connection:", b"keep-alive:"))),
                    b"Connection: close",
                ]
            server = socket.create_connection(self.upstream)
            with self._lock:
                self.forwarded += 1
            server.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + rest)
        except OSError:
            client.close()
            return
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
