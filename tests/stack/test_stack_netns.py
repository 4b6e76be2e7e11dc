"""The secured stack across a network boundary: a network namespace of the test's own, joined to
this machine by a veth pair (two addresses of 10.231.N.0/30, nothing routed further). The stack
listens on the host side's address with TLS and auth; on the other side a real Prefect worker,
started from `stack worker-env`'s file, trains a pipeline's model that a command run there too
dispatches to its pool, with storage in S3 (moto, on the host side's address) as a remote
worker's would be; a viewer there loads the champion and predicts. No traffic leaves the
machine: loopback and the namespace's two addresses only. Needs root and `ip` (iproute2)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def test_a_worker_across_the_boundary_trains_and_a_viewer_there_loads_the_champion(netns, tmp_path: Path) -> None:
    ns, host_ip, ns_ip = netns
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
    home = tmp_path / "stack"
    mp = pytest.MonkeyPatch()
    with serving(moto, f"{s3}/moto-api/", tmp_path / "moto.log", quiet_env(tmp_path / "moto-home")):
        import boto3

        client = boto3.client(
            "s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="corpus.txt", Body=make_text(6000).encode())
        for k, v in {**aws, "HOME": str(tmp_path / "home")}.items():
            mp.setenv(k, v)
        worker = None
        try:
            state = stack.up(home, f"s3://{BUCKET}/mlflow", pool="local", prefect_port=0, mlflow_port=0, listen=host_ip)
            api = state["env"]["PREFECT_API_URL"]
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
            envs = {}
            for user, role in (("gpu-box", "worker"), ("vic", "viewer")):
                prewarmed.run(
                    "flows.cli", ["stack", "user", "add", user, "--role", role, "--home", str(home)], check=True
                )
                out = prewarmed.run(
                    "flows.cli",
                    ["stack", "worker-env", "--home", str(home), "--user", user, "--with-storage-credentials"],
                    check=True,
                ).stdout
                (tmp_path / f"{user}.env").write_text(out)
                envs[user] = dict(line.split("=", 1) for line in out.splitlines())
            assert envs["gpu-box"]["AWS_ENDPOINT_URL"] == s3 and envs["gpu-box"]["PREFECT_WORK_POOL"] == "local"
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}

            def env_of(user: str) -> dict[str, str]:
                return {
                    **clean,
                    **quiet_env(tmp_path / f"{user}-home"),
                    **envs[user],
                    "OMP_NUM_THREADS": "1",
                    "PREFECT_WORKER_QUERY_SECONDS": "1",
                    "MLLM_LOG_EVERY_S": "1",
                }

            # From the other side: no credential, plain HTTP.
            for _ in range(20):  # the proxy's TLS listener may still be coming up on the new address
                probe = subprocess.run(
                    _in_ns(
                        ns,
                        [
                            "curl",
                            "-sS",
                            "-o",
                            "/dev/null",
                            "-w",
                            "%{http_code}",
                            "--cacert",
                            envs["vic"]["PREFECT_API_SSL_CERT_FILE"],
                            f"{api}/flow_runs/filter",
                            "-X",
                            "POST",
                            "-d",
                            "{}",
                        ],
                    ),
                    capture_output=True,
                    text=True,
                )
                if probe.stdout != "000":
                    break
                time.sleep(0.5)
            plain = subprocess.run(
                _in_ns(
                    ns,
                    [
                        "curl",
                        "-s",
                        "-o",
                        "/dev/null",
                        "-w",
                        "%{http_code}",
                        api.replace("https://", "http://") + "/health",
                    ],
                ),
                capture_output=True,
                text=True,
            )
            if shutil.which("curl"):
                assert probe.stdout == "401" and plain.stdout == "400", (probe.returncode, probe.stderr, plain)
            # A real worker there, of a pool an admin made (a worker credential makes no pool), from the
            # file's settings alone.
            stack_auth.register(home)
            ensure_pool(api, "gpu", stack_auth.open_url)
            worker = Service(
                "gpu-worker",
                _in_ns(
                    ns,
                    [
                        sys.executable,
                        "-m",
                        "prefect",
                        "worker",
                        "start",
                        "--pool",
                        "gpu",
                        "--type",
                        "process",
                        "--name",
                        "gpu-box",
                    ],
                ),
                str(tmp_path / "gpu-worker.log"),
                env=env_of("gpu-box"),
            ).start()
            stack_auth.register(home)
            worker.wait_ready(180, ready=lambda: stack._worker_online(api, "gpu", worker.pid))
            (tmp_path / "run").mkdir()
            done = subprocess.run(
                _in_ns(
                    ns,
                    [
                        sys.executable,
                        "-m",
                        "flows.cli",
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
                ),
                cwd=tmp_path / "run",
                env=env_of("gpu-box"),
                capture_output=True,
                text=True,
                timeout=900,
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
                env=env_of("vic"),
                capture_output=True,
                text=True,
                cwd=tmp_path / "run",
                timeout=300,
            )
            assert read.returncode == 0, read.stderr[-3000:]
            seen = json.loads(read.stdout.strip().splitlines()[-1])
            assert seen["steps"] == 12 and seen["trains"] == [["gpu", "COMPLETED"]] and seen["text"]
            assert seen["tasks"] == ["COMPLETED"] and seen["n_tasks"] >= 5
            keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="ns/").get("Contents", [])]
            assert any(k.endswith("checkpoints/best.pt") for k in keys)
            # The worker's secret: nowhere in the stack's home (its users file aside), the bucket, the terminal.
            secret = envs["gpu-box"]["MLFLOW_TRACKING_PASSWORD"]
            for path in home.rglob("*"):
                if path.is_file() and path.name not in ("users.json",):
                    assert secret.encode() not in path.read_bytes(), path
            for key in [
                o["Key"]
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
                for o in page.get("Contents", [])
            ]:
                assert secret.encode() not in client.get_object(Bucket=BUCKET, Key=key)["Body"].read(), key
            assert secret not in done.stdout + done.stderr + read.stdout + read.stderr
            assert secret not in Path(worker.log).read_text()
            # Its events stream connected (the token in the first message, taken by the stack's gate).
            worker_log = Path(worker.log).read_text()
            assert "HTTP 401" not in worker_log and "Unable to connect" not in worker_log, worker_log[-3000:]
            audit = [json.loads(line) for line in (home / "auth/audit/audit.jsonl").read_text().splitlines()]
            assert any(
                e["event"] == "websocket"
                and e["user"] == "gpu-box"
                and e["path"] == "/api/events/out"
                and e["source"] == ns_ip
                for e in audit
            )
        finally:
            if worker is not None:
                worker.stop()
            stack.down(home, force=True)
            mp.undo()
