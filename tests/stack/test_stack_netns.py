"""The secured stack across a network boundary: a network namespace of the test's own, joined to
this machine by a veth pair (two addresses of 10.231.N.0/30, nothing routed further). The stack
listens on the host side's address with TLS and auth; on the other side a real Prefect worker,
started from `stack worker-env`'s file with a `worker` credential, trains what commands run there
too dispatch to its pool (a pipeline, a search, a sweep), with storage in S3 (moto, on the host
side's address) as a remote worker's would be; a viewer there loads the champion and predicts; an
admin cancels a running training as Prefect's UI does. The stack, moto and the worker start once
for the module. No traffic leaves the machine: loopback and the namespace's two addresses only.
Needs root and `ip` (iproute2)."""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import shutil
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import prewarmed
import pytest
from servers import quiet_env, serving
from textdata import make_text

from flows.stack import auth as stack_auth
from flows.stack import servers as stack
from flows.stack.pools import ensure_pool
from flows.stack.processes import Service, free_port

pytestmark = pytest.mark.integration
BUCKET = "mllm-netns"
FAST = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=20",
]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("caddy") is None:
        if os.environ.get("MLLM_REQUIRE_CADDY") == "1" and os.geteuid() == 0:
            pytest.fail("MLLM_REQUIRE_CADDY=1 but `ip` or caddy is missing", pytrace=False)
        pytest.skip("the network-namespace test needs root, iproute2 and caddy")
    n = random.randrange(1, 250)
    name, host_if, ns_if = f"mllm-t{os.getpid()}", f"mh{os.getpid()}", f"mn{os.getpid()}"
    host_ip, ns_ip = f"10.231.{n}.1", f"10.231.{n}.2"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        for args in (
            ("addr", "add", f"{ns_ip}/30", "dev", ns_if),
            ("link", "set", ns_if, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", name, "ip", *args)
        yield name, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def _in_ns(ns: str, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def _curl(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _in_ns(ns, ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", *args]), capture_output=True, text=True
    )


@dataclass
class Site:
    """What the module's tests share: the namespace, the stack, the bucket and the remote worker."""

    ns: str
    host_ip: str
    ns_ip: str
    home: Path
    root: Path
    api: str
    s3: Any
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    worker: Service | None = None

    def env_of(self, user: str) -> dict[str, str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
        return {
            **clean,
            **quiet_env(self.root / f"{user}-home"),
            **self.envs[user],
            "OMP_NUM_THREADS": "1",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "MLLM_LOG_EVERY_S": "1",
        }

    def cli(self, user: str, args: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess | subprocess.Popen:
        """`mllm-pipeline ARGS` run in the namespace with `user`'s worker-env file; started in the
        background when `background=True`."""
        cwd.mkdir(exist_ok=True)
        cmd = _in_ns(self.ns, [sys.executable, "-m", "flows.cli", *args])
        if kw.pop("background", False):
            return subprocess.Popen(
                cmd, cwd=cwd, env=self.env_of(user), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        return subprocess.run(cmd, cwd=cwd, env=self.env_of(user), capture_output=True, text=True, timeout=900)

    def keys(self, prefix: str) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def admin(self) -> httpx.Client:
        ca = stack_auth.secured(self.home)["certs"]["ca"]
        return httpx.Client(
            verify=ssl.create_default_context(cafile=ca),
            auth=stack_auth.credential(self.home, "stack-admin"),
            timeout=60,
            trust_env=False,
        )


def _add_user(site: Site, user: str, role: str) -> None:
    home = str(site.home)
    prewarmed.run("flows.cli", ["stack", "user", "add", user, "--role", role, "--home", home], check=True)
    out = prewarmed.run(
        "flows.cli", ["stack", "worker-env", "--home", home, "--user", user, "--with-storage-credentials"], check=True
    ).stdout
    site.envs[user] = dict(line.split("=", 1) for line in out.splitlines())


@pytest.fixture(scope="module")
def site(netns, tmp_path_factory):
    ns, host_ip, ns_ip = netns
    root = tmp_path_factory.mktemp("netns")
    port = free_port()
    s3 = f"http://{host_ip}:{port}"
    aws = {
        "AWS_ENDPOINT_URL": s3,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "MLFLOW_S3_ENDPOINT_URL": s3,
    }
    moto = [sys.executable, "-m", "moto.server", "-H", host_ip, "-p", str(port)]
    home = root / "stack"
    mp = pytest.MonkeyPatch()
    with serving(moto, f"{s3}/moto-api/", root / "moto.log", quiet_env(root / "moto-home")):
        import boto3

        client = boto3.client(
            "s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="corpus.txt", Body=make_text(6000).encode())
        for k, v in {**aws, "HOME": str(root / "home")}.items():
            mp.setenv(k, v)
        site = None
        try:
            state = stack.up(home, f"s3://{BUCKET}/mlflow", pool="local", prefect_port=0, mlflow_port=0, listen=host_ip)
            site = Site(ns, host_ip, ns_ip, home, root, state["env"]["PREFECT_API_URL"], client)
            # gpu-box: the remote machine's worker; ana: a person who launches sweeps from there
            # (a worker's role: a viewer runs nothing); vic: a viewer.
            for user, role in (("gpu-box", "worker"), ("ana", "worker"), ("vic", "viewer")):
                _add_user(site, user, role)
            # A real worker there, of a pool an admin made (a worker credential makes no pool), from
            # the file's settings alone.
            stack_auth.register(home)
            ensure_pool(site.api, "gpu", stack_auth.open_url)
            cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "gpu", "--type", "process"]
            site.worker = Service(
                "gpu-worker",
                _in_ns(ns, [*cmd, "--name", "gpu-box"]),
                str(root / "gpu-worker.log"),
                env=site.env_of("gpu-box"),
            ).start()
            stack_auth.register(home)
            site.worker.wait_ready(180, ready=lambda: stack._worker_online(site.api, "gpu", site.worker.pid))
            yield site
        finally:
            if site is not None and site.worker is not None:
                site.worker.stop()
            stack.down(home, force=True)
            mp.undo()


def test_a_worker_across_the_boundary_trains_and_a_viewer_there_loads_the_champion(site: Site) -> None:
    ns, host_ip, home, api = site.ns, site.host_ip, site.home, site.api
    assert api.startswith(f"https://{host_ip}:")
    # Only the listening address: the stack's processes listen on that port there alone, not on
    # loopback's side (where another test's server may hold the same number).
    import psutil

    stack_pids = {p for s in stack.load(home)["services"] if s.pid for p in (s.pid, *stack.descendants(s.pid))}
    api_port = int(api.split(":")[2].split("/")[0])
    listening = {
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == api_port and c.pid in stack_pids
    }
    assert listening == {host_ip}, listening
    envs = site.envs
    assert envs["gpu-box"]["AWS_ENDPOINT_URL"].startswith(f"http://{host_ip}:")
    assert envs["gpu-box"]["PREFECT_WORK_POOL"] == "local"
    # From the other side: no credential, plain HTTP.
    ca = envs["vic"]["PREFECT_API_SSL_CERT_FILE"]
    for _ in range(20):  # the proxy's TLS listener may still be coming up on the new address
        probe = _curl(ns, "--cacert", ca, f"{api}/flow_runs/filter", "-X", "POST", "-d", "{}")
        if probe.stdout != "000":
            break
        time.sleep(0.5)
    plain = _curl(ns, api.replace("https://", "http://") + "/health")
    assert probe.stdout == "401" and plain.stdout == "400", (probe.returncode, probe.stderr, plain)
    done = site.cli(
        "gpu-box",
        [
            "run",
            "--recipe",
            "smoke",
            "--source",
            f"s3://{BUCKET}/corpus.txt",
            "--storage",
            f"s3://{BUCKET}/ns",
            "--train-on",
            "gpu",
            *[a for s in FAST for a in ("--set", s)],
        ],
        site.root / "run",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model: smoke v1 (promoted to champion" in done.stdout
    run_id = next(line.split()[-1] for line in done.stdout.splitlines() if line.startswith("mlflow run:"))
    script = f"""
import json, mlflow.pyfunc
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
client = MlflowClient()
steps = [m.step for m in client.get_metric_history({run_id!r}, "train_loss")]
with get_client(sync_client=True) as prefect:
    trains = prefect.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])))
    tasks = prefect.read_task_runs()
model = mlflow.pyfunc.load_model("models:/smoke@champion")
[text] = model.predict(["The "], params={{"method": "greedy", "max_new_tokens": 15}})
print(json.dumps({{"steps": max(steps), "trains": [(t.work_pool_name, t.state.type.value) for t in trains],
                  "tasks": sorted({{t.state.type.value for t in tasks}}), "n_tasks": len(tasks), "text": text}}))
"""
    read = subprocess.run(
        _in_ns(ns, [sys.executable, "-c", script]),
        env=site.env_of("vic"),
        capture_output=True,
        text=True,
        cwd=site.root / "run",
        timeout=300,
    )
    assert read.returncode == 0, read.stderr[-3000:]
    seen = json.loads(read.stdout.strip().splitlines()[-1])
    assert seen["steps"] == 12 and seen["trains"] == [["gpu", "COMPLETED"]] and seen["text"]
    assert seen["tasks"] == ["COMPLETED"] and seen["n_tasks"] >= 5
    assert any(k.endswith("checkpoints/best.pt") for k in site.keys("ns/"))
    # The worker's secret: nowhere in the stack's home (its users file aside), the bucket, the terminal.
    secret = envs["gpu-box"]["MLFLOW_TRACKING_PASSWORD"]
    for path in home.rglob("*"):
        if path.is_file() and path.name not in ("users.json",):
            assert secret.encode() not in path.read_bytes(), path
    for key in site.keys(""):
        assert secret.encode() not in site.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read(), key
    assert secret not in done.stdout + done.stderr + read.stdout + read.stderr
    assert secret not in Path(site.worker.log).read_text()


def _children_pools(site: Site, parent: str) -> list[str]:
    """The pools the MLflow runs nested under `parent` (a search's trials, a sweep's points) trained on."""
    mlflow = stack_auth.secured(site.home)["tracking"] + "/api/2.0/mlflow"
    with site.admin() as admin:
        experiment = admin.get(f"{mlflow}/runs/get", params={"run_id": parent}).json()["run"]["info"]["experiment_id"]
        found = admin.post(
            f"{mlflow}/runs/search",
            json={"experiment_ids": [experiment], "filter": f"tags.`mlflow.parentRunId` = '{parent}'"},
        ).json()
    return sorted(next(t["value"] for t in r["data"]["tags"] if t["key"] == "train.pool") for r in found["runs"])


def _audit(site: Site, *args: str) -> list[str]:
    done = prewarmed.run("flows.cli", ["stack", "audit", "--home", str(site.home), *args], check=True)
    return done.stdout.splitlines()


def test_the_remote_worker_runs_a_search_and_a_sweep_and_the_audit_names_the_sweeps_writes(site: Site) -> None:
    sets = [a for s in FAST for a in ("--set", s)]
    common = ["--recipe", "smoke", "--source", f"s3://{BUCKET}/corpus.txt", "--train-on", "gpu"]
    started = datetime.datetime.now(datetime.UTC).isoformat()
    # At once, as two people of a team would: the search as the worker's user, the sweep as ana's.
    search = [
        "search",
        *common,
        "--storage",
        f"s3://{BUCKET}/search",
        "--space",
        "train.lr=log:1e-4..1e-2",
        "--trials",
        "2",
        "--sampler",
        "random",
        "--startup-trials",
        "1",
        *sets,
    ]
    sweep = ["sweep", *common, "--storage", f"s3://{BUCKET}/sweep", "--grid", "train.lr=1e-3,3e-3", *sets]
    procs = {
        "search": site.cli("gpu-box", search, site.root / "search", background=True),
        "sweep": site.cli("ana", sweep, site.root / "sweep", background=True),
    }
    outs = {}
    try:
        for word, proc in procs.items():
            outs[word], err = proc.communicate(timeout=900)
            assert proc.returncode == 0, (word, err[-3000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for word, out in outs.items():
        pools = _children_pools(site, re.search(rf"{word} mlflow run: (\w+)", out).group(1))
        assert pools == ["gpu", "gpu"], (word, pools)
    # Every trial's and point's training ran on the remote worker's pool and completed.
    with site.admin() as admin:
        trains = admin.post(
            site.api + "/flow_runs/filter",
            json={"flows": {"name": {"any_": ["train"]}}, "flow_runs": {"start_time": {"after_": started}}},
        ).json()
    assert sorted((t["work_pool_name"], t["state_type"]) for t in trains) == [("gpu", "COMPLETED")] * 4, trains
    # The sweep's writes, by the user who ran it: its flow runs and its MLflow runs, each a line.
    mine = _audit(site, "--user", "ana", "--since", started)
    assert mine and all(" ana " in line for line in mine), mine[:5]
    # (A request the server answered 503, busy, is a line too, and its retry another.)
    made = [
        line
        for line in mine
        if "POST /api/deployments/" in line and line.split("?")[0].endswith("/create_flow_run") and " 201 " in line
    ]
    assert len(made) == 2 and all(" write " in line for line in made), mine
    assert any("POST /api/2.0/mlflow/runs/create" in line and " 200 " in line for line in mine), mine
    assert all(site.ns_ip in line for line in mine)
    # The trainings' own writes are the worker's, not ana's.
    theirs = _audit(site, "--user", "gpu-box", "--since", started)
    assert any("/set_state" in line and " write " in line for line in theirs), theirs[-5:]


def _training_processes(flow_run_id: str) -> list[int]:
    """The processes of a flow run (the engine and the training's ranks it starts: they inherit
    the run's id in their environment), on either side of the boundary (one process table)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_cancel_from_the_ui_stops_the_remote_training_within_10s_with_last_pt_written(site: Site) -> None:
    """Last in the module: it ends with the worker's log, after everything it served."""
    # A training far from its end and from any checkpoint: only the cancel can write last.pt.
    long = ["train.max_steps=100000", "train.eval_interval=100000", "train.checkpoint_interval=100000"]
    proc = site.cli(
        "gpu-box",
        [
            "run",
            "--recipe",
            "smoke",
            "--source",
            f"s3://{BUCKET}/corpus.txt",
            "--storage",
            f"s3://{BUCKET}/cancel",
            "--train-on",
            "gpu",
            *[a for s in [*FAST[3:], *long] for a in ("--set", s)],
        ],
        site.root / "cancel",
        background=True,
    )
    try:
        with site.admin() as admin:
            run, deadline = None, time.monotonic() + 600
            while run is None and proc.poll() is None and time.monotonic() < deadline:
                running = admin.post(
                    site.api + "/flow_runs/filter",
                    json={
                        "flows": {"name": {"any_": ["train"]}},
                        "flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}},
                    },
                ).json()
                # Training, not still loading: its ranks are up and have logged a step to MLflow.
                if running and _stepped(site, running[0]):
                    run = running[0]
                time.sleep(1)
            assert run is not None, (
                proc.communicate(timeout=60)[1][-3000:] if proc.poll() is not None else "no training"
            )
            assert not [k for k in site.keys("cancel/") if k.endswith("checkpoints/last.pt")]
            assert _training_processes(run["id"])
            # What Prefect's UI does on "Cancel": the run's state set to CANCELLING, as an admin.
            asked = time.monotonic()
            r = admin.post(f"{site.api}/flow_runs/{run['id']}/set_state", json={"state": {"type": "CANCELLING"}})
            assert r.status_code == 201 and r.json()["status"] == "ACCEPT", r.text
            stopped = written = None
            while time.monotonic() - asked < 60 and not (stopped and written):
                if stopped is None and not _training_processes(run["id"]):
                    stopped = time.monotonic() - asked
                if written is None and [k for k in site.keys("cancel/") if k.endswith("checkpoints/last.pt")]:
                    written = time.monotonic() - asked
                time.sleep(0.2)
            # The run ends Cancelled: not left Running or Cancelling, nor Crashed (the training runs in
            # a thread, so the run's process acks the runner's cancel; tasks/model/train.py).
            while time.monotonic() - asked < 60:
                state = admin.get(f"{site.api}/flow_runs/{run['id']}").json()["state_type"]
                if state not in ("RUNNING", "CANCELLING"):
                    break
                time.sleep(0.5)
            history = [
                (h["type"], h["name"], h["message"])
                for h in admin.get(f"{site.api}/flow_run_states/", params={"flow_run_id": run["id"]}).json()
            ]
        print(f"after the UI's cancel: last.pt written in {written} s, the training's processes gone in {stopped} s")
        assert stopped is not None and stopped <= 10, (stopped, history)
        assert written is not None and written <= 10, (written, history)
        assert state == "CANCELLED" and "CANCELLING" in [h[0] for h in history], (
            history,
            Path(site.worker.log).read_text()[-3000:],
        )
        # The command that handed the training over ends, saying so; it does not submit it again
        # as it would a crashed one.
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
        assert "on pool 'gpu' was cancelled" in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # The worker's events stream was connected all along (the token in the first message, taken by
    # the stack's gate): no 401, no fallback to polling, no CancelledError traceback in its log.
    worker_log = Path(site.worker.log).read_text()
    for bad in ("HTTP 401", "Unable to connect", "CancelledError", "Traceback"):
        assert bad not in worker_log, (bad, worker_log[-3000:])
    audit = [json.loads(line) for line in (site.home / "auth/audit/audit.jsonl").read_text().splitlines()]
    assert any(
        e["event"] == "websocket"
        and e["user"] == "gpu-box"
        and e["path"] == "/api/events/out"
        and e["source"] == site.ns_ip
        for e in audit
    )


def _stepped(site: Site, flow_run: dict) -> bool:
    """Whether the training of `flow_run` has logged a training step to MLflow (its run is tagged
    with the flow run's id)."""
    mlflow = stack_auth.secured(site.home)["tracking"] + "/api/2.0/mlflow"
    with site.admin() as admin:
        experiments = admin.post(f"{mlflow}/experiments/search", json={"max_results": 100}).json()
        found = admin.post(
            f"{mlflow}/runs/search",
            json={
                "experiment_ids": [e["experiment_id"] for e in experiments.get("experiments", [])],
                "filter": "attributes.status = 'RUNNING'",
            },
        ).json()
    return any(any(m["key"] == "train_loss" for m in r["data"].get("metrics", [])) for r in found.get("runs", []))
