"""The secured stack's policy (flows/stack/policy.py) held by its gate (flows/stack/gate.py),
through the real Caddy over HTTPS on one secured stack: every route of both servers, from their
own route lists, for every role; issue 62's items 1-3 as reproduced there, refused; the docs'
table equal to the code's; and the audit of writes and of a burst of wrong passwords."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import prewarmed
import pytest

from flows.stack import auth as stack_auth
from flows.stack import checks, policy
from flows.stack import servers as stack
from flows.stack.audit import TRIES

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
ROLES = {"vic": "viewer", "wok": "worker", "stack-admin": "admin"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    if shutil.which("caddy") is None:
        if os.environ.get("MLLM_REQUIRE_CADDY") == "1":
            pytest.fail("MLLM_REQUIRE_CADDY=1 but caddy is not installed", pytrace=False)
        pytest.skip("the secured stack needs Caddy: apt-get install caddy")
    root = tmp_path_factory.mktemp("policy")
    home = root / "stack"
    mp = pytest.MonkeyPatch()
    mp.setenv("HOME", str(root / "home"))
    try:
        stack.up(
            home,
            str(root / "storage"),
            pool="local",
            prefect_port=0,
            mlflow_port=0,
            auth=True,
            local_worker=True,
            worker_env={"OMP_NUM_THREADS": "1"},
        )
        for name, role in ROLES.items():
            if name != "stack-admin":
                stack_auth.add_user(home, name, role)
        stack_auth.sync_mlflow(home)
        yield home
    finally:
        stack.down(home, force=True)
        mp.undo()


class _RetryBusy(httpx.HTTPTransport):
    """Sends a request again when the server answers 503, as Prefect's own client does: Prefect's
    server on SQLite answers 503 when the database was busy (SQLITE_BUSY), a write that met another
    one; neither the gate nor Caddy answers 503."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for wait in (0.5, 1, 2, 4):
            response = super().handle_request(request)
            if response.status_code != 503:
                return response
            response.close()
            time.sleep(wait)
        return super().handle_request(request)


def _client(home: Path, user: str | None, secret: str | None = None) -> httpx.Client:
    ends = stack_auth.secured(home)
    auth = None
    if user:
        auth = (user, secret or stack_auth.credential(home, user)[1])
    verify = ssl.create_default_context(cafile=ends["certs"]["ca"])
    return httpx.Client(transport=_RetryBusy(verify=verify), auth=auth, timeout=120, trust_env=False)


def _base(home: Path, server: str) -> str:
    ends = stack_auth.secured(home)
    return ends["api"][:-4] if server == "prefect" else ends["tracking"]


def _fill(template: str) -> str:
    # Placeholders that are no literal segment of any route (never "filter" or "count").
    return re.sub(r"\{([^}:]+)(:path)?\}", lambda m: str(uuid.UUID(int=7)) if "id" in m.group(1) else "mx-7", template)


def _body(server: str, rule: policy.Rule) -> bytes:
    if rule.check == "training":
        return json.dumps(
            {"entrypoint": policy.TRAINING_ENTRYPOINT, "name": "train-matrix", "flow_id": str(uuid.UUID(int=7))}
        ).encode()
    if rule.check == "results":
        return json.dumps({"name": policy.RESULTS_PREFIX + "matrix"}).encode()
    return b"{}" if rule.check == "jobvars" else b"{"  # the server refuses a broken body before acting


# -- the policy is the code's, for the servers' own routes ---------------------------------------


