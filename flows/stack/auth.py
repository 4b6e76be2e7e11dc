"""The stack's users, roles, certificates and TLS proxy: what makes a stack reachable from other
machines (`stack up --listen ADDRESS`, or `--auth` on loopback).

Caddy (Debian's 2.6) terminates TLS on the listening address, one endpoint per server, answers a
foreign Host with 421 and hands every request over a Unix socket to the gate
(flows/stack/gate.py), which checks each user's credential and the policy of
flows/stack/policy.py. The Prefect and MLflow servers listen on Unix sockets in a 0700 folder
only. MLflow runs its basic-auth app and checks the same credentials again: MLflow's users are
the stack's users with the same secrets (stack `admin` and `worker` users are MLflow admins,
`viewer` users plain ones with MLflow's default READ).

Prefect's own `PREFECT_SERVER_API_AUTH_STRING` stays off: its one string cannot tell users
apart; the gate takes the subscribers' in-message token itself.

The users and their secrets: flows/stack/users.py; the certificates: flows/stack/certs.py.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from flows.stack.certs import Certs, certificates, hosts_for
from flows.stack.processes import _DIRECT, Service, unix_request, unix_url
from flows.stack.state import load

# The users' file's API, re-exported for the CLI and the tests (`stack_auth.add_user`).
from flows.stack.users import BUILT_IN as BUILT_IN
from flows.stack.users import INSTALL as INSTALL
from flows.stack.users import (
    MLFLOW_ADMIN,
    STACK_ADMIN,
    _write_users,
    caddy_binary,
    credential,
    ensure_built_in,
    folder,
    private,
    read_users,
)
from flows.stack.users import ROLES as ROLES
from flows.stack.users import STACK_WORKER as STACK_WORKER
from flows.stack.users import add_user as add_user
from flows.stack.users import remove_user as remove_user
from flows.stack.users import rotate_user as rotate_user
from mllm import UserError


def secured(home: Path) -> dict | None:
    """How the stack in `home` serves when it is secured (no secret in it), else None."""
    try:
        return json.loads((folder(home) / "endpoints.json").read_text())
    except (OSError, ValueError):
        return None


# -- the proxy's configuration -------------------------------------------------------------------


def gate_socket(home: Path) -> Path:
    """The gate's Unix socket, in a 0700 folder: only the stack's own user (the proxy) reaches it."""
    return folder(home) / "gate" / "gate.sock"


def caddyfile(home: Path, listen: str, ports: dict[str, int], certs: Certs) -> str:
    """Caddy's configuration: an HTTPS site per server on `listen`, a Host that is not one of the
    stack's names answered 421, everything else handed to the gate (flows/stack/gate.py), which
    checks the credential and the policy. No user and no hash is in it."""
    log = folder(home) / "caddy"
    hosts = " ".join(h for h in hosts_for(listen))
    # HTTP/1.1 and 2 over TCP only: no HTTP/3 listener on UDP beside them.
    # A client that sends no server name (one that connects to an IP address) gets the stack's
    # certificate, which then names that address or is refused by the client as for another one.
    head = [
        "{",
        "\tadmin unix/" + str(log / "admin.sock"),
        "\tauto_https off",
        f"\tdefault_sni {listen}",
        "\tservers {",
        "\t\tprotocols h1 h2",
        "\t}",
        f"\tstorage file_system {log / 'data'}",
        "}",
    ]
    sites = []
    for server in ("prefect", "mlflow"):
        sites.append(
            "\n".join(
                [
                    f"https://:{ports[server]} {{",
                    f"\tbind {listen}",
                    f"\ttls {certs.cert} {certs.key}",
                    f"\t@foreign not host {hosts}",
                    '\trespond @foreign "misdirected request: this is the mllm stack at one of its own names" 421',
                    f"\treverse_proxy unix/{gate_socket(home)} {{",
                    f"\t\theader_up X-Stack-Server {server}",
                    "\t\theader_up X-Stack-Client {remote_host}",
                    "\t\tflush_interval -1",
                    "\t}",
                    "}",
                ]
            )
        )
    return "\n".join(head) + "\n\n" + "\n\n".join(sites) + "\n"


def write_caddyfile(home: Path) -> Path:
    ends = secured(home)
    certs = Certs(**{k: Path(v) for k, v in ends["certs"].items()})
    return private(folder(home) / "Caddyfile", caddyfile(home, ends["listen"], ends["ports"], certs))


def proxy_service(home: Path):
    caddy = caddy_binary()
    data = folder(home) / "caddy"
    return Service(
        "proxy",
        [caddy, "run", "--config", str(folder(home) / "Caddyfile"), "--adapter", "caddyfile"],
        str(home / "logs" / "proxy.log"),
        None,
        secured(home)["listen_url"],
        env={"HOME": str(data), "XDG_DATA_HOME": str(data / "data"), "XDG_CONFIG_HOME": str(data / "config")},
    )


def gate_service(home: Path) -> Service:
    return Service(
        "gate",
        [sys.executable, "-m", "flows.stack.gate", str(home), str(gate_socket(home))],
        str(home / "logs" / "gate.log"),
        None,
        f"unix:{gate_socket(home)}",
    )


def reload_proxy(home: Path) -> bool:
    """Whether the secured stack's gate runs: it reads the users file again at its next request
    after a change, so a removed or rotated secret stops working at once."""
    return any(s.name == "gate" and s.alive() for s in load(home)["services"])


# -- the plan of a secured stack -----------------------------------------------------------------


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def server_sockets(home: Path) -> dict[str, str]:
    """The Prefect and MLflow servers' Unix sockets on a secured stack, in a 0700 folder: no
    server listens on TCP, and only the stack's own user reaches them."""
    return {s: str(folder(home) / "servers" / f"{s}.sock") for s in ("prefect", "mlflow")}


