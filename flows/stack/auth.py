"""The stack's users, roles, certificates and TLS proxy: what makes a stack reachable from other
machines (`stack up --listen ADDRESS`, or `--auth` on loopback).

Caddy (Debian's 2.6) terminates TLS on the listening address, one endpoint per server, and
checks each user's basic credential (bcrypt hashes in its config) and role before passing a
request to the servers, which listen on loopback only. MLflow runs its basic-auth app and checks
the same credentials again: MLflow's users are the stack's users with the same secrets (stack
`admin` and `worker` users are MLflow admins, `viewer` users plain ones with MLflow's default
READ), and the proxy keeps non-admins off MLflow's user and permission routes.

Prefect's own `PREFECT_SERVER_API_AUTH_STRING` stays off: its events websockets authenticate
with the client's auth string inside the first websocket message, compared with the server's
one string, which a per-user credential can never match (and a proxy cannot rewrite inside a
websocket). The proxy's per-user check is then Prefect's only lock, and the Prefect server
listens on loopback only.

The users and their secrets: flows/stack/users.py; the certificates: flows/stack/certs.py.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from flows.stack.processes import _DIRECT, Service, free_port
from flows.stack.state import load
from flows.stack.certs import Certs, certificates, hosts_for  # noqa: F401 (the stack's API)
from flows.stack.users import (BUILT_IN, INSTALL, MLFLOW_ADMIN, ROLES, STACK_ADMIN, STACK_WORKER,  # noqa: F401
                               _write_users, add_user, caddy_binary, credential, ensure_built_in, folder,
                               private, read_users, remove_user, rotate_user)
from mllm import UserError


def secured(home: Path) -> dict | None:
    """How the stack in `home` serves when it is secured (no secret in it), else None."""
    try:
        return json.loads((folder(home) / "endpoints.json").read_text())
    except (OSError, ValueError):
        return None

# -- the proxy's configuration -------------------------------------------------------------------

# Prefect's reads: GETs, and the POSTs that filter, count or page (the UI's /api/ui/ ones too).
_PREFECT_READ_POST = r"^/api/(ui/.*|.*/(filter|count|paginate|history))$"
# MLflow's reads that are POSTs: the searches, and the UI's GraphQL queries (MLflow checks those).
_MLFLOW_READ_POST = r"^/(api|ajax-api)/[23]\.0/mlflow/.*(search|get-history-bulk-interval|search-datasets)$|^/graphql$"
# MLflow's user, role and permission routes: its admins' only (a user's own view of itself stays).
_MLFLOW_ACCOUNTS = (r"^/(api|ajax-api)/[23]\.0/mlflow/(users/(create|update|delete|list|get|permissions/)"
                    r"|roles/|.*permissions/(create|update|delete|grant|revoke))|^/signup|create-ui")


def _matcher(name: str, users: list[str], *lines: str) -> list[str]:
    if not users:
        return []
    return [f"\t@{name} {{", f"\t\tvars {{http.auth.user.id}} {' '.join(users)}", *(f"\t\t{line}" for line in lines),
            "\t}", f'\trespond @{name} "forbidden: the stack\'s role of this user does not allow this" 403']


def caddyfile(home: Path, listen: str, ports: dict[str, int], backends: dict[str, int], certs: Certs) -> str:
    """Caddy's configuration: an HTTPS site per server on `listen`, each user's credential
    checked and their role's limits applied before the request is passed on."""
    users = read_users(home)["users"]
    by_role = {r: sorted(n for n, u in users.items() if u["role"] == r) for r in ROLES}
    accounts = "\n".join(f"\t\t{n} {u['hash']}" for n, u in sorted(users.items()))
    host = f"[{listen}]" if ":" in listen else listen
    log = folder(home) / "caddy"
    # HTTP/1.1 and 2 over TCP only: no HTTP/3 listener on UDP beside them.
    # A client that sends no server name (one that connects to an IP address) gets the stack's
    # certificate, which then names that address or is refused by the client as for another one.
    head = ["{", "\tadmin unix/" + str(log / "admin.sock"), "\tauto_https off", f"\tdefault_sni {listen}",
            "\tservers {", "\t\tprotocols h1 h2", "\t}",
            f"\tstorage file_system {log / 'data'}", "}"]
    sites = []
    for server in ("prefect", "mlflow"):
        lines = [f"https://{host}:{ports[server]} {{", f"\tbind {listen}", f"\ttls {certs.cert} {certs.key}",
                 "\troute {", "\t\tbasicauth bcrypt \"mllm stack\" {", accounts.replace("\t\t", "\t\t\t"), "\t\t}",
                 "\t}"]
        if server == "prefect":
            lines += _matcher("viewer_writes", by_role["viewer"], "not method GET HEAD OPTIONS",
                              f"not path_regexp {_PREFECT_READ_POST}")
            lines += _matcher("viewer_events", by_role["viewer"], "path /api/events/in")
            lines += _matcher("admin_routes", by_role["worker"] + by_role["viewer"], "path /api/admin/*",
                              "not method GET HEAD")
            # The credential stops here: Prefect's server needs none, and logs no header.
            proxy = [f"\treverse_proxy 127.0.0.1:{backends[server]} {{", "\t\theader_up -Authorization", "\t}"]
        else:
            lines += _matcher("viewer_writes", by_role["viewer"], "not method GET HEAD OPTIONS",
                              f"not path_regexp {_MLFLOW_READ_POST}")
            lines += _matcher("accounts", by_role["worker"] + by_role["viewer"], f"path_regexp {_MLFLOW_ACCOUNTS}")
            # MLflow checks the same credential again, and its permissions.
            proxy = [f"\treverse_proxy 127.0.0.1:{backends[server]}"]
        sites.append("\n".join([*lines, *proxy, "}"]))
    return "\n".join(head) + "\n\n" + "\n\n".join(sites) + "\n"


