"""The stack's database, PostgreSQL (its own cluster or a team's server) or SQLite files: where the
Prefect server and MLflow's backend store keep their records (docs/stack.md)."""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from flows.settings import settings
from flows.stack import state
from flows.stack.postgres import ROLE, _accepts, _init, as_owner, create_databases, server_bin
from flows.stack.postgres import owner as owner
from flows.stack.processes import Service, free_port, port_free
from mllm import UserError, failures
from tasks.tracking import servers as tracking_servers

DEFAULT_NAME = "mllm"
INSTALL = "apt-get install postgresql"  # Debian/Ubuntu; the command the SQLite line names


@dataclass
class Database:
    """What the stack's servers need: `services` to start before them (the cluster's server),
    the Prefect server's and the MLflow server's environment, and a line for the user."""

    describe: str
    services: list[Service] = field(default_factory=list)
    prefect_env: dict[str, str] = field(default_factory=dict, repr=False)
    mlflow_env: dict[str, str] = field(default_factory=dict, repr=False)
    mlflow_args: list[str] = field(default_factory=list)  # no secret: these are saved in stack.json
    note: str | None = None  # why it is on SQLite, and how to change that

    def record(self, home: Path) -> None:
        (home / "database.json").write_text(json.dumps({"database": self.describe, "note": self.note}) + "\n")


def recorded(home: Path) -> dict:
    try:
        return json.loads((home / "database.json").read_text())
    except (OSError, ValueError):
        return {}


def choose(home: Path, url: str | None = None, timeout: float = 60.0) -> Database:
    """The stack's database, its PostgreSQL server started and its two databases there."""
    if url:
        return _given(url)
    cluster = home / "postgres"
    sqlite = home / "mlflow.db"
    if sqlite.exists() and not (cluster / "data").exists():
        return _sqlite(
            home,
            f"this stack's records are in SQLite files in {home}; they stay there (a new --home starts on PostgreSQL)",
        )
    binaries = server_bin()
    if binaries is None:
        return _sqlite(
            home,
            f"PostgreSQL's server is not installed, so the stack runs on SQLite (fine for one "
            f"user, not for a team's load): `{INSTALL}` installs it",
        )
    return _cluster(home, binaries, timeout)


def reopen(home: Path, url: str | None, timeout: float, start: bool) -> Database:
    """The database of a stack that runs, for a server of it started again: its cluster's server
    started again too when `start`. A team's server takes its URL again: its password is kept
    nowhere the stack could read it back."""
    was = recorded(home)
    describe = was.get("database", "")
    if describe.startswith("PostgreSQL at "):
        if not url:
            raise UserError(
                f"the stack keeps its records on {describe.split(' (')[0][len('PostgreSQL at ') :]}, "
                "whose password it does not keep: give it again with `mllm-pipeline stack up "
                "--database-url postgresql://USER:PASSWORD@HOST:PORT/NAME`"
            )
        db = _given(url)
    elif describe.startswith("PostgreSQL "):
        binaries = server_bin()
        if binaries is None:
            raise UserError(
                f"the stack's records are in its PostgreSQL cluster in {home / 'postgres'}, but "
                f"PostgreSQL's server is no longer installed: `{INSTALL}` installs it"
            )
        db = _cluster(home, binaries, timeout, start=start)
    else:
        db = _sqlite(home, None)
    db.note = was.get("note")
    return db


DOWN = "the database of the Prefect and MLflow servers is down"


def down_line(exc: BaseException | None) -> str | None:
    """One line when `exc` is a server's failure because the Prefect and MLflow servers' database
    is down (not the asyncpg or psycopg tracebacks the servers log), naming the stack's database
    when $PREFECT_API_URL is the stack's in $MLLM_STACK_HOME (or ./.mllm-stack); else None."""

    if exc is None or not (failures.server_error(exc) or tracking_servers.tracking_down(exc)):
        return None
    api = tracking_servers.prefect_database_down()
    if api is None:
        return None
    home = state.stack_home()
    ours = state.load(home)["env"].get("PREFECT_API_URL", "").rstrip("/") == api
    what = f"the stack's {recorded(home).get('database')}" if ours and recorded(home) else "their database"
    return (
        f"{DOWN} ({what}; the Prefect server {api} answers "
        "'Database is not available'): start it again (`mllm-pipeline stack up` starts what of the stack is "
        "down) and run the same command; finished stages and trainings are kept in storage and reused"
    )


def _sqlite(home: Path, note: str | None) -> Database:
    return Database(
        f"SQLite in {home}", mlflow_args=["--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}"], note=note
    )


def _urls(user: str, password: str, host: str, port: int, name: str) -> tuple[str, str]:
    cred = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@"
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    return (f"postgresql+asyncpg://{cred}{where}/{name}_prefect", f"postgresql+psycopg://{cred}{where}/{name}_mlflow")


def _database(describe: str, urls: tuple[str, str], services: list[Service] = ()) -> Database:
    prefect, mlflow = urls
    return Database(
        describe,
        list(services),
        prefect_env={"PREFECT_SERVER_DATABASE_CONNECTION_URL": prefect},
        mlflow_env={"MLFLOW_BACKEND_STORE_URI": mlflow},
    )


