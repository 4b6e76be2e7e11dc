"""PostgreSQL for the stack: where its server's binaries are, the user the stack's own cluster runs
as, that cluster made once with initdb, and the stack's databases created on a server."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path

from flows.settings import settings
from flows.stack.processes import free_port
from mllm import UserError

ROLE = "mllm"


def server_bin() -> Path | None:
    """The folder of PostgreSQL's server binaries: $MLLM_POSTGRES_BIN, Debian's newest
    /usr/lib/postgresql/N/bin, or wherever `initdb` is on PATH."""
    if given := settings().postgres_bin:
        return Path(given)
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if debian:
        return debian[-1].parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def owner() -> str | None:
    """The user the cluster runs as: None for this process's own user, `postgres` (or
    $MLLM_POSTGRES_USER) when this process is root."""
    return settings().postgres_user if os.geteuid() == 0 else None


def as_owner(cmd: list[str]) -> list[str]:
    user = owner()
    return ["runuser", "-u", user, "--", *cmd] if user else cmd


def create_databases(
    user: str,
    password: str,
    host: str,
    port: int,
    name: str,
    shown: str,
    suffixes: tuple[str, ...] = ("prefect", "mlflow"),
    hint: str = "check --database-url",
) -> None:
    """Create `<name>_prefect` and `<name>_mlflow` (or the other `suffixes`) where missing; one
    clear line if the server cannot be reached or refuses."""
    import psycopg

    wanted = [f"{name}_{s}" for s in suffixes]
    try:
        with psycopg.connect(
            host=host, port=port, user=user, password=password, dbname="postgres", connect_timeout=10, autocommit=True
        ) as conn:
            have = {r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", [wanted])}
            for db in wanted:
                if db not in have:
                    try:
                        conn.execute(f'CREATE DATABASE "{db}"')
                    except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                        pass  # another process (a second search started at once) made it first
    except psycopg.Error as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UserError(
            f"the database server {shown} did not take the stack's databases {', '.join(wanted)}: "
            f"{reason} ({hint}; the role needs CREATEDB, or create them)"
        ) from None


def _private(path: Path, text: str, user: str | None = None) -> Path:
    """Write `text` to a file only its owner (this process's user, or `user`) can read."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    if user:
        os.chown(path, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
    return path


def _accepts(binaries: Path, port: int) -> bool:
    return (
        subprocess.run(
            [str(binaries / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ).returncode
        == 0
    )


def _init(folder: Path, binaries: Path) -> str | None:
    """initdb a cluster in `folder`/data with the role `mllm` and a new password; a reason to
    stay on SQLite if the cluster's user cannot have it."""
    user = owner()
    if user:
        try:
            uid, gid = pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid
        except KeyError:
            return (
                f"PostgreSQL refuses to run as root and there is no user {user!r} to run it as, so the stack "
                "runs on SQLite: create that user (or set MLLM_POSTGRES_USER) and start a new stack"
            )
    folder.mkdir(parents=True, exist_ok=True)
    if user:
        os.chown(folder, uid, gid)
        reach = subprocess.run(as_owner(["test", "-w", str(folder)]), capture_output=True)
        if reach.returncode != 0:
            folder.rmdir()
            return (
                f"user {user!r}, who runs PostgreSQL, cannot reach {folder} (a folder above it is private), "
                "so the stack runs on SQLite: give --home in a folder that user can enter"
            )
    password = secrets.token_urlsafe(24)
    secret = _private(folder / "password", password)
    # initdb reads the role's password from a file (never a command line); the cluster's user
    # reads it from a copy of its own that is gone once the cluster exists.
    copy = _private(folder / "initdb-password", password, user)
    try:
        done = subprocess.run(
            as_owner(
                [
                    str(binaries / "initdb"),
                    "-D",
                    str(folder / "data"),
                    "-U",
                    ROLE,
                    f"--pwfile={copy}",
                    "--auth=scram-sha-256",
                    "-E",
                    "UTF8",
                    "--no-locale",
                ]
            ),
            text=True,
            capture_output=True,
        )
    finally:
        copy.unlink(missing_ok=True)
    if done.returncode != 0:
        shutil.rmtree(folder / "data", ignore_errors=True)
        secret.unlink()
        raise UserError(
            f"initdb could not create the stack's PostgreSQL cluster in {folder}: "
            f"{' '.join(done.stderr.split())[-400:]}"
        )
    (folder / "cluster.json").write_text(json.dumps({"port": free_port(), "role": ROLE}) + "\n")
    return None
