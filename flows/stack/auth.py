"""The stack's users, roles, certificates and TLS proxy: what makes a stack reachable from other
machines (`stack up --listen ADDRESS`, or `--auth` on loopback); docs/team-stack.md tells how."""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from flows.stack.certs import Certs, hosts_for
from flows.stack.certs import certificates as certificates
from flows.stack.endpoints import gate_socket as gate_socket
from flows.stack.endpoints import is_loopback, secured, server_sockets
from flows.stack.mlflow_auth import basic, set_database, sync_mlflow, write_ini
from flows.stack.mlflow_auth import mlflow_args as mlflow_args
from flows.stack.mlflow_auth import server_env as server_env
from flows.stack.processes import _DIRECT, Service
from flows.stack.state import load

# The users' file's API, re-exported for the CLI and the tests (`stack_auth.add_user`).
from flows.stack.users import BUILT_IN as BUILT_IN
from flows.stack.users import INSTALL as INSTALL
from flows.stack.users import ROLES as ROLES
from flows.stack.users import STACK_ADMIN, caddy_binary, credential, ensure_built_in, folder, private
from flows.stack.users import STACK_WORKER as STACK_WORKER
from flows.stack.users import add_user as add_user
from flows.stack.users import read_users as read_users
from flows.stack.users import remove_user as remove_user
from flows.stack.users import rotate_user as rotate_user
from mllm import UserError
from mllm.settings import settings as mllm_settings

# -- the proxy's configuration -------------------------------------------------------------------


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
                    "\t@small header_regexp Content-Length ^[0-9]{1,6}$",
                    "\troute {",  # each in this order
                    '\t\trespond @foreign "misdirected request: this is the mllm stack at one of its own names" 421',
                    *_to_gate(home, server, "@small "),
                    *_to_gate(home, server, ""),
                    "\t}",
                    "}",
                ]
            )
        )
    return "\n".join(head) + "\n\n" + "\n\n".join(sites) + "\n"


def _to_gate(home: Path, server: str, match: str) -> list[str]:
    """Caddy's hand-over to the gate of the requests `match` names (all when empty). A body of under
    1 MB (`@small`) is read whole, the client's body closed, before it goes on; a larger or chunked
    one streams (why: docs/team-stack.md, Caddy 2.6's buffer and a refusal's cut answer)."""
    return [
        f"\t\treverse_proxy {match}unix/{gate_socket(home)} {{",
        f"\t\t\theader_up X-Stack-Server {server}",
        "\t\t\theader_up X-Stack-Client {remote_host}",
        "\t\t\tflush_interval -1",
        *(["\t\t\tbuffer_requests"] if match else []),
        "\t\t}",
    ]


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
        # The one S3 endpoint a worker's run may be pointed at (flows/stack/checks.py).
        "storage_endpoint": mllm_settings().s3_endpoint,
    }
    (folder(home) / "servers").mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder(home) / "servers", 0o700)
    (folder(home) / "endpoints.json").write_text(json.dumps(ends, indent=1) + "\n")
    write_ini(home)
    write_caddyfile(home)
    return ends


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
