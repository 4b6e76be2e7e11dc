"""Test isolation: Prefect, MLflow and every cache write under a temporary folder, never ~.

These variables are set before any test module imports prefect or mlflow, which read them once.
"""

from __future__ import annotations

import atexit
import base64
import functools
import http.server
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from commands import PASSWORD, SESSION_PREFECT_SERVER
from textdata import make_text

from flows import QUIET_ENV

# Bytecode caches on, whatever the shell said (PYTHONDONTWRITEBYTECODE=1 on the machines we test on):
# otherwise every worker rewrites the test modules' asserts again (collecting the fast tier: 16.3 s
# a process against 11.2 s) and every command compiles the project again (docs/benchmarks/test-suite.md).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Temporary files: this process's own (pytest's, the fixtures') go where TMPDIR said when the run
# began; those of the commands and servers it starts (Prefect's workspaces, torchrun's folders) go
# under its home below, as does everything else the run writes, and the home is removed when the
# process ends (by the reaper when it is killed, pytest_configure). An xdist worker inherits its
# controller's TMPDIR: the run's own is kept in MLLM_TESTS_OUTER_TMPDIR.
tempfile.tempdir = os.environ.setdefault("MLLM_TESTS_OUTER_TMPDIR", tempfile.gettempdir())
_HOME = Path(tempfile.mkdtemp(prefix="mllm-tests-"))
(_HOME / "tmp").mkdir()
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ.update(
    {
        "TMPDIR": str(_HOME / "tmp"),
        **QUIET_ENV,
        "PREFECT_HOME": str(_HOME / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "MLFLOW_TRACKING_URI": f"sqlite:///{_HOME / 'mlflow.db'}",
        "XDG_CONFIG_HOME": str(_HOME / "config"),
        "XDG_CACHE_HOME": str(_HOME / "cache"),
        "MPLCONFIGDIR": str(_HOME / "matplotlib"),
        "MPLBACKEND": "Agg",
        "HF_HOME": str(_HOME / "hf"),
        "TORCHINDUCTOR_CACHE_DIR": str(_HOME / "inductor"),
        # Tiny test models run 30x slower when two threads contend for two busy cores.
        "OMP_NUM_THREADS": "1",
    }
)
# No storage root named by the environment the tests were started in. The Prefect API is an address
# where nothing answers until the session's own server (the `prefect_server` fixture) is named: a
# test that reaches Prefect without asking for that server fails at once, rather than starting a
# temporary server of its own in 25 s. The socket is bound, not listening, for the process's life.
os.environ.pop("MLLM_STORAGE", None)
_NO_PREFECT = socket.socket()
_NO_PREFECT.bind(("127.0.0.1", 0))
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_NO_PREFECT.getsockname()[1]}/api"

# The servers' fixtures (tests/servers.py), registered once for the session.
pytest_plugins = ("servers",)


# The modules that take longest, longest first (their times summed from `make test`'s junit report,
# a fresh-clone run of ab78e6b on 2 Zen 3 cores):
# sent to the workers first, so that none is left with one of them at the end while the others
# idle. xdist's own reordering is turned off below (--no-loadscope-reorder, for any invocation):
# with it, xdist sends the modules with the most tests first, and these, which have few, went last.
HEAVY_FIRST = (
    "test_stack_postgres.py",
    "test_faults_training.py",
    "test_stack.py",
    "test_docker.py",
    "test_stack_netns.py",
    "test_search.py",
    "test_faults.py",
    "test_cli.py",
    "test_pipeline_tracking.py",
    "test_object_storage.py",
    "test_lineage.py",
    "test_corpora.py",
    "test_transient.py",
    "test_stack_auth.py",
    "test_sweep.py",
    "test_tracking.py",
    "test_pipeline.py",
    "test_stack_policy.py",
    "test_speed.py",
    "test_family_pipelines.py",
    "test_search_faults.py",
    "test_export.py",
    "test_export_cli.py",
    "test_train.py",
    "test_layout.py",
    "test_seq2seq_pipeline.py",
    "test_logged_models.py",
    "test_docs_commands.py",
    "test_embeddings_pipeline.py",
    "test_make_clean.py",
    "test_settings.py",
    "test_seq2seq.py",
    "test_muon.py",
    "test_models.py",
    "test_layers.py",
)


