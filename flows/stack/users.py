"""The secured stack's users file, `<home>/auth/users.json`: each user's role and secret, and the
secrets of MLflow's own admin and of its CSRF tokens."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from flows.settings import settings
from mllm import UserError

ROLES = ("admin", "worker", "viewer")
STACK_ADMIN = "stack-admin"  # the stack's own checks (readiness, slots, in-flight runs)
STACK_WORKER = "stack-worker"  # the stack's own process worker
MLFLOW_ADMIN = "mlflow-admin"  # MLflow's own admin: made at its first start, used to sync users
BUILT_IN = (STACK_ADMIN, STACK_WORKER)
INSTALL = "apt-get install caddy"


def folder(home: Path) -> Path:
    return home / "auth"


# -- files only their owner reads ------------------------------------------------------------


def private(path: Path, data: str | bytes) -> Path:
    """Write `data` atomically to `path`, readable by its owner only (0600) from the start."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)
    return path


# -- users -------------------------------------------------------------------------------------


def _users_file(home: Path) -> Path:
    return folder(home) / "users.json"


def read_users(home: Path) -> dict:
    try:
        data = json.loads(_users_file(home).read_text())
    except FileNotFoundError:
        data = {}
    return {
        "users": data.get("users", {}),
        "mlflow_admin": data.get("mlflow_admin"),
        "flask_key": data.get("flask_key"),
        "removed": data.get("removed", []),
    }


def _write_users(home: Path, data: dict) -> None:
    private(_users_file(home), json.dumps(data, indent=1) + "\n")


def bcrypt_hash(secret: str) -> str:
    """Caddy's own bcrypt hash of `secret`, given on stdin (never on a command line)."""
    caddy = caddy_binary()
    done = subprocess.run([caddy, "hash-password"], input=secret + "\n", capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.startswith("$2"):
        raise RuntimeError(f"caddy hash-password failed: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def caddy_binary() -> str:
    found = settings().caddy or shutil.which("caddy")
    if not found:
        raise UserError(
            f"a secured stack (--listen ADDRESS or --auth) puts Caddy in front of its servers, and "
            f"Caddy is not installed: `{INSTALL}` installs it (Debian's 2.6 will do)"
        )
    return found


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or len(name) > 64:
        raise UserError(f"user name {name!r}: use letters, digits, '-', '_' or '.' (at most 64)")


def add_user(home: Path, name: str, role: str, built_in: bool = False, pools: list[str] | None = None) -> str:
    """A new user with a new random secret; the secret. A worker given `pools` is bound to them:
    it serves, claims and starts runs of those pools only (flows/stack/gate.py)."""
    _check_name(name)
    if role not in ROLES:
        raise UserError(f"--role {role!r}: give one of {', '.join(ROLES)}")
    if pools and role != "worker":
        raise UserError(f"--pool binds a worker to pools: give it with --role worker, not {role}")
    data = read_users(home)
    if name in data["users"]:
        raise UserError(
            f"user {name!r} exists already: `mllm-pipeline stack user rotate {name}` gives it a new "
            f"secret, `stack user remove {name}` removes it"
        )
    if name in BUILT_IN + (MLFLOW_ADMIN,) and not built_in:
        raise UserError(f"user name {name!r} is the stack's own: choose another")
    secret = secrets.token_urlsafe(32)
    data["users"][name] = {"role": role, "secret": secret, "hash": bcrypt_hash(secret)}
    if pools:
        data["users"][name]["pools"] = sorted(set(pools))
    data["removed"] = [n for n in data["removed"] if n != name]
    _write_users(home, data)
    return secret


def rotate_user(home: Path, name: str) -> str:
    data = read_users(home)
    if name not in data["users"]:
        raise UserError(f"no user {name!r}: `mllm-pipeline stack user list` shows them")
    secret = secrets.token_urlsafe(32)
    data["users"][name].update(secret=secret, hash=bcrypt_hash(secret))
    _write_users(home, data)
    return secret


def remove_user(home: Path, name: str) -> None:
    data = read_users(home)
    if name in BUILT_IN:
        raise UserError(
            f"{name!r} is the stack's own user (its worker's or its checks'): `stack user rotate "
            f"{name}` gives it a new secret"
        )
    if name not in data["users"]:
        raise UserError(f"no user {name!r}: `mllm-pipeline stack user list` shows them")
    del data["users"][name]
    data["removed"] = sorted({*data["removed"], name})  # MLflow's copy goes at the next sync
    _write_users(home, data)


def ensure_built_in(home: Path) -> None:
    """The stack's own users and MLflow's admin secret, made once."""
    data = read_users(home)
    for name, role in ((STACK_ADMIN, "admin"), (STACK_WORKER, "worker")):
        if name not in read_users(home)["users"]:
            add_user(home, name, role, built_in=True)
    data = read_users(home)
    if not data["mlflow_admin"] or not data["flask_key"]:
        data["mlflow_admin"] = data["mlflow_admin"] or secrets.token_urlsafe(32)
        data["flask_key"] = data["flask_key"] or secrets.token_urlsafe(32)  # MLflow's CSRF tokens
        _write_users(home, data)


def credential(home: Path, name: str) -> tuple[str, str]:
    user = read_users(home)["users"].get(name)
    if user is None:
        raise UserError(
            f"no user {name!r} in the stack in {home}: `mllm-pipeline stack user list` shows them, "
            f"`stack user add {name} --role worker` adds one"
        )
    return name, user["secret"]
