"""`mllm-pipeline stack up|down|status`: a Prefect server, a process worker and an MLflow server
on 127.0.0.1, for trying the whole system on one machine."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from flows import QUIET_ENV
from flows.stack import auth as stack_auth
from flows.stack import database, state
from flows.stack.orphans import crash_left_in_flight, crash_orphans
from flows.stack.pool_api import _open, _worker_online, set_slots
from flows.stack.pool_api import default_slots as default_slots
from flows.stack.pool_api import in_flight as in_flight
from flows.stack.pool_api import slots_of as slots_of
from flows.stack.pools import ensure_pool
from flows.stack.processes import _DIRECT, Service, descendants, free_port, port_free, tail, unix_url  # noqa: F401 (the stack's API)
from flows.stack.state import save, stack_home, state_file  # noqa: F401 (the stack's API)
from mllm import UserError, storage
from mllm.settings import environment

# -- the stack ---------------------------------------------------------------------------------


def load(home: Path) -> dict:
    """The stack's state (flows/stack/state.py); from then on a secured stack's own calls to its
    servers authenticate as its admin."""
    found = state.load(home)
    if found["services"]:
        stack_auth.register(home)
    return found


def _port(wanted: int, what: str, option: str) -> int:
    if wanted == 0:
        return free_port()
    if not port_free(wanted):
        raise UserError(
            f"port {wanted} for the {what} is taken: choose another with {option} PORT (0 picks a free one)"
        )
    return wanted


def _quiet_env(home: Path) -> dict[str, str]:
    # This shell's own setting of one of them wins.
    here = environment()
    return {
        **{k: here.get(k, v) for k, v in QUIET_ENV.items()},
        "PREFECT_HOME": str(home / "prefect"),
        # The MLflow job runner starts a dozen processes for GenAI jobs this stack never runs.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }


def _server_env(name: str, home: Path, api: str, db) -> dict[str, str]:
    """A server's environment beyond this shell's: never saved (the database's may hold a password)."""
    if name == "prefect-server":
        return {**_quiet_env(home), "PREFECT_UI_API_URL": api, **db.prefect_env, **stack_auth.server_env(name, home)}
    mlflow_env = _quiet_env(home)
    here = environment()
    if here.get("AWS_ENDPOINT_URL") and not here.get("MLFLOW_S3_ENDPOINT_URL"):
        mlflow_env["MLFLOW_S3_ENDPOINT_URL"] = here["AWS_ENDPOINT_URL"]
    return {
        **mlflow_env,
        **db.mlflow_env,
        **stack_auth.server_env(name, home, db.mlflow_env.get("MLFLOW_BACKEND_STORE_URI")),
    }


def up(
    home: Path,
    storage_root: str,
    pool: str = "local",
    prefect_port: int = 4200,
    mlflow_port: int = 5000,
    worker_env: dict[str, str] | None = None,
    timeout: float = 180.0,
    database_url: str | None = None,
    slots: int | None = None,
    listen: str = "127.0.0.1",
    auth: bool = False,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    local_worker: bool | None = None,
) -> dict:
    """Start the stack, or what of it is not running, and return its state (services, env, and
    the names of the services `restarted` and of those `reused` as they ran). What runs is reused; a
    service that died is started again with its recorded command (its port, so its URL holds),
    the options for a new stack (ports, pool, storage, database) then do not apply. `slots`: the
    pool's concurrency limit (None: no limit on a new stack, the limit unchanged on a running
    one; the CLI gives its default). `listen` other than loopback, or `auth`: the servers behind
    a TLS proxy that checks each user (flows/stack/auth.py). `local_worker`: whether a worker of
    the pool runs here (None: on a loopback stack only; a secured stack's flow runs would run as
    the stack's user, beside its keys)."""
    state = load(home)
    if any(s.alive() for s in state["services"]):
        return _up_again(home, state, database_url, timeout, slots, local_worker)
    prefect_port = _port(prefect_port, "Prefect server", "--prefect-port")
    mlflow_port = _port(mlflow_port, "MLflow server", "--mlflow-port")
    # -- the database (flows/stack/database.py): PostgreSQL started here, or SQLite ------------------

    home.mkdir(parents=True, exist_ok=True)
    db = database.choose(home, database_url, timeout)
    db.record(home)
    # -- a secured stack (flows/stack/auth.py): servers on loopback behind the TLS proxy ---------
    ends = stack_auth.setup(home, listen, auth, prefect_port, mlflow_port, tls_cert, tls_key, db)
    api, tracking = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    env = {"PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": tracking, "MLLM_STORAGE": storage_root}
    if ends:
        env = {**env, **stack_auth.public_env(home)}
    services = _server_services(
        home, db, env, prefect_port, mlflow_port, storage.join(storage_root, "mlflow-artifacts")
    )
    extra = {"pool": pool, "storage": storage_root, "worker_env": worker_env or {}}
    started: list[Service] = list(db.services)  # the database's server, already running
    try:
        for s in services:
            started.append(s.start())
        save(home, started, env, **extra)
        for s in services:
            s.wait_ready(timeout)
        if ends:
            started.extend(stack_auth.start_proxy(home, timeout))
            save(home, started, env, **extra)
        api = env["PREFECT_API_URL"]
        ensure_pool(api, pool, _open)
        if local_worker or (local_worker is None and not ends):
            start_worker(home, timeout)
        set_slots(api, pool, slots)
    except BaseException:
        for s in reversed(load(home)["services"] or started):
            s.stop()
        state_file(home).unlink(missing_ok=True)
        raise
    return {**load(home), "restarted": [], "reused": [], "crashed": _crash_orphans(api, pool), **_crash_left(api, home)}


def _up_again(
    home: Path, state: dict, database_url: str | None, timeout: float, slots: int | None, local_worker: bool | None
) -> dict:
    """`up` on a running stack: what of it is down started again, what runs reused."""
    restarted = _restart_servers(home, state, database_url, timeout) + _restart_proxy(home, timeout)
    had = [s for s in state["services"] if s.name == "worker"]
    if (had or local_worker) and not any(s.alive() for s in had):
        start_worker(home, timeout)
        restarted.append("worker")
    set_slots(state["env"]["PREFECT_API_URL"], state["pool"], slots)
    now = load(home)
    return {
        **now,
        "restarted": restarted,
        "reused": [s.name for s in now["services"] if s.name not in restarted],
        "crashed": _crash_orphans(state["env"]["PREFECT_API_URL"], state["pool"]),
        **_crash_left(state["env"]["PREFECT_API_URL"], home),
    }


def _server_services(
    home: Path, db, env: dict[str, str], prefect_port: int, mlflow_port: int, artifacts: str
) -> list[Service]:
    """The Prefect and MLflow servers: on 127.0.0.1, or on a secured stack on Unix sockets in a
    0700 folder only (flows/stack/auth.py), where nothing unauthenticated listens on TCP."""
    logs, py = home / "logs", sys.executable
    ends = stack_auth.secured(home)
    if ends:
        socks = ends["sockets"]
        prefect_cmd = [py, "-m", "flows.stack.prefect_server", "uds", socks["prefect"]]
        where = {
            "prefect": (unix_url(socks["prefect"], "/api/health"), f"unix:{socks['prefect']}"),
            "mlflow": (unix_url(socks["mlflow"], "/health"), f"unix:{socks['mlflow']}"),
        }
    else:
        prefect_cmd = [
            py,
            "-m",
            "flows.stack.prefect_server",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(prefect_port),
        ]
        where = {
            "prefect": (f"http://127.0.0.1:{prefect_port}/api/health", f"http://127.0.0.1:{prefect_port}"),
            "mlflow": (f"http://127.0.0.1:{mlflow_port}/health", f"http://127.0.0.1:{mlflow_port}"),
        }
    return [
        Service(
            "prefect-server",
            prefect_cmd,
            str(logs / "prefect-server.log"),
            *where["prefect"],
            env=_server_env("prefect-server", home, env["PREFECT_API_URL"], db),
        ),
        Service(
            "mlflow-server",
            [
                py,
                "-m",
                "mlflow",
                "server",
                *db.mlflow_args,
                "--artifacts-destination",
                artifacts,
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--workers",
                "1",
                *stack_auth.mlflow_args(home),
            ],
            str(logs / "mlflow-server.log"),
            *where["mlflow"],
            env=_server_env("mlflow-server", home, env["PREFECT_API_URL"], db),
        ),
    ]


def _crash_orphans(api: str, pool: str) -> list[str]:
    """The pool's flow runs left in flight by a process that is gone, marked Crashed (flows/stack/orphans.py)."""

    try:
        return crash_orphans(api, pool)
    except Exception:  # noqa: BLE001 (the stack runs; a run left Running is no reason to fail `up`)
        return []


def _crash_left(api: str, home: Path) -> dict[str, list[str]]:
    """The flow runs that commands ended by the database's outage left in flight, marked Crashed
    ("closed"), and the trainings they left queued on the pool, cancelled ("cancelled")."""
    try:
        closed, cancelled = crash_left_in_flight(api, home)
    except Exception:  # noqa: BLE001 (as above)
        closed, cancelled = [], []
    return {"closed": closed, "cancelled": cancelled}


def _restart_servers(home: Path, state: dict, database_url: str | None, timeout: float) -> list[str]:
    """Start again the database's server and the Prefect and MLflow servers of a running stack
    that are down (a server that runs but does not answer is stopped first); the names of those
    started. A database that comes back on another port takes both servers with it."""

    services = state["services"]
    cluster = next((s for s in services if s.name == "postgres"), None)
    down = [s for s in services if s.name in ("prefect-server", "mlflow-server") and not s.healthy()]
    if not down and (cluster is None or cluster.alive()):
        return []
    was = database.recorded(home).get("database")
    db = database.reopen(home, database_url, timeout, start=cluster is not None and not cluster.alive())
    restarted = [s.name for s in db.services]
    if db.describe != was:  # the cluster is on another port now
        down = [s for s in services if s.name in ("prefect-server", "mlflow-server")]
    db.record(home)
    new = {s.name: s for s in db.services}
    try:
        for old in down:
            old.stop()
            port = None if old.url.startswith("unix:") else int(old.url.rsplit(":", 1)[1])
            if port is not None and not port_free(port):
                raise UserError(
                    f"port {port} of the stack's {old.name} is taken by another process: stop that, or "
                    "start the stack on other ports (`mllm-pipeline stack down`, then `stack up "
                    "--prefect-port PORT --mlflow-port PORT`)"
                )
            new[old.name] = Service(
                old.name,
                old.cmd,
                old.log,
                old.health_url,
                old.url,
                env=_server_env(old.name, home, state["env"]["PREFECT_API_URL"], db),
            ).start()
            restarted.append(old.name)
        save(
            home,
            [new.get(s.name, s) for s in services],
            state["env"],
            state["pool"],
            state["storage"],
            state.get("worker_env", {}),
        )
        for old in down:
            new[old.name].wait_ready(timeout)
    except BaseException:
        for name in restarted:
            if name != "postgres":  # the database runs for what already ran: keep it
                new[name].stop()
        raise
    return restarted


def _restart_proxy(home: Path, timeout: float) -> list[str]:
    """Start again a secured stack's gate and proxy when either is down (flows/stack/auth.py)."""
    state = load(home)
    front = [s for s in state["services"] if s.name in ("gate", "proxy")]
    if not front or all(s.alive() for s in front):
        return []
    for s in front:
        s.stop()  # what is left of its process group
    new = {s.name: s for s in stack_auth.start_proxy(home, timeout)}
    kept = [s for s in state["services"] if s.name not in new]
    save(home, [*kept, *new.values()], state["env"], state["pool"], state["storage"], state.get("worker_env", {}))
    return list(new)


def start_worker(home: Path, timeout: float = 180.0) -> Service:
    """Start the stack's process worker (again) and wait until the server sees it online."""
    state = load(home)
    env, pool = state["env"], state["pool"]
    worker = Service(
        "worker",
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            pool,
            "--type",
            "process",
            "--name",
            f"{pool}-{socket.gethostname()}",
        ],
        str(home / "logs" / "worker.log"),
        None,
        f"pool {pool!r} (process)",
        env={
            **_quiet_env(home),
            **env,
            "PREFECT_HOME": str(home / "worker"),
            **state.get("worker_env", {}),
            **_worker_secrets(home),
        },
    )
    services = [s for s in state["services"] if s.name != "worker"]
    worker.start()
    save(home, [*services, worker], env, pool, state["storage"], state.get("worker_env", {}))
    worker.wait_ready(timeout, ready=lambda: _worker_online(env["PREFECT_API_URL"], pool, worker.pid))
    return worker


def _worker_secrets(home: Path) -> dict[str, str]:
    """A secured stack's worker's credentials (in its environment only, never saved)."""
    return stack_auth.client_env(home, stack_auth.STACK_WORKER) if stack_auth.secured(home) else {}


def down(home: Path, force: bool = False) -> list[tuple[str, bool]]:
    """Stop what `up` started: (service, whether it was running) for each. Refused while flow
    runs on the stack's Prefect server are in flight (they would crash with it), unless `force`."""
    state = load(home)
    busy = [] if force else in_flight(state)
    if busy:
        more = f" and {len(busy) - 5} more" if len(busy) > 5 else ""
        raise UserError(
            f"flow runs use the stack: {', '.join(busy[:5])}{more}; let them finish (or cancel them), "
            "or stop the stack under them with `mllm-pipeline stack down --force`"
        )
    result = [(s.name, s.stop()) for s in reversed(state["services"])]
    state_file(home).unlink(missing_ok=True)
    return result


def status(home: Path) -> list[tuple[Service, bool]]:
    return [(s, s.healthy()) for s in load(home)["services"]]
