"""MLflow's side of a secured stack: its basic-auth app's configuration (no secret in it), the
server's options and environment, and MLflow's users kept equal to the stack's users file."""

from __future__ import annotations

import base64
import json
import urllib.parse
from pathlib import Path

from flows.stack.certs import hosts_for
from flows.stack.endpoints import secured
from flows.stack.processes import unix_request, unix_url
from flows.stack.users import MLFLOW_ADMIN, _write_users, folder, private, read_users


def basic(name: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{secret}".encode()).decode()


def _without_password(uri: str) -> str:
    parts = urllib.parse.urlsplit(uri)
    if not parts.password:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    user = urllib.parse.unquote(parts.username or "")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{urllib.parse.quote(user)}@{host}" if user else host))


def write_ini(home: Path, database_uri: str | None = None) -> Path:
    """MLflow's auth configuration, with no secret in it: its admin's password comes from the
    users file and the database's from the server's environment (server_env), so each secret
    stays in one file."""
    uri = _without_password(database_uri or f"sqlite:///{folder(home) / 'mlflow-auth.db'}")
    return private(
        folder(home) / "mlflow-auth.ini",
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = {uri}\nadmin_username = {MLFLOW_ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # A checked credential is remembered for 5 minutes: without this each request
        # pays a PBKDF2 check (about 250 ms of the server's CPU per log_batch, measured on
        # 2 busy cores). Its one server process forgets a user's entries the moment the
        # stack changes the password or deletes the user, so rotation still bites at once.
        "auth_cache_ttl_seconds = 300\n",
    )


def set_database(home: Path, mlflow_backend_uri: str | None) -> None:
    """MLflow's users on the stack's database: its tables beside MLflow's own (their migrations
    keep a version table of their own, alembic_version_auth)."""
    write_ini(home, mlflow_backend_uri)


def server_env(name: str, home: Path, backend_uri: str | None = None) -> dict[str, str]:
    """What a secured stack's server needs in its environment beyond the plain stack's (never
    saved: MLflow's admin password, and the database's password for its auth tables, which libpq
    takes from PGPASSWORD)."""
    ends = secured(home)
    if ends is None:
        return {}
    if name == "prefect-server":
        return {"PREFECT_UI_API_URL": ends["api"]}
    env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(folder(home) / "mlflow-auth.ini"),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": read_users(home)["flask_key"],
        "MLFLOW_AUTH_ADMIN_PASSWORD": read_users(home)["mlflow_admin"],
    }
    password = urllib.parse.urlsplit(backend_uri).password if backend_uri else None
    if password:
        env["PGPASSWORD"] = urllib.parse.unquote(password)
    return env


def mlflow_args(home: Path) -> list[str]:
    """The MLflow server's options on a secured stack: its basic-auth app, and the Host headers
    it takes (the proxy passes the client's: the listening address and this host's names)."""
    ends = secured(home)
    if ends is None:
        return []
    port = ends["ports"]["mlflow"]
    hosts = [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts_for(ends["listen"])]
    # The stack's own calls on its socket (sync_mlflow) say Host: localhost.
    return [
        "--app-name",
        "basic-auth",
        "--allowed-hosts",
        ",".join([*hosts, "localhost"]),
        "--uvicorn-opts",
        f"--uds {ends['sockets']['mlflow']}",
    ]


def _mlflow(home: Path, method: str, route: str, body: dict) -> int:
    """A call to MLflow's user API as its own admin, straight to the server's socket (the gate
    knows no such user)."""
    url = unix_url(secured(home)["sockets"]["mlflow"], f"/api/2.0/mlflow/users/{route}")
    data = json.dumps(body).encode()
    if method == "GET":
        url, data = url + "?" + urllib.parse.urlencode(body), None
    headers = {
        "Content-Type": "application/json",
        "Authorization": basic(MLFLOW_ADMIN, read_users(home)["mlflow_admin"]),
    }
    return unix_request(url, method, data, headers, timeout=30)[0]


def sync_mlflow(home: Path) -> None:
    """Make MLflow's users what the stack's users file says: each with its secret, the admins
    and workers MLflow admins, the removed ones gone."""
    data = read_users(home)
    for name, user in data["users"].items():
        if _mlflow(home, "GET", "get", {"username": name}) == 200:
            code = _mlflow(home, "PATCH", "update-password", {"username": name, "password": user["secret"]})
        else:
            code = _mlflow(home, "POST", "create", {"username": name, "password": user["secret"]})
        admin = _mlflow(home, "PATCH", "update-admin", {"username": name, "is_admin": user["role"] != "viewer"})
        if code != 200 or admin != 200:
            raise RuntimeError(f"MLflow's server did not take the stack's user {name!r} (HTTP {code}, {admin})")
    for name in data["removed"]:
        if _mlflow(home, "DELETE", "delete", {"username": name}) not in (200, 404):
            raise RuntimeError(f"MLflow's server did not delete the removed user {name!r}")
    if data["removed"]:
        data["removed"] = []
        _write_users(home, data)