def plan(home: Path, listen: str, ports: dict[str, int], tls_cert: str | None, tls_key: str | None) -> dict:
    """Make what a secured stack needs in `home` (users, certificates) and record its endpoints."""
    caddy_binary()
    ensure_built_in(home)
    certs = certificates(home, hosts_for(listen), tls_cert, tls_key)
    host = f"[{listen}]" if ":" in listen else listen
    ends = {
        "listen": listen,
        "ports": ports,
        "sockets": server_sockets(home),
        "certs": {"ca": str(certs.ca), "cert": str(certs.cert), "key": str(certs.key)},
        "api": f"https://{host}:{ports['prefect']}/api",
        "tracking": f"https://{host}:{ports['mlflow']}",
        "listen_url": f"https://{host}:{ports['prefect']} https://{host}:{ports['mlflow']}",
    }
    (folder(home) / "servers").mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder(home) / "servers", 0o700)
    (folder(home) / "endpoints.json").write_text(json.dumps(ends, indent=1) + "\n")
    _mlflow_ini(home)
    write_caddyfile(home)
    return ends


def _without_password(uri: str) -> str:
    parts = urllib.parse.urlsplit(uri)
    if not parts.password:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    user = urllib.parse.unquote(parts.username or "")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{urllib.parse.quote(user)}@{host}" if user else host))


def _mlflow_ini(home: Path, database_uri: str | None = None) -> Path:
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


def setup(
    home: Path,
    listen: str,
    auth: bool,
    prefect_port: int,
    mlflow_port: int,
    tls_cert: str | None,
    tls_key: str | None,
    db,
) -> dict | None:
    """A secured stack's endpoints (its servers' Unix sockets among them), made ready in
    `home`; None for a plain loopback stack, exactly as before."""
    if auth or not is_loopback(listen):
        ends = plan(home, listen, {"prefect": prefect_port, "mlflow": mlflow_port}, tls_cert, tls_key)
        set_database(home, db.mlflow_env.get("MLFLOW_BACKEND_STORE_URI"))
        return ends
    if tls_cert or tls_key:
        raise UserError("--tls-cert/--tls-key are for a secured stack: add --auth (or --listen ADDRESS)")
    (folder(home) / "endpoints.json").unlink(missing_ok=True)
    return None