def write_caddyfile(home: Path) -> Path:
    ends = secured(home)
    certs = Certs(**{k: Path(v) for k, v in ends["certs"].items()})
    return private(folder(home) / "Caddyfile", caddyfile(home, ends["listen"], ends["ports"], ends["backends"], certs))


def proxy_service(home: Path):
    caddy = caddy_binary()
    data = folder(home) / "caddy"
    return Service("proxy", [caddy, "run", "--config", str(folder(home) / "Caddyfile"), "--adapter", "caddyfile"],
                   str(home / "logs" / "proxy.log"), None, secured(home)["listen_url"],
                   env={"HOME": str(data), "XDG_DATA_HOME": str(data / "data"), "XDG_CONFIG_HOME": str(data / "config")})


def reload_proxy(home: Path) -> bool:
    """Give the running proxy the users as they are now (at once: a removed or rotated secret
    stops working with this). False if no proxy runs."""
    if not any(s.name == "proxy" and s.alive() for s in load(home)["services"]):
        return False
    write_caddyfile(home)
    done = subprocess.run([caddy_binary(), "reload", "--config", str(folder(home) / "Caddyfile"), "--adapter",
                           "caddyfile", "--address", "unix/" + str(folder(home) / "caddy" / "admin.sock")],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"the stack's proxy did not take the new users: {done.stderr.strip()[-400:]}")
    return True


# -- the plan of a secured stack -----------------------------------------------------------------


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def plan(home: Path, listen: str, ports: dict[str, int], backends: dict[str, int],
         tls_cert: str | None, tls_key: str | None) -> dict:
    """Make what a secured stack needs in `home` (users, certificates) and record its endpoints."""
    caddy_binary()
    ensure_built_in(home)
    certs = certificates(home, hosts_for(listen), tls_cert, tls_key)
    host = f"[{listen}]" if ":" in listen else listen
    ends = {"listen": listen, "ports": ports, "backends": backends,
            "certs": {"ca": str(certs.ca), "cert": str(certs.cert), "key": str(certs.key)},
            "api": f"https://{host}:{ports['prefect']}/api", "tracking": f"https://{host}:{ports['mlflow']}",
            "listen_url": f"https://{host}:{ports['prefect']} https://{host}:{ports['mlflow']}"}
    folder(home).mkdir(parents=True, exist_ok=True)
    (folder(home) / "endpoints.json").write_text(json.dumps(ends, indent=1) + "\n")
    _mlflow_ini(home)
    write_caddyfile(home)
    return ends


def _mlflow_ini(home: Path, database_uri: str | None = None) -> Path:
    data = read_users(home)
    uri = database_uri or f"sqlite:///{folder(home) / 'mlflow-auth.db'}"
    return private(folder(home) / "mlflow-auth.ini",
                   "[mlflow]\ndefault_permission = READ\n"
                   f"database_uri = {uri}\nadmin_username = {MLFLOW_ADMIN}\n"
                   f"admin_password = {data['mlflow_admin']}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   # A checked credential is remembered for 5 minutes: without this each request
                   # pays a PBKDF2 check (about 250 ms of the server's CPU per log_batch, measured on
                   # 2 busy cores). Its one server process forgets a user's entries the moment the
                   # stack changes the password or deletes the user, so rotation still bites at once.
                   "auth_cache_ttl_seconds = 300\n")