# The modules that each run a whole stack (a Prefect server, a worker, MLflow, some with PostgreSQL,
# Caddy or moto, and trainings on the pool): one lane, run one after another on one worker, while
# the other workers take the rest. Side by side they (with the suite's other servers) kept 2 cores
# at load 7-9 for minutes, and their commands' timeouts are sized for one stack at a time: CI runs
# of 6dae5ff and e9204f7 failed there, a resubmitted training that waited past 300 s and a test
# that then found its run in flight.
ONE_LANE = (
    "test_stack_postgres.py",
    "test_stack.py",
    "test_stack_netns.py",
    "test_stack_auth.py",
    "test_stack_policy.py",
)
LANE = "tests/stack: the modules that run a whole stack, one after another"


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but ONE_LANE's modules are one work unit (pytest-xdist's loadfile
    scheduler with its scope function changed); any other --dist is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneStackAtATime(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return LANE if module.rsplit("/", 1)[-1] in ONE_LANE else module

    return OneStackAtATime(config, log)


# The rooms whose integration tests run flows and CLI commands: each such test gets the session's
# Prefect server, set up before its module's own fixtures (which may start commands). Other tests get
# none (`make test-fast` starts none) unless they ask for it by name.
PIPELINE_ROOMS = {"tasks", "flows", "stack", "cli", "infra"}


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order stays
    for item in items:
        room = item.path.relative_to(TESTS).parts[0]
        if (
            room in PIPELINE_ROOMS
            and item.get_closest_marker("integration")
            and "prefect_server" not in item.fixturenames
        ):
            # A new list: parametrized items of one function share theirs. Session-scoped, so set up first.
            item.fixturenames = ["prefect_server", *item.fixturenames]


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist's scheduler keeps HEAVY_FIRST's order
        config.option.loadscopereorder = False
    # An xdist worker leads a process group of its own, ended when the worker ends however it
    # ends (tests/reaper.py): no command, temporary Prefect server or training a test started
    # outlives a run that was stopped. Servers that lead groups of their own are reaped alike
    # (servers.background).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from servers import reap

        os.setpgid(0, 0)
        reap(os.getpid(), remove=[_HOME])


TESTS = Path(__file__).resolve().parent


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(make_text().encode("utf-8"))
    return path


def _made_once(config, name: str, make: Callable[[Path], None]) -> Path:
    """The file `make(path)` writes, made once and kept in pytest's cache folder (.pytest_cache; this
    process's home under -p no:cacheprovider), under `name`, which names the version of what made it.
    xdist's workers share it: the first makes it, under a lock, and the others wait for it."""
    import fcntl

    cache = getattr(config, "cache", None)
    path = cache.mkdir("made-once") / name if cache else _HOME / "made-once" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            folder = Path(tempfile.mkdtemp(dir=path.parent))
            try:
                make(folder / path.name)
                os.replace(folder / path.name, path)
            finally:
                shutil.rmtree(folder)
    return path


def _migrated_prefect_database(config) -> Path:
    """A Prefect database with every migration applied. A server started on a copy answers in 11 s
    here, against 25 s on a new database, whose 14 s of migrations it runs first
    (docs/benchmarks/test-suite.md)."""
    from servers import quiet_env

    def make(path: Path) -> None:
        env = {**quiet_env(path.parent / "home"), "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{path}"}
        cmd = [str(Path(sys.executable).with_name("prefect")), "server", "database", "upgrade", "-y"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"prefect server database upgrade failed:\n{done.stdout}{done.stderr}")

    return _made_once(config, f"prefect-{version('prefect')}.db", make)


# The session servers' loop services that no test of theirs uses (they serve no deployment, schedule,
# worker, pause or automation; the stacks' servers keep every service): off, they cost an idle
# server 1.1 CPU s a minute against 1.9 (docs/benchmarks/test-suite.md). The event persister and
# the task-run recorder stay, and the cancellation clean-up, which ends a cancelled run's children.
IDLE_LOOPS_OFF = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in (
        "SCHEDULER",
        "LATE_RUNS",
        "PAUSE_EXPIRATIONS",
        "FOREMAN",
        "REPOSSESSOR",
        "TRIGGERS",
        "CLEANUP_RECONCILER",
    )
}


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory, pytestconfig):
    """One real Prefect server per test process (an xdist worker), for the flows it runs and for
    every CLI command it starts: a command with no PREFECT_API_URL starts a temporary server of its
    own, which cost 40-70 s a command at load 6 here against 28 s with this one. A test that is
    about that temporary server, or reads Prefect's own database, sets PREFECT_API_URL="" for its
    command (an empty value names no server) and gives it a PREFECT_HOME of its own."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from servers import background, quiet_env

    from flows.stack.processes import free_port

    folder = tmp_path_factory.mktemp("prefect-server")
    SESSION_PREFECT_SERVER.append(folder)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    cmd = [
        str(Path(sys.executable).with_name("prefect")),
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**quiet_env(folder / "home"), **IDLE_LOOPS_OFF}
    env.pop("PREFECT_API_URL")  # the server's own: this process's says "none yet"
    Path(env["PREFECT_HOME"]).mkdir()
    shutil.copyfile(_migrated_prefect_database(pytestconfig), Path(env["PREFECT_HOME"]) / "prefect.db")
    server = background(cmd, f"{api}/health", folder / "prefect-server.log", env)
    before = os.environ.get("PREFECT_API_URL")
    try:
        server.wait_ready(180)
        _keep_a_new_database(folder / "home" / "prefect" / "prefect.db", folder / "new-prefect.db")
        os.environ["PREFECT_API_URL"] = api
        with temporary_settings({PREFECT_API_URL: api}):
            yield api
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before
        _drain_prefect_clients()
        server.stop()


def _drain_prefect_clients() -> None:
    """Send the logs and events the tests' flows left queued while the server still answers: a
    batch left for exit meets a stopped server and its client's retries held the process about
    4.5 minutes before it could end."""
    for module, name in (("prefect.logging.handlers", "APILogWorker"), ("prefect.events.worker", "EventsWorker")):
        if module in sys.modules:
            getattr(sys.modules[module], name).drain_all(timeout=60)


def _keep_a_new_database(database: Path, copy: Path) -> None:
    """A copy of the session server's database as its start-up left it (migrated, Prefect's block
    types registered), for `temporary_server_home`. SQLite's backup: a consistent copy while the
    server has it open."""
    import sqlite3

    with sqlite3.connect(database) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    src.close()
    dst.close()


@pytest.fixture(scope="session")
def empty_mlflow_store(pytestconfig) -> bytes:
    """The bytes of a new, empty MLflow SQLite store. MLflow makes one by running every migration
    of its schema (5 s here, against 0.01 s to open one that exists); made once, copied per test."""

    def make(path: Path) -> None:
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{path}").search_experiments()

    return _made_once(pytestconfig, f"mlflow-{version('mlflow')}.db", make).read_bytes()


@pytest.fixture(autouse=True)
def _terminal_filter_reset() -> Iterator[None]:
    """A command run in this process (not forked) may leave the terminal's filter of Prefect's
    lines set ("a user error was said: quiet from now on"); a process per command never reuses it."""
    yield
    if "flows.cli.terminal" in sys.modules:
        quiet = sys.modules["flows.cli.terminal"]._quiet
        quiet.failed = quiet.terse = quiet.silent = False


@pytest.fixture
def own_mlflow_store(tmp_path: Path, monkeypatch, empty_mlflow_store: bytes) -> None:
    """Each test its own MLflow store, empty: a champion registered by one test must not make
    another skip its training. (`own_stores` gives a store that does not exist yet.)"""
    (tmp_path / "mlflow-store").mkdir()
    (tmp_path / "mlflow-store" / "mlflow.db").write_bytes(empty_mlflow_store)
    if "mlflow" in sys.modules:  # an earlier test's set_tracking_uri outlives it and wins over the variable
        sys.modules["mlflow"].set_tracking_uri(None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow-store' / 'mlflow.db'}")


@pytest.fixture
def own_stores(tmp_path: Path) -> tuple[dict[str, str], Path, Path, Path]:
    """A Prefect home, an MLflow store and a storage root of this test's own. Commands use the
    session's Prefect server; a test that reads Prefect's database sets env["PREFECT_API_URL"] = ""
    (a temporary server of its own, in `prefect`)."""
    prefect, mlflow, storage = tmp_path / "prefect", tmp_path / "mlflow", tmp_path / "storage"
    mlflow.mkdir()
    env = {
        "PREFECT_HOME": str(prefect),
        "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow / 'mlflow.db'}",
        "MLLM_STORAGE": str(storage),
    }
    return env, prefect, mlflow, storage


class _BasicAuth(http.server.SimpleHTTPRequestHandler):
    expected = ""

    def do_GET(self):
        if self.headers.get("Authorization") != self.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="corpus"')
            self.end_headers()
            return
        super().do_GET()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def basic_auth_server(tmp_path: Path):
    """A real HTTP server on loopback that serves a folder only to reader:PASSWORD."""
    folder = tmp_path / "www"
    folder.mkdir()
    handler = type(
        "Handler", (_BasicAuth,), {"expected": "Basic " + base64.b64encode(f"reader:{PASSWORD}".encode()).decode()}
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, server.server_address[1]
    server.shutdown()
    server.server_close()


class _Failing(http.server.BaseHTTPRequestHandler):
    hits: list[str]

    def do_GET(self):
        self.hits.append(self.path)
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_server():
    """A real HTTP server on loopback that answers every request 500 (a server whose database is
    down), and the paths it was asked for, in order."""
    hits: list[str] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Failing,), {"hits": hits}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