def test_route_lists_are_the_pinned_servers_own_and_each_has_a_rule() -> None:
    # In a process of its own: MLflow's auth app changes MLflow's Flask app where it is made.
    listed = subprocess.run(
        [sys.executable, "-c", "import json; from flows.stack import routes; print(json.dumps(routes.current()))"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    live = json.loads(listed.stdout.strip().splitlines()[-1])
    assert {s: [tuple(r) for r in found] for s, found in live.items()} == policy.routes(), (
        "the servers' routes changed: run `python -m flows.stack.routes`, then review flows/stack/policy.py"
    )
    for server, found in live.items():
        for method, template in found:
            rule = policy.rule_for(server, method, template)
            assert rule is not policy.DENIED, (server, method, template)
            # What the gate enforces for a concrete path of the route is the table's rule.
            if "{" not in template or not template.startswith("/{"):
                enforced, _ = policy.decide(server, method, _fill(template))
                assert enforced.roles == rule.roles, (server, method, template, enforced, rule)


def test_docs_table_is_the_code() -> None:
    text = (REPO / "docs" / "team-stack.md").read_text()
    start, end = "<!-- policy table: generated -->\n", "<!-- end of the policy table -->"
    assert start in text and end in text
    assert text.split(start, 1)[1].split(end, 1)[0] == policy.render(), (
        "docs/team-stack.md's policy table is not the code's: paste flows.stack.policy.render() there"
    )


def _cells(server: str) -> list[tuple[str, str, str, policy.Rule]]:
    cells = []
    for method, template in policy.routes()[server]:
        rule, _ = policy.decide(server, method, _fill(template))
        cells.append((method, template, _fill(template), rule))
    return cells


def _unsafe(method: str, template: str) -> bool:
    """A route an admin's request would really act on: one that wipes something real (MLflow's
    demo routes delete without a body), or MLflow's AI gateway and GenAI routes, which call model
    providers off this machine."""
    return (method in ("DELETE", "PUT") and "{" not in template) or any(
        word in template for word in ("/gateway", "/genai", "/prompt-optimization", "/scorers", "/demo/")
    )


def _http_row(home: Path, user: str, server: str, cells) -> list[tuple]:
    got = []
    with _client(home, user) as client:
        for method, template, path, rule in cells:
            if method == "WS" or (ROLES[user] == "admin" and _unsafe(method, template)):
                continue
            body = None if method in ("GET", "DELETE") else _body(server, rule)
            try:
                r = client.request(
                    method, _base(home, server) + path, content=body, headers={"Content-Type": "application/json"}
                )
            except httpx.TransportError as e:
                raise AssertionError(f"{user} {method} {server} {path}: {type(e).__name__}: {e}") from e
            # The role's refusal; a body check's (the placeholders are no real objects) is not the matrix's.
            refused = r.headers.get("x-stack-gate") == "refused" and (
                r.status_code != 403 or r.json()["detail"].startswith("forbidden: the role")
            )
            got.append((method, template, ROLES[user] in rule.roles, refused, r.status_code))
    return got


def test_every_route_for_every_role_over_https(home: Path) -> None:
    wrong = []
    with ThreadPoolExecutor(3) as pool:
        rows = [
            pool.submit(_http_row, home, user, server, _cells(server)) for user in ROLES for server in policy.routes()
        ]
        for user_server, row in zip([(u, s) for u in ROLES for s in policy.routes()], rows):
            for method, template, allowed, refused, status in row.result():
                if allowed == refused or (refused and status != 403):
                    wrong.append((*user_server, method, template, "allowed" if allowed else "refused", status))
    assert not wrong, wrong[:40]


def _socket(home: Path, path: str, user: str | None) -> int:
    """The handshake's status of a websocket to the Prefect endpoint (101: opened)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = _base(home, "prefect").replace("https://", "wss://") + path
    headers = {}
    if user:
        token = base64.b64encode(f"{user}:{stack_auth.credential(home, user)[1]}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    ctx = ssl.create_default_context(cafile=stack_auth.secured(home)["certs"]["ca"])
    try:
        with connect(url, ssl=ctx, additional_headers=headers, subprotocols=["prefect"], open_timeout=60):
            return 101
    except InvalidStatus as e:
        return e.response.status_code


def test_every_websocket_for_every_role(home: Path) -> None:
    for method, template in policy.routes()["prefect"]:
        if method != "WS":
            continue
        rule, _ = policy.decide("prefect", "WS", _fill(template))
        for user, role in ROLES.items():
            assert _socket(home, _fill(template), user) == (101 if role in rule.roles else 403), (template, user)
        assert _socket(home, _fill(template), None) == (101 if policy.has(rule, "token") else 401), template


# -- issue 62's items 1-3, repeated as written -----------------------------------------------------


def _hello(pool: str) -> str:
    from prefect.client.schemas import worker_channel as wc

    payload = {
        "consumer_id": str(uuid.uuid4()),
        "worker_name": "intruder",
        "worker_type": "process",
        "heartbeat_interval_seconds": 30,
        "supported_channel_versions": [wc.WORK_POOL_WORKER_CHANNEL_VERSION],
        "requested_capabilities": sorted(wc.SUPPORTED_WORKER_CHANNEL_CAPABILITIES),
        "create_pool_if_not_found": True,
        "default_base_job_template": {
            "job_configuration": {"command": "{{ command }}"},
            "variables": {"properties": {"command": {"type": "string", "default": "sh -c 'id > /tmp/owned'"}}},
        },
    }
    return wc.WorkerHelloFrame.model_validate(
        {"type": "worker.hello.v1", "id": str(uuid.uuid4()), "sent_at": "2026-11-29T00:00:00Z", "payload": payload}
    ).model_dump_json()


def _pool(home: Path, name: str) -> httpx.Response:
    with _client(home, "stack-admin") as admin:
        return admin.get(f"{_base(home, 'prefect')}/api/work_pools/{name}")


def test_item1_a_viewer_opens_no_worker_channel_and_a_worker_makes_no_pool(home: Path) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    # The viewer: refused at the handshake, whatever it would send.
    assert _socket(home, "/api/work_pools/local/workers/connect", "vic") == 403
    # A worker's hello asking for a new pool with its own command: the pool is never made.
    url = _base(home, "prefect").replace("https://", "wss://") + "/api/work_pools/owned/workers/connect"
    token = f"wok:{stack_auth.credential(home, 'wok')[1]}"
    ctx = ssl.create_default_context(cafile=stack_auth.secured(home)["certs"]["ca"])
    with connect(url, ssl=ctx, subprotocols=["prefect"], open_timeout=60) as ws:
        ws.send(json.dumps({"type": "auth", "token": token}))
        assert json.loads(ws.recv(timeout=60))["type"] == "auth_success"
        ws.send(_hello("owned"))
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=60)
    assert _pool(home, "owned").status_code == 404


def test_item2_a_viewer_deletes_nothing_whatever_the_path_ends_with(home: Path) -> None:
    api = _base(home, "prefect") + "/api"
    with _client(home, "stack-admin") as admin, _client(home, "vic") as viewer:
        assert admin.post(f"{api}/variables/", json={"name": "count", "value": 1}).status_code in (201, 409)
        assert admin.post(f"{api}/concurrency_limits/", json={"tag": "filter", "concurrency_limit": 1}).status_code in (
            200,
            201,
        )
        for path in (
            "/variables/name/count",
            "/concurrency_limits/tag/filter",
            "/work_pools/local/queues/paginate",
            "/work_pools/local/workers/history",
            "/v2/concurrency_limits/count",
        ):
            r = viewer.delete(api + path)
            assert r.status_code == 403 and r.headers["x-stack-gate"] == "refused", (path, r.status_code)
        assert admin.get(f"{api}/variables/name/count").status_code == 200
        assert admin.get(f"{api}/concurrency_limits/tag/filter").status_code == 200


def test_item3_a_worker_runs_no_command_of_its_own_and_changes_no_pool(home: Path) -> None:
    api = _base(home, "prefect") + "/api"
    with _client(home, "stack-admin") as admin, _client(home, "wok") as worker:
        flow = admin.post(f"{api}/flows/", json={"name": "train"}).json()["id"]
        dep = admin.post(
            f"{api}/deployments/",
            json={
                "name": "train-local",
                "flow_id": flow,
                "work_pool_name": "local",
                "entrypoint": policy.TRAINING_ENTRYPOINT,
            },
        ).json()["id"]
        for variables, field in (
            ({"command": "sh -c 'cat auth/users.json'"}, "'command'"),
            ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env.LD_PRELOAD"),
            ({"working_dir": "/"}, "'working_dir'"),
            ({"env": {"MLFLOW_TRACKING_URI": "https://elsewhere.example"}}, "MLFLOW_TRACKING_URI"),
        ):
            r = worker.post(f"{api}/deployments/{dep}/create_flow_run", json={"job_variables": variables})
            assert r.status_code == 403 and field in r.json()["detail"], (variables, r.text)
        r = worker.post(
            f"{api}/flow_runs/", json={"flow_id": flow, "deployment_id": dep, "job_variables": {"command": "id"}}
        )
        assert r.status_code == 403 and "'command'" in r.json()["detail"]
        template = {"job_configuration": {"command": "{{ command }}"}, "variables": {"properties": {}}}
        for method, path, body in (
            ("PATCH", "/work_pools/local", {"base_job_template": template}),
            ("PATCH", "/work_pools/local", {"concurrency_limit": 5}),
            ("POST", "/work_pools/", {"name": "mine", "type": "process"}),
            (
                "POST",
                "/deployments/",
                {"name": "x", "flow_id": flow, "entrypoint": "evil.py:f", "work_pool_name": "local"},
            ),
            (
                "POST",
                "/deployments/",
                {
                    "name": "train-local",
                    "flow_id": flow,
                    "entrypoint": policy.TRAINING_ENTRYPOINT,
                    "pull_steps": [{"prefect.deployments.steps.run_shell_script": {"script": "id"}}],
                },
            ),
        ):
            r = worker.request(method, api + path, json=body)
            assert r.status_code == 403 and r.headers["x-stack-gate"] == "refused", (method, path, r.text)
        # What the worker may do: a run of the training with the safe variables.
        ok = worker.post(
            f"{api}/deployments/{dep}/create_flow_run",
            json={"job_variables": {"env": {"MLLM_STORAGE": "/tmp/x"}, "gpus": 0}, "state": {"type": "CANCELLED"}},
        )
        assert ok.status_code == 201, ok.text
    # The stack's pool has no command (nor working folder) a run could set, whatever it asks.
    template = _pool(home, "local").json()["base_job_template"]
    assert "command" not in template["variables"]["properties"] and "command" not in template["job_configuration"]


# -- what a worker of this project does not need, closed -----------------------------------------


def _train_deployment(home: Path, pool: str = "local") -> tuple[str, str]:
    api = _base(home, "prefect") + "/api"
    with _client(home, "stack-admin") as admin:

        def made(path: str, body: dict) -> str:
            for _ in range(10):  # a server on SQLite answers 503 while another write holds it
                r = admin.post(api + path, json=body)
                if r.status_code != 503:
                    break
                time.sleep(1)
            assert r.status_code in (200, 201), r.text
            return r.json()["id"]

        flow = made("/flows/", {"name": "train"})
        entry = policy.TRAINING_ENTRYPOINT
        dep = made(
            "/deployments/", {"name": f"train-{pool}", "flow_id": flow, "work_pool_name": pool, "entrypoint": entry}
        )
    return flow, dep


def test_a_worker_forces_no_state_but_one_that_ends_a_run(home: Path) -> None:
    api = _base(home, "prefect") + "/api"
    flow, dep = _train_deployment(home)
    with _client(home, "wok") as worker, _client(home, "stack-admin") as admin:
        run = admin.post(f"{api}/deployments/{dep}/create_flow_run", json={"state": {"type": "COMPLETED"}}).json()["id"]
        # Forcing a finished run back to SCHEDULED (it would run again) or RUNNING: refused, naming force.
        for kind in ("SCHEDULED", "RUNNING", "COMPLETED", "PENDING"):
            r = worker.post(f"{api}/flow_runs/{run}/set_state", json={"state": {"type": kind}, "force": True})
            assert r.status_code == 403 and "force: true" in r.json()["detail"], (kind, r.text)
        assert admin.get(f"{api}/flow_runs/{run}").json()["state_type"] == "COMPLETED"
        # What Prefect's clients force (a runner marking a cancelled run): taken.
        r = worker.post(f"{api}/flow_runs/{run}/set_state", json={"state": {"type": "CANCELLED"}, "force": True})
        assert r.status_code == 201 and r.json()["status"] == "ACCEPT", r.text
        # The server's own rules still apply to an unforced proposal: not the gate's business.
        r = worker.post(f"{api}/flow_runs/{run}/set_state", json={"state": {"type": "RUNNING"}})
        assert r.headers.get("x-stack-gate") != "refused", r.text


def test_a_worker_points_no_run_at_a_storage_endpoint_of_its_own(home: Path) -> None:
    api = _base(home, "prefect") + "/api"
    _, dep = _train_deployment(home)
    with _client(home, "wok") as worker:
        for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL"):
            r = worker.post(
                f"{api}/deployments/{dep}/create_flow_run",
                json={"job_variables": {"env": {key: "http://collector.example:9000"}}, "state": {"type": "CANCELLED"}},
            )
            assert r.status_code == 403 and f"env.{key}" in r.json()["detail"], (key, r.text)
    # A stack with storage behind an endpoint takes that one, and no other.
    assert (
        checks.job_variables_problem({"env": {"AWS_ENDPOINT_URL": "http://s3.lan:9000/"}}, None, "http://s3.lan:9000")
        is None
    )
    assert "AWS_ENDPOINT_URL" in checks.job_variables_problem(
        {"env": {"AWS_ENDPOINT_URL": "http://other:9000"}}, None, "http://s3.lan:9000"
    )


def test_a_worker_writes_a_result_block_only_for_its_own_base_path(home: Path, tmp_path: Path) -> None:
    """The pipeline saves a result-storage block per storage root (tasks/caching.py); a worker may
    make and save that block again, not point another root's block elsewhere."""
    env = {**os.environ, **stack_auth.client_env(home, "wok"), "HOME": str(tmp_path)}
    save = (
        "from tasks.caching import result_storage; b = result_storage('memory://team/a'); print(b._block_document_name)"
    )
    names = []
    for _ in range(2):  # made, then saved again over itself (a PATCH)
        done = subprocess.run([sys.executable, "-c", save], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        names.append(done.stdout.split()[-1])
    assert names[0] == names[1] and names[0].startswith(policy.RESULTS_PREFIX)
    api = _base(home, "prefect") + "/api"
    with _client(home, "stack-admin") as admin, _client(home, "wok") as worker:
        block = admin.post(
            f"{api}/block_documents/filter", json={"block_documents": {"name": {"any_": [names[0]]}}}
        ).json()[0]
        elsewhere = {"basepath": "memory://elsewhere/prefect-results", "settings": {}}
        r = worker.patch(f"{api}/block_documents/{block['id']}", json={"data": elsewhere})
        assert r.status_code == 403 and "another base path" in r.json()["detail"], r.text
        r = worker.post(
            f"{api}/block_documents/",
            json={
                **{k: block[k] for k in ("block_schema_id", "block_type_id")},
                "name": names[0] + "x",
                "data": elsewhere,
            },
        )
        assert r.status_code == 403, r.text
        assert (
            admin.get(f"{api}/block_documents/{block['id']}").json()["data"]["basepath"].startswith("memory://team/a")
        )


def test_a_worker_bound_to_a_pool_serves_and_starts_runs_of_that_pool_only(home: Path) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    api = _base(home, "prefect") + "/api"
    with _client(home, "stack-admin") as admin:
        assert admin.post(f"{api}/work_pools/", json={"name": "gpu-a", "type": "process"}).status_code in (201, 409)
    done = prewarmed.run(
        "flows.cli", ["stack", "user", "add", "bound", "--role", "worker", "--pool", "gpu-a", "--home", str(home)]
    )
    assert done.returncode == 0 and "pools gpu-a only" in done.stdout, done.stderr
    _, local_dep = _train_deployment(home, "local")
    _, own_dep = _train_deployment(home, "gpu-a")
    with _client(home, "bound") as bound:
        assert bound.post(f"{api}/work_pools/gpu-a/workers/heartbeat", json={"name": "b"}).status_code == 204
        assert bound.post(f"{api}/work_pools/gpu-a/get_scheduled_flow_runs", json={}).status_code == 200
        for path, body in (
            ("/work_pools/local/workers/heartbeat", {"name": "b"}),
            ("/work_pools/local/get_scheduled_flow_runs", {}),
            ("/deployments/get_scheduled_flow_runs", {"deployment_ids": [local_dep]}),
            (f"/deployments/{local_dep}/create_flow_run", {"state": {"type": "CANCELLED"}}),
        ):
            r = bound.post(api + path, json=body)
            assert r.status_code == 403 and "gpu-a" in r.json()["detail"], (path, r.text)
        r = bound.post(f"{api}/deployments/{own_dep}/create_flow_run", json={"state": {"type": "CANCELLED"}})
        assert r.status_code == 201, r.text
    # Its worker channel: to its own pool only.
    ctx = ssl.create_default_context(cafile=stack_auth.secured(home)["certs"]["ca"])
    token = f"bound:{stack_auth.credential(home, 'bound')[1]}"
    base = _base(home, "prefect").replace("https://", "wss://")
    with connect(
        f"{base}/api/work_pools/local/workers/connect", ssl=ctx, subprotocols=["prefect"], open_timeout=60
    ) as ws:
        ws.send(json.dumps({"type": "auth", "token": token}))
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=60)
    # The other roles take no --pool: a one-line refusal.
    done = prewarmed.run(
        "flows.cli", ["stack", "user", "add", "v2", "--role", "viewer", "--pool", "x", "--home", str(home)]
    )
    assert (
        done.returncode == 2
        and done.stderr.startswith("error: --pool binds a worker")
        and "Traceback" not in done.stderr
    )


# -- issue 62's smaller items ----------------------------------------------------------------------


def test_a_foreign_host_gets_421_and_unauthenticated_http2_writes_get_401(home: Path, tmp_path: Path) -> None:
    base = _base(home, "prefect")
    with _client(home, "stack-admin") as admin:
        assert admin.get(base + "/api/health", headers={"Host": "evil.example"}).status_code == 421
        assert admin.get(base + "/api/health").status_code == 200
    ca = stack_auth.secured(home)["certs"]["ca"]
    absolute = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--cacert",
            ca,
            "--request-target",
            "https://evil.example/api/health",
            base + "/api/health",
        ],
        capture_output=True,
        text=True,
    )
    # An absolute-form target: Caddy takes the Host header's name; the request is the stack's, and
    # answered as one (401 without a credential), never an empty 200.
    assert absolute.stdout in ("401", "421"), absolute
    big = tmp_path / "body.json"
    big.write_text(json.dumps({"x": "y" * 200_000}))
    for _ in range(10):  # "sometimes" a stream error, before: never now
        done = subprocess.run(
            [
                "curl",
                "-sS",
                "--http2",
                "-o",
                "/dev/null",
                "-w",
                "%{http_version} %{http_code}",
                "--cacert",
                ca,
                "-X",
                "POST",
                "-H",
                "Content-Type: application/json",
                "--data-binary",
                f"@{big}",
                base + "/api/flow_runs/",
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and done.stdout == "2 401", (done.returncode, done.stdout, done.stderr)


def test_logs_private_each_secret_in_one_file_and_the_workers_events_stream_connected(home: Path) -> None:
    logs = home / "logs"
    assert logs.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in logs.iterdir()} == {p.name: 0o600 for p in logs.iterdir()}
    data = stack_auth.read_users(home)
    secrets = {f"user {n}": u["secret"] for n, u in data["users"].items()}
    secrets |= {"MLflow's admin": data["mlflow_admin"], "the CSRF key": data["flask_key"]}
    cluster = home / "postgres" / "password"
    if cluster.exists():
        secrets["PostgreSQL's"] = cluster.read_text().strip()
    files = [p for p in home.rglob("*") if p.is_file()]
    for what, secret in secrets.items():
        holding = [str(p.relative_to(home)) for p in files if secret.encode() in p.read_bytes()]
        assert len(holding) == 1, (what, holding)
    # The worker's events stream (Prefect sends its token inside the first message): connected.
    worker_log = (logs / "worker.log").read_text()
    assert "HTTP 401" not in worker_log and "Traceback" not in worker_log and "Unable to connect" not in worker_log
    opened = [
        json.loads(line) for line in (home / "auth/audit/audit.jsonl").read_text().splitlines() if '"websocket"' in line
    ]
    assert {("stack-worker", e["path"]) for e in opened} >= {
        ("stack-worker", "/api/events/out"),
        ("stack-worker", "/api/events/in"),
    }


# -- item 4: nothing unauthenticated on TCP, a second local user gets nothing ---------------------


def test_nothing_unauthenticated_listens_and_a_second_local_user_gets_nothing(home: Path) -> None:
    import psutil

    ends = stack_auth.secured(home)
    # Not the worker's: Prefect's runner listens on loopback for its flow runs' control channel,
    # each connection authenticated by a per-run secret token (prefect/runner/_control_channel.py).
    pids = {
        p
        for s in stack.load(home)["services"]
        if s.pid and s.name != "worker"
        for p in (s.pid, *stack.descendants(s.pid))
    }
    listening = {
        c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids
    }
    cluster = home / "postgres" / "cluster.json"
    # The proxy's two ports, and PostgreSQL's (password authentication on), nothing else.
    allowed = set(ends["ports"].values()) | ({json.loads(cluster.read_text())["port"]} if cluster.exists() else set())
    who = {
        c.laddr.port: " ".join(psutil.Process(c.pid).cmdline()[:6])
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    }
    assert listening <= allowed and set(ends["ports"].values()) <= listening, (who, allowed)
    for sock in [*ends["sockets"].values(), stack_auth.gate_socket(home)]:
        assert Path(sock).parent.stat().st_mode & 0o777 == 0o700, sock
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("the second local user needs root, useradd and runuser")
    other = f"mllm-other{os.getpid() % 100000}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", other], check=True)
    try:
        # What item 4 did: straight to the servers, or through the proxy with no credential.
        given = {
            "sockets": {**ends["sockets"], "gate": str(stack_auth.gate_socket(home))},
            "ports": sorted(ends["ports"].values()),
        }
        done = subprocess.run(
            [
                "runuser",
                "-u",
                other,
                "--",
                "python3",
                str(Path(__file__).with_name("local_user_probe.py")),
                json.dumps(given),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout)
        assert {seen[k] for k in ("prefect", "mlflow", "gate")} <= {"PermissionError", "FileNotFoundError"}, seen
        assert {v for k, v in seen.items() if k not in ("prefect", "mlflow", "gate")} == {401}, seen
    finally:
        subprocess.run(["userdel", other], capture_output=True)
    with _client(home, "stack-admin") as admin:
        assert admin.get(_base(home, "prefect") + "/api/work_pools/local").json()["concurrency_limit"] != 5


# -- the audit -------------------------------------------------------------------------------------


def _audit(home: Path, *args: str) -> list[str]:
    done = prewarmed.run("flows.cli", ["stack", "audit", "--home", str(home), *args], check=True)
    return done.stdout.splitlines()


def test_writes_show_by_user_and_a_burst_of_wrong_passwords_is_throttled(home: Path) -> None:
    """Last in the module: the burst locks this address out of the stack for minutes."""
    audit = home / "auth" / "audit" / "audit.jsonl"
    assert oct(audit.stat().st_mode & 0o777) == "0o600" and oct(audit.parent.stat().st_mode & 0o777) == "0o700"
    with _client(home, "wok") as worker:
        made = worker.post(_base(home, "prefect") + "/api/flows/", json={"name": "audited"}).status_code
    mine = _audit(home, "--user", "wok")
    assert any("write" in line and "POST /api/flows/" in line and f" {made} " in line for line in mine), mine[-5:]
    assert all(" wok " in line for line in mine)
    statuses = []
    with _client(home, "vic", secret="wrong-0") as wrong:
        for i in range(50):
            wrong.auth = httpx.BasicAuth("vic", f"wrong-{i}")
            statuses.append(wrong.get(_base(home, "prefect") + "/api/flows/" + str(uuid.UUID(int=7))).status_code)
    assert statuses[:TRIES] == [401] * TRIES and set(statuses[TRIES + 1 :]) == {429}, statuses
    # Locked out, the right secret is refused too until the lock ends; and the address is locked,
    # so another user's right secret from it as well.
    with _client(home, "vic") as right, _client(home, "wok") as other:
        assert right.get(_base(home, "prefect") + "/api/health").status_code == 429
        assert other.get(_base(home, "prefect") + "/api/health").status_code == 429
    failed = _audit(home, "--failed", "--user", "vic")
    assert sum("login_failed" in line for line in failed) == TRIES + 1
    assert any("lockout" in line and "user:vic locked" in line for line in failed)
    everyone = _audit(home, "--failed")
    assert any("lockout" in line and "address:127.0.0.1 locked" in line for line in everyone), everyone[-5:]
    assert any("locked_out" in line and " wok " in line for line in everyone)
    assert sum("locked_out" in line for line in failed) >= 38
    secret = stack_auth.credential(home, "vic")[1]
    assert secret not in audit.read_text()