# -- a team's server -----------------------------------------------------------------------------


def _given(url: str) -> Database:
    user, password, host, port, name = _parts(url, "--database-url")
    shown = f"postgresql://{user}@{host}:{port}"
    create_databases(user, password, host, port, name, shown)
    return _database(
        f"PostgreSQL at {shown} (databases {name}_prefect, {name}_mlflow)", _urls(user, password, host, port, name)
    )


def _parts(url: str, option: str) -> tuple[str, str, str, int, str]:
    """A PostgreSQL URL's user, password, host, port and name, or one line naming `option`."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.split("+")[0]
    if scheme not in ("postgresql", "postgres") or not parts.hostname:
        raise UserError(f"{option} takes a PostgreSQL server's URL: postgresql://USER:PASSWORD@HOST:PORT/NAME")
    if parts.query or parts.fragment:
        raise UserError(f"{option} takes no ?options: give postgresql://USER:PASSWORD@HOST:PORT/NAME")
    user = urllib.parse.unquote(parts.username or "")
    if not user:
        raise UserError(f"{option} names no user: give postgresql://USER:PASSWORD@HOST:PORT/NAME")
    try:
        port = parts.port or 5432
    except ValueError:
        raise UserError(
            f"{option} has a bad port: give postgresql://USER:PASSWORD@{parts.hostname}:PORT/NAME"
        ) from None
    return user, urllib.parse.unquote(parts.password or ""), parts.hostname, port, parts.path.strip("/") or DEFAULT_NAME


STUDY_ENV = "MLLM_STUDY_DATABASE"


def study_database() -> tuple[str, str] | None:
    """Where searches keep their Optuna studies so that several, on this machine or others, share
    one: the server in $MLLM_STUDY_DATABASE (postgresql://USER:PASSWORD@HOST:PORT/NAME), else the
    cluster of the stack that $PREFECT_API_URL belongs to (in $MLLM_STACK_HOME or ./.mllm-stack);
    its database `<NAME>_optuna` created where missing. The SQLAlchemy URL (with the password: for
    the storage only) and a line that names it without the password; None on neither (SQLite)."""
    given = settings().study_database
    if given:
        user, password, host, port, name = _parts(given, f"${STUDY_ENV}")
    else:
        home = state.stack_home()
        api = settings().prefect_api_url.rstrip("/")
        describe = recorded(home).get("database", "")
        if (
            not api
            or state.load(home)["env"].get("PREFECT_API_URL", "").rstrip("/") != api
            or not describe.startswith("PostgreSQL ")
            or describe.startswith("PostgreSQL at ")
        ):
            return None  # no stack, another's, on SQLite, or a team's server whose password it does not keep
        folder = home / "postgres"
        user, host, name = ROLE, "127.0.0.1", DEFAULT_NAME
        port = json.loads((folder / "cluster.json").read_text())["port"]
        password = (folder / "password").read_text().strip()
    shown = f"postgresql://{user}@{host}:{port}/{name}_optuna"
    create_databases(
        user,
        password,
        host,
        port,
        name,
        shown,
        suffixes=("optuna",),
        hint=f"check ${STUDY_ENV}" if given else "start the stack again: `mllm-pipeline stack up`",
    )
    cred = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@"
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    return f"postgresql+psycopg://{cred}{where}/{name}_optuna", shown


# -- the stack's own cluster ---------------------------------------------------------------------


def _cluster(home: Path, binaries: Path, timeout: float, start: bool = True) -> Database:
    """The stack's cluster, its server started (on its port, or a free one if that is taken),
    or as it runs (`start` False)."""
    folder = home / "postgres"
    data, info_file, password_file = folder / "data", folder / "cluster.json", folder / "password"
    if not (data / "PG_VERSION").exists():
        note = _init(folder, binaries)
        if note:
            return _sqlite(home, note)
    info = json.loads(info_file.read_text())
    password = password_file.read_text().strip()
    version = (data / "PG_VERSION").read_text().strip()
    if not start:
        return _database(
            f"PostgreSQL {version} in {folder} on 127.0.0.1:{info['port']}",
            _urls(ROLE, password, "127.0.0.1", info["port"], DEFAULT_NAME),
        )
    port = info["port"] if port_free(info["port"]) else free_port()
    if port != info["port"]:
        info_file.write_text(json.dumps({**info, "port": port}) + "\n")
    server = Service(
        "postgres",
        as_owner(
            [
                str(binaries / "postgres"),
                "-D",
                str(data),
                "-p",
                str(port),
                "-h",
                "127.0.0.1",
                "-c",
                "unix_socket_directories=",
            ]
        ),
        str(home / "logs" / "postgres.log"),
        url=f"postgresql://{ROLE}@127.0.0.1:{port}",
    )
    server.start()
    try:
        server.wait_ready(timeout, ready=lambda: _accepts(binaries, port))
        create_databases(ROLE, password, "127.0.0.1", port, DEFAULT_NAME, server.url)
    except BaseException:
        server.stop()
        raise
    return _database(
        f"PostgreSQL {version} in {folder} on 127.0.0.1:{port}",
        _urls(ROLE, password, "127.0.0.1", port, DEFAULT_NAME),
        [server],
    )