def setup(home: Path, listen: str, auth: bool, prefect_port: int, mlflow_port: int, tls_cert: str | None,
          tls_key: str | None, db) -> dict | None:
    """A secured stack's endpoints (its servers' loopback ports among them), made ready in
    `home`; None for a plain loopback stack, exactly as before."""
    if auth or not is_loopback(listen):
        ends = plan(home, listen, {"prefect": prefect_port, "mlflow": mlflow_port},
                    {"prefect": free_port(), "mlflow": free_port()}, tls_cert, tls_key)
        set_database(home, db.mlflow_env.get("MLFLOW_BACKEND_STORE_URI"))
        return ends
    if tls_cert or tls_key:
        raise UserError("--tls-cert/--tls-key are for a secured stack: add --auth (or --listen ADDRESS)")
    (folder(home) / "endpoints.json").unlink(missing_ok=True)
    return None


def public_env(home: Path) -> dict[str, str]:
    """What a client of the secured stack needs besides its credential (no secret: saved)."""
    ends = secured(home)
    return {"PREFECT_API_URL": ends["api"], "MLFLOW_TRACKING_URI": ends["tracking"],
            "PREFECT_API_SSL_CERT_FILE": ends["certs"]["ca"], "MLFLOW_TRACKING_SERVER_CERT_PATH": ends["certs"]["ca"]}


def start_proxy(home: Path, timeout: float):
    """Start the proxy, wait until both endpoints answer the stack's own credential over TLS,
    and give MLflow the stack's users."""
    (folder(home) / "caddy" / "admin.sock").unlink(missing_ok=True)  # a killed proxy's
    proxy = proxy_service(home).start()
    try:
        proxy.wait_ready(timeout, ready=lambda: proxy_ready(home))
        sync_mlflow(home)
    except BaseException:
        proxy.stop()
        raise
    return proxy


def set_database(home: Path, mlflow_backend_uri: str | None) -> None:
    """MLflow's users on the stack's database: its tables beside MLflow's own (their migrations
    keep a version table of their own, alembic_version_auth)."""
    _mlflow_ini(home, mlflow_backend_uri)


def server_env(name: str, home: Path) -> dict[str, str]:
    """What a secured stack's server needs in its environment beyond the plain stack's."""
    ends = secured(home)
    if ends is None:
        return {}
    if name == "prefect-server":
        return {"PREFECT_UI_API_URL": ends["api"]}
    return {"MLFLOW_AUTH_CONFIG_PATH": str(folder(home) / "mlflow-auth.ini"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": read_users(home)["flask_key"]}


def mlflow_args(home: Path) -> list[str]:
    """The MLflow server's options on a secured stack: its basic-auth app, and the Host headers
    it takes (the proxy passes the client's: the listening address and this host's names)."""
    ends = secured(home)
    if ends is None:
        return []
    port = ends["ports"]["mlflow"]
    hosts = [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts_for(ends["listen"])]
    return ["--app-name", "basic-auth", "--allowed-hosts", ",".join([*hosts, f"127.0.0.1:{ends['backends']['mlflow']}"])]


# -- clients -------------------------------------------------------------------------------------


def client_env(home: Path, user: str, ca_path: str | None = None) -> dict[str, str]:
    """The standard variables a client of the secured stack needs as `user` (secrets included)."""
    ends = secured(home)
    name, secret = credential(home, user)
    ca = ca_path or ends["certs"]["ca"]
    return {"PREFECT_API_URL": ends["api"], "PREFECT_API_AUTH_STRING": f"{name}:{secret}",
            "PREFECT_API_SSL_CERT_FILE": ca, "MLFLOW_TRACKING_URI": ends["tracking"],
            "MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": secret,
            "MLFLOW_TRACKING_SERVER_CERT_PATH": ca}


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
    """A call to MLflow's user API as its own admin, straight to the server on loopback (the
    proxy knows no such user)."""
    ends = secured(home)
    url = f"http://127.0.0.1:{ends['backends']['mlflow']}/api/2.0/mlflow/users/{route}"
    data = json.dumps(body).encode()
    if method == "GET":
        url, data = url + "?" + urllib.parse.urlencode(body), None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", "Authorization": basic(MLFLOW_ADMIN, read_users(home)["mlflow_admin"])})
    try:
        with _DIRECT.open(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


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