def public_env(home: Path) -> dict[str, str]:
    """What a client of the secured stack needs besides its credential (no secret: saved)."""
    ends = secured(home)
    return {
        "PREFECT_API_URL": ends["api"],
        "MLFLOW_TRACKING_URI": ends["tracking"],
        "PREFECT_API_SSL_CERT_FILE": ends["certs"]["ca"],
        "MLFLOW_TRACKING_SERVER_CERT_PATH": ends["certs"]["ca"],
    }


def start_proxy(home: Path, timeout: float) -> list[Service]:
    """Start the gate and the proxy, wait until both endpoints answer the stack's own credential
    over TLS, and give MLflow the stack's users."""
    (folder(home) / "caddy" / "admin.sock").unlink(missing_ok=True)  # a killed proxy's
    gate = gate_service(home).start()
    proxy = None
    try:
        gate.wait_ready(timeout, ready=lambda: gate_socket(home).exists())
        proxy = proxy_service(home).start()
        proxy.wait_ready(timeout, ready=lambda: proxy_ready(home))
        sync_mlflow(home)
    except BaseException:
        for s in (proxy, gate):
            if s is not None:
                s.stop()
        raise
    return [gate, proxy]


def set_database(home: Path, mlflow_backend_uri: str | None) -> None:
    """MLflow's users on the stack's database: its tables beside MLflow's own (their migrations
    keep a version table of their own, alembic_version_auth)."""
    _mlflow_ini(home, mlflow_backend_uri)


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


# -- clients -------------------------------------------------------------------------------------


def client_env(home: Path, user: str, ca_path: str | None = None) -> dict[str, str]:
    """The standard variables a client of the secured stack needs as `user` (secrets included)."""
    ends = secured(home)
    name, secret = credential(home, user)
    ca = ca_path or ends["certs"]["ca"]
    return {
        "PREFECT_API_URL": ends["api"],
        "PREFECT_API_AUTH_STRING": f"{name}:{secret}",
        "PREFECT_API_SSL_CERT_FILE": ca,
        "MLFLOW_TRACKING_URI": ends["tracking"],
        "MLFLOW_TRACKING_USERNAME": name,
        "MLFLOW_TRACKING_PASSWORD": secret,
        "MLFLOW_TRACKING_SERVER_CERT_PATH": ca,
    }


def basic(name: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{secret}".encode()).decode()


def context(ca: str | Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


# The stack's own calls to its servers (readiness, slots, in-flight runs): an API URL's
# (credential header, TLS context), registered when a secured stack's state is loaded.
_KNOWN: dict[str, tuple[str, ssl.SSLContext]] = {}


def register(home: Path) -> None:
    ends = secured(home)
    if ends is None:
        return
    try:
        header = basic(*credential(home, STACK_ADMIN))
        ctx = context(ends["certs"]["ca"])
    except (UserError, OSError, ssl.SSLError):
        return
    _KNOWN[ends["api"]] = _KNOWN[ends["tracking"]] = (header, ctx)


def open_url(req: urllib.request.Request | str, timeout: float):
    """Open `req` as the stack itself: with its credential and CA where the URL is a secured
    stack's, directly (no proxy, as on loopback) otherwise."""
    url = req.full_url if isinstance(req, urllib.request.Request) else req
    known = next((v for k, v in _KNOWN.items() if url.startswith(k)), None)
    if known is None:
        return _DIRECT.open(req, timeout=timeout)
    req = req if isinstance(req, urllib.request.Request) else urllib.request.Request(req)
    req.add_header("Authorization", known[0])
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=known[1]))
    return opener.open(req, timeout=timeout)


def proxy_ready(home: Path) -> bool:
    ends = secured(home)
    register(home)
    try:
        for url in (f"{ends['api']}/health", f"{ends['tracking']}/health"):
            with open_url(url, 5) as r:
                if r.status != 200:
                    return False
        return True
    except (urllib.error.URLError, OSError):
        return False


# -- MLflow's users: the stack's ------------------------------------------------------------------


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
