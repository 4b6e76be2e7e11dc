"""The secured stack (flows/stack/auth.py): its users file, certificates and proxy configuration,
then a real one on loopback with --auth (Caddy, the Prefect server, MLflow's basic-auth app, the
stack's worker): who is refused what, a worker's pipeline recorded in full, a viewer loading the
champion, rotation and removal taking effect at once, the one-line errors, and no secret left
anywhere it should not be."""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import prewarmed
import pytest
from textdata import make_text

from flows.stack import auth as stack_auth
from flows.stack import servers as stack
from flows.stack.certs import sign_server
from flows.stack.processes import free_port
from mllm import UserError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=20",
]


@pytest.fixture(scope="module", autouse=True)
def caddy() -> str:
    found = shutil.which("caddy")
    if found is None:
        if os.environ.get("MLLM_REQUIRE_CADDY") == "1":
            pytest.fail("MLLM_REQUIRE_CADDY=1 but caddy is not installed", pytrace=False)
        pytest.skip("the secured stack needs Caddy: apt-get install caddy")
    return found


def _days(start: float, end: float) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now + datetime.timedelta(days=start), now + datetime.timedelta(days=end)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- users, certificates, the proxy's configuration ----------------------------------------------


def test_users_file_is_private_and_each_secret_random(tmp_path: Path) -> None:
    stack_auth.ensure_built_in(tmp_path)
    first = stack_auth.add_user(tmp_path, "ana", "viewer")
    users_file = tmp_path / "auth" / "users.json"
    assert _mode(users_file) == 0o600 and _mode(users_file.parent) == 0o700
    users = stack_auth.read_users(tmp_path)["users"]
    assert {n: u["role"] for n, u in users.items()} == {
        "stack-admin": "admin",
        "stack-worker": "worker",
        "ana": "viewer",
    }
    assert len({u["secret"] for u in users.values()}) == 3 and len(first) >= 40
    assert users["ana"]["hash"].startswith("$2a$") and first not in users["ana"]["hash"]
    second = stack_auth.rotate_user(tmp_path, "ana")
    assert second != first and stack_auth.read_users(tmp_path)["users"]["ana"]["secret"] == second
    for bad, match in (
        (lambda: stack_auth.add_user(tmp_path, "ana", "viewer"), "exists already"),
        (lambda: stack_auth.add_user(tmp_path, "bob", "root"), "give one of admin, worker, viewer"),
        (lambda: stack_auth.add_user(tmp_path, "b c", "viewer"), "use letters"),
        (lambda: stack_auth.remove_user(tmp_path, "stack-worker"), "the stack's own"),
        (lambda: stack_auth.remove_user(tmp_path, "nobody"), "no user 'nobody'"),
    ):
        with pytest.raises(UserError, match=match):
            bad()
    stack_auth.remove_user(tmp_path, "ana")
    data = stack_auth.read_users(tmp_path)
    assert "ana" not in data["users"] and data["removed"] == ["ana"]  # MLflow's copy goes at the next sync
    assert data["mlflow_admin"] and data["mlflow_admin"] != "password1234"


def test_certificates_made_for_the_address_keys_private(tmp_path: Path) -> None:
    from cryptography import x509

    certs = stack_auth.certificates(tmp_path, ["10.9.8.7", "localhost"])
    assert _mode(certs.key) == 0o600 and _mode(tmp_path / "auth/tls/ca-key.pem") == 0o600
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    server = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.9.8.7"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    # A real TLS client takes it for that name, against that CA only.
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.cert, certs.key)
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    # Another address: a new server certificate from the same CA.
    again = stack_auth.certificates(tmp_path, ["10.9.8.6"])
    assert again.ca.read_bytes() == certs.ca.read_bytes()
    assert x509.load_pem_x509_certificate(again.cert.read_bytes()).serial_number != server.serial_number
    # An expired server certificate (or one within 30 days of its end) is made again, never served.
    cert_pem, _ = sign_server(tmp_path / "auth/tls", ["10.9.8.6"], *_days(-30, -1))
    again.cert.write_bytes(cert_pem)
    renewed = x509.load_pem_x509_certificate(stack_auth.certificates(tmp_path, ["10.9.8.6"]).cert.read_bytes())
    assert renewed.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=300)
    with pytest.raises(UserError, match="give both --tls-cert"):
        stack_auth.certificates(tmp_path, ["x"], cert=str(certs.cert))
    assert stack_auth.certificates(tmp_path, ["x"], str(certs.cert), str(certs.key)).ca == certs.cert


def test_proxy_configuration_is_valid_and_holds_hashes_only(tmp_path: Path, caddy: str) -> None:
    ends = stack_auth.plan(tmp_path, "127.0.0.1", {"prefect": 4200, "mlflow": 5000}, None, None)
    stack_auth.add_user(tmp_path, "vic", "viewer")
    config = stack_auth.write_caddyfile(tmp_path)
    text = config.read_text()
    assert _mode(config) == 0o600
    # No user at all: the gate (flows/stack/gate.py) checks credentials, behind a 0700 socket.
    for name, user in stack_auth.read_users(tmp_path)["users"].items():
        assert user["secret"] not in text and user["hash"] not in text and name not in text
    assert f"reverse_proxy unix/{stack_auth.gate_socket(tmp_path)}" in text and "X-Stack-Server prefect" in text
    assert "@foreign not host" in text
    done = subprocess.run(
        [caddy, "validate", "--config", str(config), "--adapter", "caddyfile"],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert ends["api"] == "https://127.0.0.1:4200/api" and ends["tracking"] == "https://127.0.0.1:5000"
    # A plain loopback stack: nothing of this, and no certificate options.
    with pytest.raises(UserError, match="are for a secured stack"):
        stack_auth.setup(tmp_path, "127.0.0.1", False, 1, 2, "cert.pem", None, None)
    assert stack_auth.setup(tmp_path, "127.0.0.1", False, 1, 2, None, None, None) is None
    assert stack_auth.secured(tmp_path) is None


# -- a secured stack on loopback ---------------------------------------------------------------


@dataclass
class Secured:
    home: Path
    storage: Path
    users: dict[str, dict[str, str]]  # name -> its `stack worker-env` settings
    terminal: list[str]  # what the commands printed, for the canary check

    def env(self, user: str | None, **changes: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
        if user is not None:
            base.update(self.users[user])
        return {**base, "PREFECT_HOME": str(self.home.parent / "client-prefect"), **changes}

    def cli(self, *args: str, user: str | None, cwd: Path, **changes: str) -> subprocess.CompletedProcess:
        done = prewarmed.run("flows.cli", [*args], env=self.env(user, **changes), cwd=cwd, timeout=600)
        self.terminal += [done.stdout, done.stderr]
        return done


def _worker_env(home: Path, user: str) -> dict[str, str]:
    done = prewarmed.run("flows.cli", ["stack", "worker-env", "--home", str(home), "--user", user], check=True)
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Secured:
    root = tmp_path_factory.mktemp("secured")
    home, storage = root / "stack", root / "storage"
    mp = pytest.MonkeyPatch()
    mp.setenv("HOME", str(root / "home"))
    mp.setenv("MLLM_STACK_LOGIN_TRIES", "1000")  # this module tries many wrong passwords on purpose
    try:
        stack.up(
            home,
            str(storage),
            pool="local",
            prefect_port=0,
            mlflow_port=0,
            auth=True,
            local_worker=True,
            worker_env={"OMP_NUM_THREADS": "1", "PREFECT_WORKER_QUERY_SECONDS": "1"},
        )
        for name, role in (("vic", "viewer"), ("wendy", "worker")):
            prewarmed.run("flows.cli", ["stack", "user", "add", name, "--role", role, "--home", str(home)], check=True)
        yield Secured(home, storage, {u: _worker_env(home, u) for u in ("vic", "wendy", "stack-admin")}, [])
    finally:
        stack.down(home, force=True)
        mp.undo()


def _open(req: urllib.request.Request, ca: str):
    """The response to `req`, its 503s tried again as Prefect's and MLflow's own clients do: a
    server that answers "busy" (CI, 2026-11-28: the secured stack's Prefect, a deployment created
    seconds after the stack came up) has not decided anything about the caller."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca))
    )
    for attempt in range(4):
        try:
            return opener.open(req, timeout=60)
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == 3:
                raise
            print(f"503 from {req.get_method()} {req.full_url}, tried again: {e.read()[:300]!r}")
            time.sleep(1 + attempt)


def _call(url: str, ca: str, user: tuple[str, str] | None, method: str = "GET", body: dict | None = None) -> int:
    req = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    if user:
        req.add_header("Authorization", stack_auth.basic(*user))
    try:
        with _open(req, ca) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _socket(url: str, ca: str, user: tuple[str, str] | None) -> str:
    """An events websocket as Prefect's client opens it: the handshake's answer, or 'open' once
    the server took the client's auth message."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    headers = {"Authorization": stack_auth.basic(*user)} if user else {}
    # Once in about five runs of this module (2026-11-27, 2-core AMD EPYC), one handshake through
    # Caddy got no answer in 30 s; the cause is not found yet. A second try is made and the miss
    # printed; two misses in a row read "no answer in 30 s" in the table, naming route and caller.
    for _ in range(2):
        try:
            with connect(
                url,
                ssl=ssl.create_default_context(cafile=ca),
                additional_headers=headers,
                subprotocols=["prefect"],
                open_timeout=30,
            ) as ws:
                ws.send(json.dumps({"type": "auth", "token": f"{user[0]}:{user[1]}" if user else None}))
                return "101 open" if json.loads(ws.recv(timeout=30))["type"] == "auth_success" else "101 refused"
        except InvalidStatus as e:
            return str(e.response.status_code)
        except ConnectionClosed as e:
            return f"{e.rcvd.code if e.rcvd else 1006} closed"
        except TimeoutError:
            print(f"no answer in 30 s: {url} as {user[0] if user else 'nobody'}")
    return "no answer in 30 s"


def test_routes_refused_without_credentials_with_a_wrong_password_and_to_a_viewer(secured: Secured) -> None:
    env = secured.users["wendy"]
    api, tracking, ca = env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"], env["PREFECT_API_SSL_CERT_FILE"]
    wendy = tuple(env["PREFECT_API_AUTH_STRING"].split(":", 1))
    vic = tuple(secured.users["vic"]["PREFECT_API_AUTH_STRING"].split(":", 1))
    callers = {
        "none": None,
        "wrong password": ("vic", "not-the-secret"),
        "unknown user": ("eve", "x" * 43),
        "viewer": vic,
        "worker": wendy,
    }
    ws = api.replace("https://", "wss://")
    # The worker's own objects to act on: a flow, a deployment, an experiment with a run and an artifact.
    flow = _json(f"{api}/flows/", ca, wendy, {"name": "routes-check"})
    deployment = _json(
        f"{api}/deployments/",
        ca,
        wendy,
        {"name": "train-d", "flow_id": flow["id"], "entrypoint": "flows.training:train"},
    )
    experiment = _json(f"{tracking}/api/2.0/mlflow/experiments/create", ca, wendy, {"name": "routes-check"})
    run = _json(f"{tracking}/api/2.0/mlflow/runs/create", ca, wendy, {"experiment_id": experiment["experiment_id"]})
    run_id = run["run"]["info"]["run_id"]
    artifact = f"{tracking}/api/2.0/mlflow-artifacts/artifacts/{experiment['experiment_id']}/{run_id}/artifacts/a.txt"
    assert _put(artifact, ca, wendy, b"hello") == 200
    _json(f"{tracking}/api/2.0/mlflow/registered-models/create", ca, wendy, {"name": "routes-model"})
    _json(
        f"{tracking}/api/2.0/mlflow/model-versions/create",
        ca,
        wendy,
        {"name": "routes-model", "source": f"runs:/{run_id}/model", "run_id": run_id},
    )
    routes = [
        ("Prefect", "read flow runs", lambda u: _call(f"{api}/flow_runs/filter", ca, u, "POST", {})),
        ("Prefect", "read logs", lambda u: _call(f"{api}/logs/filter", ca, u, "POST", {})),
        (
            "Prefect",
            "create a deployment",
            lambda u: _call(
                f"{api}/deployments/",
                ca,
                u,
                "POST",
                {"name": "train-x", "flow_id": flow["id"], "entrypoint": "flows.training:train"},
            ),
        ),
        (
            "Prefect",
            "create a flow run",
            lambda u: _call(f"{api}/deployments/{deployment['id']}/create_flow_run", ca, u, "POST", {}),
        ),
        (
            "Prefect",
            "clear the database",
            lambda u: _call(f"{api}/admin/database/clear", ca, u, "POST", {"confirm": False}),
        ),
        ("Prefect", "events websocket in", lambda u: _socket(f"{ws}/events/in", ca, u)),
        ("Prefect", "events websocket out", lambda u: _socket(f"{ws}/events/out", ca, u)),
        (
            "MLflow",
            "read experiments",
            lambda u: _call(f"{tracking}/api/2.0/mlflow/experiments/search?max_results=5", ca, u),
        ),
        (
            "MLflow",
            "log a metric",
            lambda u: _call(
                f"{tracking}/api/2.0/mlflow/runs/log-metric",
                ca,
                u,
                "POST",
                {"run_id": run_id, "key": "m", "value": 1, "timestamp": 0},
            ),
        ),
        (
            "MLflow",
            "set an alias",
            lambda u: _call(
                f"{tracking}/api/2.0/mlflow/registered-models/alias",
                ca,
                u,
                "POST",
                {"name": "routes-model", "alias": "champion", "version": "1"},
            ),
        ),
        ("MLflow", "download an artifact", lambda u: _call(artifact, ca, u)),
        (
            "MLflow",
            "create a user",
            lambda u: _call(
                f"{tracking}/api/2.0/mlflow/users/create", ca, u, "POST", {"username": "mallory", "password": "p" * 20}
            ),
        ),
        (
            "MLflow",
            "delete an experiment",
            lambda u: _call(
                f"{tracking}/api/2.0/mlflow/experiments/delete",
                ca,
                u,
                "POST",
                {"experiment_id": experiment["experiment_id"]},
            ),
        ),
    ]
    table = {(server, what): {who: str(call(user)) for who, user in callers.items()} for server, what, call in routes}
    lines = ["| server | route | " + " | ".join(callers) + " |", "|---|---|" + "---|" * len(callers)]
    lines += [f"| {s} | {w} | " + " | ".join(answers.values()) + " |" for (s, w), answers in table.items()]
    print("\n".join(lines))
    (secured.home / "routes.md").write_text("\n".join(lines) + "\n")
    writes = {
        "create a deployment",
        "create a flow run",
        "log a metric",
        "set an alias",
        "events websocket in",
        "delete an experiment",
    }
    for (_, what), answers in table.items():
        # The events-out stream takes its credential in its first message, as Prefect's client sends it.
        none = "1008 closed" if what == "events websocket out" else "401"
        assert answers["none"] == none and answers["wrong password"] == answers["unknown user"] == "401", (
            what,
            answers,
        )
        if what in writes:
            assert answers["viewer"] == "403", (what, answers)
        if what in ("read flow runs", "read logs", "read experiments", "download an artifact"):
            assert answers["viewer"] == answers["worker"] == "200", (what, answers)
        if what in ("clear the database", "create a user"):
            assert answers["viewer"] == answers["worker"] == "403", (what, answers)
    assert table[("Prefect", "events websocket out")]["viewer"] == "101 open"
    assert table[("Prefect", "events websocket in")]["worker"] == "101 open"
    assert {table[("Prefect", w)]["worker"] for w in ("create a deployment", "create a flow run")} == {"201"}
    assert {table[("MLflow", w)]["worker"] for w in ("log a metric", "set an alias", "delete an experiment")} == {"200"}
    # Plain HTTP on the TLS port gets no answer from the servers.
    port = api.split(":")[2].split("/")[0]
    assert _plain(f"http://127.0.0.1:{port}/api/flow_runs/filter") == 400


def _json(url: str, ca: str, user: tuple[str, str], body: dict) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": stack_auth.basic(*user)},
    )
    with _open(req, ca) as r:
        return json.loads(r.read())


def _put(url: str, ca: str, user: tuple[str, str], data: bytes) -> int:
    req = urllib.request.Request(url, data=data, method="PUT", headers={"Authorization": stack_auth.basic(*user)})
    with _open(req, ca) as r:
        return r.status


def _plain(url: str) -> int:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_worker_trains_on_the_pool_and_a_viewer_loads_the_champion(secured: Secured, tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text(make_text(6000))
    done = secured.cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        "corpus.txt",
        "--storage",
        str(secured.storage / "w"),
        "--train-on",
        "local",
        *[a for s in FAST for a in ("--set", s)],
        user="wendy",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model: smoke v1 (promoted to champion" in done.stdout
    run_id = next(line.split()[-1] for line in done.stdout.splitlines() if line.startswith("mlflow run:"))
    # As the viewer: every task run recorded, the metrics, the champion, which it loads and runs.
    script = f"""
import json, mlflow, mlflow.pyfunc
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
client = MlflowClient()
run = client.get_run({run_id!r})
steps = [m.step for m in client.get_metric_history({run_id!r}, "train_loss")]
with get_client(sync_client=True) as prefect:
    parent = run.data.tags["prefect.flow_run_id"]
    # The routes test's flow run stays Scheduled on a deployment without a pool.
    flows = [f for f in prefect.read_flow_runs() if prefect.read_flow(f.flow_id).name != "routes-check"]
    tasks = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[f.id for f in flows])))
model = mlflow.pyfunc.load_model("models:/smoke@champion")
[text] = model.predict(["The "], params={{"method": "greedy", "max_new_tokens": 15}})
print(json.dumps({{"steps": max(steps), "tasks": [t.state.type.value for t in tasks], "names": sorted({{t.name.rsplit("-", 1)[0] for t in tasks}}),
                  "flows": [f.state.type.value for f in flows], "text": text,
                  "params": run.data.params, "tags": run.data.tags}}))
"""
    read = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=secured.env("vic"),
        cwd=tmp_path,
        timeout=300,
    )
    secured.terminal += [read.stdout, read.stderr]
    assert read.returncode == 0, read.stderr[-3000:]
    seen = json.loads(read.stdout.strip().splitlines()[-1])
    assert seen["steps"] == 12 and isinstance(seen["text"], str) and seen["text"]
    assert set(seen["flows"]) == {"COMPLETED"} and len(seen["flows"]) >= 2  # the pipeline and its training
    assert len(seen["tasks"]) >= 5 and set(seen["tasks"]) == {"COMPLETED"}, seen["tasks"]
    assert {"train", "generate", "log-outcome"} <= set(seen["names"]), seen["names"]
    secured.terminal.append(json.dumps([seen["params"], seen["tags"]]))


def _odd_proxies(caddy: str, home: Path, folder: Path) -> tuple[dict[str, int], list[subprocess.Popen]]:
    """Caddy in front of the stack's own servers with what a client must refuse: an expired
    certificate, one for another address (both from the stack's CA), and a Prefect server that
    says it runs another version (its /api/admin/version answered by Caddy: the one route a
    client reads the version from; another Prefect cannot be installed beside the pinned one).
    One Caddy each: a client that names an IP address sends no server name, and one Caddy
    would answer it with whichever of its certificates names that address."""
    ends = stack_auth.secured(home)
    tls, back = home / "auth" / "tls", ends["sockets"]
    sites = {
        "expired": (sign_server(tls, ["127.0.0.1"], *_days(-30, -1)), back["mlflow"], ""),
        "other host": (sign_server(tls, ["10.9.8.7"], *_days(0, 1)), back["prefect"], ""),
        "other version": (None, back["prefect"], '\thandle /api/admin/version {\n\t\trespond "\\"3.7.2\\"" 200\n\t}'),
    }
    ports, procs = {}, []
    for name, (pems, backend, extra) in sites.items():
        port, site = free_port(), folder / name.replace(" ", "-")
        site.mkdir()
        if pems is None:
            cert, key = ends["certs"]["cert"], ends["certs"]["key"]
        else:
            cert, key = site / "cert.pem", site / "key.pem"
            cert.write_bytes(pems[0])
            key.write_bytes(pems[1])
            key.chmod(0o600)
        (site / "Caddyfile").write_text(
            "\n".join(
                [
                    "{",
                    "\tadmin off",
                    "\tauto_https off",
                    "\tdefault_sni 10.9.8.7" if name == "other host" else "",
                    f"\tstorage file_system {site / 'data'}",
                    "}",
                    f"https://127.0.0.1:{port} {{",
                    f"\ttls {cert} {key}",
                    extra,
                    f"\treverse_proxy unix/{backend} {{",
                    "\t\theader_up -Authorization",
                    "\t}",
                    "}",
                ]
            )
            + "\n"
        )
        procs.append(
            subprocess.Popen(
                [caddy, "run", "--config", str(site / "Caddyfile"), "--adapter", "caddyfile"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env={**os.environ, "HOME": str(site)},
            )
        )
        ports[name] = port
    deadline = time.monotonic() + 30
    while not all(_listening(p) for p in ports.values()):
        for proc in procs:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    return ports, procs


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_one_line_for_each_refused_credential_role_certificate_and_version(
    secured: Secured, tmp_path: Path, caddy: str
) -> None:
    (tmp_path / "corpus.txt").write_text(make_text(2000))
    args = (
        "run",
        "--recipe",
        "smoke",
        "--source",
        "corpus.txt",
        "--storage",
        str(tmp_path / "store"),
        *[a for s in FAST for a in ("--set", s)],
    )
    wrong = {"PREFECT_API_AUTH_STRING": "vic:wrong"}
    (tmp_path / "odd").mkdir()
    odd, proxies = _odd_proxies(caddy, secured.home, tmp_path / "odd")
    at = {k: f"https://127.0.0.1:{p}" for k, p in odd.items()}
    from importlib.metadata import version

    cases = {
        "viewer": ({}, "does not let user 'vic' do this (403"),
        "wrong Prefect password": (wrong, "Prefect server https://127.0.0.1"),
        "wrong MLflow password": ({**wrong, "MLFLOW_TRACKING_PASSWORD": "wrong"}, "MLflow server https://"),
        # No credential at all: the pre-flight's 401 (Prefect's /api/admin/version, MLflow's first call).
        "no Prefect credential": (
            {"PREFECT_API_AUTH_STRING": ""},
            (
                "did not take the credential of no user (PREFECT_API_AUTH_STRING is not set) "
                "(401): set PREFECT_API_AUTH_STRING to NAME:SECRET"
            ),
        ),
        "no MLflow credential": (
            {"MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": ""},
            (
                "did not take the credential of no user (MLFLOW_TRACKING_USERNAME is not set) "
                "(401): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
            ),
        ),
        "no CA": (
            {"PREFECT_API_SSL_CERT_FILE": "", "MLFLOW_TRACKING_SERVER_CERT_PATH": ""},
            "has a certificate this client does not trust",
        ),
        "expired": (
            {"MLFLOW_TRACKING_URI": at["expired"]},
            (
                f"the MLflow server {at['expired']} has a certificate that is out of its validity period "
                "(certificate has expired): on the stack's machine `mllm-pipeline stack up` makes"
            ),
        ),
        "other host": (
            {"PREFECT_API_URL": at["other host"] + "/api"},
            (
                f"the Prefect server {at['other host']}/api has a certificate for other addresses (IP "
                "address mismatch, certificate is not valid for '127.0.0.1'"
            ),
        ),
        # A name the certificate lacks: Caddy has no certificate to offer and ends the handshake.
        "other name": (
            {"PREFECT_API_URL": at["other host"].replace("127.0.0.1", "localhost") + "/api"},
            "has a certificate for other addresses (no certificate of the server names this address",
        ),
        "other version": (
            {"PREFECT_API_URL": at["other version"] + "/api"},
            (
                f"the Prefect server {at['other version']}/api runs Prefect 3.7.2 and this client "
                f"Prefect {version('prefect')}: install prefect==3.7.2 here"
            ),
        ),
    }
    try:
        for case, (changes, expected) in cases.items():
            done = secured.cli(*args, user="vic", cwd=tmp_path, **changes)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, (
                case,
                done.stderr[-2000:],
            )
            assert lines[0].startswith("error: ") and expected in lines[0], (case, lines[0])
            assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.parquet")), case
    finally:
        for proxy in proxies:
            proxy.terminate()
            proxy.wait(30)


def test_rotation_and_removal_take_effect_at_once_on_both_servers(secured: Secured) -> None:
    home, api = str(secured.home), secured.users["wendy"]["PREFECT_API_URL"]
    tracking, ca = secured.users["wendy"]["MLFLOW_TRACKING_URI"], secured.users["wendy"]["PREFECT_API_SSL_CERT_FILE"]

    def answers(user: str, secret: str) -> tuple[int, int]:
        return (
            _call(f"{api}/flow_runs/filter", ca, (user, secret), "POST", {}),
            _call(f"{tracking}/api/2.0/mlflow/experiments/search?max_results=1", ca, (user, secret)),
        )

    prewarmed.run("flows.cli", ["stack", "user", "add", "tmp-worker", "--home", home], check=True)
    old = stack_auth.read_users(secured.home)["users"]["tmp-worker"]["secret"]
    assert answers("tmp-worker", old) == (200, 200)
    prewarmed.run("flows.cli", ["stack", "user", "rotate", "tmp-worker", "--home", home], check=True)
    new = stack_auth.read_users(secured.home)["users"]["tmp-worker"]["secret"]
    assert answers("tmp-worker", old) == (401, 401) and answers("tmp-worker", new) == (200, 200)
    prewarmed.run("flows.cli", ["stack", "user", "remove", "tmp-worker", "--home", home], check=True)
    assert answers("tmp-worker", new) == (401, 401)
    listed = prewarmed.run("flows.cli", ["stack", "user", "list", "--home", home], check=True).stdout
    assert "tmp-worker" not in listed and "vic" in listed and new not in listed


def test_no_secret_is_left_anywhere_it_should_not_be(secured: Secured) -> None:
    """Run last: the secrets of every user the other tests used, searched for in the stack's home
    (its databases' files, logs, state) but the users file, the storage, and the terminal."""
    data = stack_auth.read_users(secured.home)
    canaries = {n: u["secret"] for n, u in data["users"].items()}
    canaries["mlflow-admin"] = data["mlflow_admin"]
    allowed = {secured.home / "auth" / "users.json", secured.home / "auth" / "mlflow-auth.ini"}
    found = []
    for top in (secured.home, secured.storage):
        for path in top.rglob("*"):
            if path.is_file() and path not in allowed:
                blob = path.read_bytes()
                found += [
                    (name, str(path))
                    for name, secret in canaries.items()
                    if secret.encode() in blob or base64.b64encode(f"{name}:{secret}".encode()) in blob
                ]
    assert not found, found
    terminal = "\n".join(secured.terminal)
    assert not [n for n, s in canaries.items() if s in terminal]
    # The MLflow admin's secret is in its ini (the auth app reads it there) and nowhere else.
    assert _mode(secured.home / "auth" / "mlflow-auth.ini") == 0o600


def test_a_checkpoint_sized_artifact_goes_through_the_proxy_whole(secured: Secured) -> None:
    """Caddy reads a body of up to 1 MiB whole before the gate sees it and streams the rest
    (flows/stack/auth.py): an artifact on either side of that size, and far over it, arrives and
    comes back byte for byte; a viewer's upload of the same size is refused and its body drained."""
    import hashlib

    import httpx

    ends = stack_auth.secured(secured.home)
    ctx = ssl.create_default_context(cafile=ends["certs"]["ca"])
    base = ends["tracking"].rstrip("/") + "/api/2.0/mlflow-artifacts/artifacts/through-the-proxy"
    sizes = (1024 * 1024 - 1, 1024 * 1024, 1024 * 1024 + 1, 24 * 1024 * 1024 + 7)
    with httpx.Client(verify=ctx, auth=stack_auth.credential(secured.home, "wendy"), timeout=120, trust_env=False) as c:
        for size in sizes:
            data = os.urandom(size)
            assert c.put(f"{base}/{size}.bin", content=data).status_code == 200, size
            back = c.get(f"{base}/{size}.bin")
            assert (back.status_code, hashlib.sha256(back.content).digest()) == (200, hashlib.sha256(data).digest())
    with httpx.Client(verify=ctx, auth=stack_auth.credential(secured.home, "vic"), timeout=120, trust_env=False) as c:
        refused = c.put(f"{base}/viewer.bin", content=os.urandom(3 * 1024 * 1024))
        assert refused.status_code == 403 and refused.headers["x-stack-gate"] == "refused"
