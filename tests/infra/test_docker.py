"""Training in containers for real: a Docker engine, a registry on loopback, the image built from
this checkout and pushed there, a prefect-docker worker on a pool made from infra/pools/docker.json.

The module runs a Prefect server (its own SQLite database, searched for the secret), moto's S3
server and the session's MLflow server, all on 127.0.0.1; the pool's containers use the host's
network to reach them. Storage credentials reach a container only as a credentials file mounted
read-only (the pool's `volumes`), never as a job variable: the worker itself has none.

Skipped, with the reason, where no engine answers (`make docker-setup` starts one).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import prewarmed
import pytest
import yaml
from servers import REPO, BuiltImage, S3Server, background, build_image, quiet_env, run_s3_server, serving
from textdata import make_text

import mllm.train
from flows.stack import servers as stack
from mllm import storage
from mllm.config import RunConfig

pytestmark = pytest.mark.integration

BUCKET = "mllm-docker"
POOL = "docker-test"
KEY_ID = "mllm-test-key"
SECRET = f"mllm-test-secret-{uuid.uuid4().hex}"  # searched for wherever a run leaves a record
CPU = ["train.device=cpu"]
# Long enough to kill in the middle (about 20 s of training on one thread), checkpoints every 50 steps.
LONG = [
    "train.max_steps=400",
    "train.eval_interval=100",
    "train.checkpoint_interval=50",
    "train.log_interval=10",
    "sample.max_new_tokens=20",
]


@dataclass
class DockerStack:
    api: str
    prefect_db: Path
    mlflow: str
    s3: S3Server
    image: BuiltImage
    template: dict
    worker_log: Path
    home: Path
    creds: Path  # the storage credentials file on the Docker host
    pool_defaults: dict = field(default_factory=dict)  # the pool's job variables, unless a test says otherwise

    def env(self, **extra: str) -> dict[str, str]:
        """What the pipeline runs with: the servers, and storage credentials of its own."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLLM_"))}
        return {
            **base,
            "PREFECT_API_URL": self.api,
            "MLFLOW_TRACKING_URI": self.mlflow,
            "AWS_ENDPOINT_URL": self.s3.url,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "MLLM_LOST_AFTER_S": "120",
            **extra,
        }

    def cli(self, *args: str, cwd: Path, **extra: str) -> subprocess.Popen:
        return prewarmed.start("flows.cli", list(args), self.env(**extra), cwd)

    def keys(self, prefix: str) -> list[str]:
        pages = self.s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def set_pool_defaults(self, **changes) -> None:
        """Create or update the pool: infra/pools/docker.json with the stack's defaults, and
        these changes to them (none: the stack's own again)."""
        from prefect import get_client
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.settings import PREFECT_API_URL, temporary_settings

        template = json.loads(json.dumps(self.template))
        for name, value in {**self.pool_defaults, **changes}.items():
            template["variables"]["properties"][name]["default"] = value
        with temporary_settings({PREFECT_API_URL: self.api}), get_client(sync_client=True) as client:
            client.create_work_pool(
                WorkPoolCreate(name=POOL, type="docker", base_job_template=template), overwrite=True
            )


def _args(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def docker_stack(docker_engine, training_image, mlflow_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("docker-stack")
    # The storage credentials, as an administrator would put them on the Docker host: readable by
    # the image's user (uid 1000) only, mounted read-only where botocore looks for them.
    creds = home / "aws-credentials"
    creds.write_text(f"[default]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n")
    if os.geteuid() == 0:
        os.chown(creds, 1000, 1000)
        creds.chmod(0o400)
    else:
        creds.chmod(0o444)
    template = json.loads((REPO / "infra/pools/docker.json").read_text())
    port = stack.free_port()
    api = f"http://127.0.0.1:{port}/api"
    db = home / "prefect.db"
    server_env = {
        **quiet_env(home / "server"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db}",
        "PREFECT_UI_API_URL": api,
    }
    with (
        run_s3_server(home / "s3") as s3,
        serving(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            f"{api}/health",
            home / "prefect-server.log",
            server_env,
            timeout=180,
        ),
    ):
        s3.client().create_bucket(Bucket=BUCKET)
        s3.client().put_object(Bucket=BUCKET, Key="corpus.txt", Body=make_text(6000).encode())
        ds = DockerStack(
            api,
            db,
            mlflow_server.url,
            s3,
            training_image,
            template,
            home / "worker.log",
            home,
            creds,
            dict(
                image=training_image.name,
                image_pull_policy="Always",
                network_mode="host",
                volumes=[f"{creds}:/home/mllm/.aws/credentials:ro"],
                auto_remove=False,
                env={"OMP_NUM_THREADS": "1"},
            ),
        )
        ds.set_pool_defaults()
        # The worker: prefect-docker, on the host; no storage credentials in its environment.
        worker_env = {k: v for k, v in quiet_env(home / "worker").items() if not k.startswith("AWS_")}
        worker_env.update(PREFECT_API_URL=api, PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5")
        worker = background(
            [
                sys.executable,
                "-m",
                "prefect",
                "worker",
                "start",
                "--pool",
                POOL,
                "--type",
                "docker",
                "--name",
                "docker-test-worker",
            ],
            None,
            ds.worker_log,
            worker_env,
        )
        try:
            worker.wait_ready(120, ready=lambda: stack._worker_online(api, POOL, worker.pid))
            yield ds
        finally:
            worker.stop()
            for container in docker_engine.containers.list(all=True, filters={"label": "io.prefect.version"}):
                if container.attrs["Config"]["Image"].startswith(training_image.name.split("/")[0] + "/"):
                    container.remove(force=True)


def _wait_for(what: str, condition, timeout: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout} s")


def _containers(engine, image: str, **filters) -> list:
    return [
        c
        for c in engine.containers.list(all=True, filters={"label": "io.prefect.version", **filters})
        if c.attrs["Config"]["Image"] == image
    ]


@dataclass
class KilledRun:
    returncode: int
    out: str
    err: str
    killed: object  # the docker-py Container that was killed


@pytest.fixture(scope="module")
def killed_run(docker_stack: DockerStack, docker_engine, tmp_path_factory) -> KilledRun:
    """`run --train-on` the docker pool; `docker kill` of the training container once it has
    written a checkpoint; the pipeline submits the run again and it finishes."""
    cwd = tmp_path_factory.mktemp("killed-run")
    proc = docker_stack.cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus.txt",
        "--storage",
        f"s3://{BUCKET}/docker",
        "--train-on",
        POOL,
        *_args(*CPU, *LONG),
        cwd=cwd,
    )
    try:
        _wait_for(
            "checkpoint",
            lambda: any(k.endswith("checkpoints/last.pt") for k in docker_stack.keys("docker/runs/")),
            420,
            proc,
        )
        running = _containers(docker_engine, docker_stack.image.name, status="running")
        assert len(running) == 1, running
        running[0].kill()
        out, err = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
    running[0].reload()
    return KilledRun(proc.returncode, out, err, running[0])


def test_a_killed_container_resumes_from_its_checkpoint_with_the_losses_of_an_uninterrupted_run(
    killed_run: KilledRun, docker_stack: DockerStack, docker_engine, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert killed_run.returncode == 0, killed_run.err[-3000:]
    assert "crashed" in killed_run.err and "resumes from its last checkpoint" in killed_run.err
    image = docker_stack.image
    # The container: from the registry's image (the worker pulled it), killed, no GPU asked for.
    killed = killed_run.killed.attrs
    assert killed["Config"]["Image"] == image.name and killed["State"]["ExitCode"] == 137
    assert killed["Config"]["Labels"]["org.opencontainers.image.revision"] == image.commit
    assert not killed["HostConfig"].get("DeviceRequests")
    assert f"Pulling image {image.name!r}" in docker_stack.worker_log.read_text()

    # Checkpoints in the bucket; the training ends where an uninterrupted one ends.
    run = next(k for k in docker_stack.keys("docker/runs/") if k.endswith("checkpoints/last.pt")).split(
        "/checkpoints/"
    )[0]
    keys = docker_stack.keys(f"{run}/")
    assert {f"{run}/checkpoints/best.pt", f"{run}/trained.json"} <= set(keys)
    trained = json.loads(docker_stack.s3.client().get_object(Bucket=BUCKET, Key=f"{run}/trained.json")["Body"].read())
    assert trained["steps"] == 400 and trained["resumed_from_step"] >= 50
    job = RunConfig.model_validate(
        yaml.safe_load(docker_stack.s3.client().get_object(Bucket=BUCKET, Key=f"{run}/config.yaml")["Body"].read())
    )
    with pytest.MonkeyPatch.context() as mp:  # this process reads the job's inputs from the bucket
        for k, v in docker_stack.env().items():
            if k.startswith("AWS_"):
                mp.setenv(k, v)
        job.paths.checkpoint_dir = str(tmp_path / "uninterrupted")
        reference = mllm.train.train(job)
    assert reference.resumed_from_step == 0
    assert (trained["train_loss"], trained["val_loss"]) == (reference.train_loss, reference.val_loss)

    # MLflow: the containers logged every step once into the pipeline's run, tagged with the
    # image's commit.
    client = MlflowClient(docker_stack.mlflow)
    run_id = next(line.split()[-1] for line in killed_run.out.splitlines() if line.startswith("mlflow run:"))
    logged = client.get_run(run_id)
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert max(steps) == 400 and len(steps) == len(set(steps))
    assert logged.data.tags["git.commit"] == image.commit and logged.data.tags["train.pool"] == POOL
    assert "final_val_loss" in logged.data.metrics

    # Prefect: two training flow runs on the pool, the killed one Crashed.
    with temporary_settings({PREFECT_API_URL: docker_stack.api}), get_client(sync_client=True) as prefect:
        trains = prefect.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])))
    finished = sorted(
        t.state.type.value
        for t in trains
        if t.work_pool_name == POOL and t.parameters["root"] == f"s3://{BUCKET}/docker"
    )
    assert finished == ["COMPLETED", "CRASHED"]


def test_no_secret_in_prefect_docker_inspect_image_history_or_logs(
    killed_run: KilledRun, docker_stack: DockerStack, docker_engine, mlflow_server
) -> None:
    assert killed_run.returncode == 0, killed_run.err[-3000:]  # the secret did reach the storage
    places = {}
    for path in docker_stack.prefect_db.parent.glob("prefect.db*"):  # the database and its WAL
        places[str(path)] = path.read_bytes()
    containers = _containers(docker_engine, docker_stack.image.name)
    assert len(containers) >= 2  # the killed one and the one that finished
    for c in containers:
        places[f"docker inspect {c.name}"] = json.dumps(c.attrs).encode()
        places[f"docker logs {c.name}"] = c.logs()
    places["docker history"] = json.dumps(docker_engine.api.history(docker_stack.image.name)).encode()
    places["docker image inspect"] = json.dumps(docker_engine.images.get(docker_stack.image.name).attrs).encode()
    places["worker log"] = docker_stack.worker_log.read_bytes()
    places["pipeline output"] = (killed_run.out + killed_run.err).encode()
    mlflow_db = Path(mlflow_server.backend_uri.removeprefix("sqlite:///"))
    places["mlflow database"] = mlflow_db.read_bytes()
    assert len(places[str(docker_stack.prefect_db)]) > 100_000  # a real database, with the runs in it
    found = [where for where, data in places.items() if SECRET.encode() in data]
    assert found == []
    # The credentials came in as a read-only mount of a file, not as variables.
    mounts = containers[0].attrs["Mounts"]
    assert any(m["Destination"] == "/home/mllm/.aws/credentials" and not m["RW"] for m in mounts)
    assert not any(e.startswith("AWS_SECRET") for e in containers[0].attrs["Config"]["Env"])


def test_an_image_of_another_commit_refuses_the_job_in_one_line(
    docker_stack: DockerStack, registry, tmp_path: Path
) -> None:
    # Another commit: this one plus a change to the training code, built and pushed as the
    # pipeline's own image is.
    other = tmp_path / "other"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "checkout", "--quiet", docker_stack.image.commit], check=True)
    with open(other / "mllm" / "train.py", "a") as f:
        f.write("\nANOTHER_COMMIT = True\n")  # code, not a comment: a comment changes no key
    subprocess.run(
        [
            "git",
            "-C",
            str(other),
            "-c",
            "user.name=test",
            "-c",
            "user.email=test@localhost",
            "commit",
            "--quiet",
            "-am",
            "another commit",
        ],
        check=True,
    )
    image = build_image(other, registry, tmp_path / "build.log")
    assert image.commit != docker_stack.image.commit
    docker_stack.set_pool_defaults(image=image.name, auto_remove=True)
    try:
        proc = docker_stack.cli(
            "run",
            "--recipe",
            "smoke",
            "--source",
            f"s3://{BUCKET}/corpus.txt",
            "--storage",
            f"s3://{BUCKET}/docker",
            "--train-on",
            POOL,
            *_args(*CPU, "train.max_steps=5"),
            cwd=tmp_path,
        )
        out, err = proc.communicate(timeout=300)
    finally:
        docker_stack.set_pool_defaults()  # the stack's own image and credentials again
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "other training code" in last
    assert f"pipeline at commit {docker_stack.image.commit}" in last and f"worker at commit {image.commit}" in last
    assert "Traceback" not in out + err


def test_a_gpu_on_a_docker_host_without_the_gpu_runtime_fails_in_one_line(
    docker_stack: DockerStack, docker_engine, tmp_path: Path
) -> None:
    if "nvidia" in docker_engine.info().get("Runtimes", {}):
        pytest.skip("this Docker host has the NVIDIA runtime: a GPU request would be granted")
    # train.device left at auto: the pipeline asks the pool for one GPU.
    proc = docker_stack.cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus.txt",
        "--storage",
        f"s3://{BUCKET}/docker",
        "--train-on",
        POOL,
        *_args("train.max_steps=5"),
        cwd=tmp_path,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the Docker host of pool {POOL!r} has no GPU runtime (the NVIDIA Container Toolkit)")
    assert '(Docker: could not select device driver "" with capabilities: gpu)' in last
    assert "Traceback" not in out + err and "submitting it again" not in err  # no pointless restarts


def test_two_containers_as_two_torchrun_nodes_train_as_one_process_with_their_global_batch(
    killed_run: KilledRun, docker_stack: DockerStack, docker_engine, tmp_path: Path
) -> None:
    """`python -m mllm.train` under `torchrun --nnodes 2`, a container a node (one process each,
    c10d rendezvous on loopback, gloo), against one process whose batch is their global batch."""
    import torch

    s3 = docker_stack.s3.client()
    run = next(k for k in docker_stack.keys("docker/runs/") if k.endswith("/config.yaml")).rsplit("/", 1)[0]
    job = RunConfig.model_validate(
        yaml.safe_load(s3.get_object(Bucket=BUCKET, Key=f"{run}/config.yaml")["Body"].read())
    )
    job.train.max_steps, job.train.eval_interval, job.train.checkpoint_interval, job.train.log_interval = 20, 10, 10, 5
    job.model.dropout = 0.0  # the ranks' dropout masks would differ from the single process's
    job.paths.checkpoint_dir = f"s3://{BUCKET}/ddp/checkpoints"
    # The config file is local to each node (mounted); inputs and checkpoints are in the bucket.
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "config.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    (tmp_path / "job" / "config.yaml").chmod(0o644)

    port = stack.free_port()
    creds = str(docker_stack.creds)
    nodes = []
    try:
        for node in range(2):
            events = tmp_path / f"node{node}"
            events.mkdir()
            events.chmod(0o777)  # the image's user writes there
            nodes.append(
                docker_engine.containers.run(
                    docker_stack.image.name,
                    detach=True,
                    network_mode="host",
                    labels={"mllm-test": "ddp"},
                    command=[
                        "torchrun",
                        "--nnodes",
                        "2",
                        "--nproc-per-node",
                        "1",
                        "--rdzv-backend",
                        "c10d",
                        "--rdzv-endpoint",
                        f"127.0.0.1:{port}",
                        "--rdzv-id",
                        "mllm-ddp-test",
                        "--rdzv-conf",
                        f"is_host={str(node == 0).lower()}",
                        # The rendezvous tells nodes apart by host name and process id, and two
                        # containers on the host network share the name and start torchrun under
                        # the same PID: without an address of its own each, the second node passes
                        # for the first and the rendezvous waits forever for a second node.
                        "--local-addr",
                        f"127.0.0.{node + 1}",
                        "-m",
                        "mllm.train",
                        "--config",
                        "/job/config.yaml",
                        "--no-resume",
                        "--events",
                        "/events/events.jsonl",
                    ],
                    # gloo's own connections go over loopback: without a named interface it takes the
                    # host name's address, which the containers do not share (and hangs).
                    environment={
                        "AWS_ENDPOINT_URL": docker_stack.s3.url,
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "OMP_NUM_THREADS": "1",
                        "GLOO_SOCKET_IFNAME": "lo",
                    },
                    volumes={
                        creds: {"bind": "/home/mllm/.aws/credentials", "mode": "ro"},
                        str(tmp_path / "job"): {"bind": "/job", "mode": "ro"},
                        str(events): {"bind": "/events", "mode": "rw"},
                    },
                )
            )
        deadline = time.monotonic() + 240
        # Every container reloaded each time (any() over a generator would stop at the first running one).
        while time.monotonic() < deadline and any([c.reload() or c.status != "exited" for c in nodes]):
            time.sleep(1)
        codes = [c.attrs["State"]["ExitCode"] if c.status == "exited" else c.status for c in nodes]
        logs = [c.logs().decode(errors="replace") for c in nodes]
        assert codes == [0, 0], "\n---\n".join(log[-2000:] for log in logs)
    finally:
        for c in nodes:
            c.remove(force=True)

    # Only rank 0 reports (the events file the pipeline relays to MLflow) and says it is done.
    reported = [tmp_path / f"node{n}" / "events.jsonl" for n in range(2)]
    written = [p for p in reported if p.exists()]
    assert len(written) == 1
    events = [json.loads(line) for line in written[0].read_text().splitlines()]
    result = next(e["result"] for e in events if "result" in e)
    assert result["steps"] == 20 and sum("done: 20 steps" in log for log in logs) == 1
    assert sorted(r["step"] for e in events for r in e.get("metrics", []) if "val_loss" in r) == [10, 20]
    assert "ddp/checkpoints/last.pt" in docker_stack.keys("ddp/checkpoints/")

    # One process, the global batch (2 x batch_size), same data and seed: the same model, so
    # the same loss on the same windows (the runs' own validation batches differ in size).
    single = job.model_copy(deep=True)
    single.train.batch_size = 2 * job.train.batch_size
    single.paths.checkpoint_dir = str(tmp_path / "single")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in docker_stack.env().items():
            if k.startswith("AWS_"):
                mp.setenv(k, v)
        reference = mllm.train.train(single)
        val = np.load(io.BytesIO(storage.read_bytes(job.paths.val_ids)))
    two_nodes = _download(s3, "ddp/checkpoints/last.pt", tmp_path)
    losses = [_loss(path, val, job.train.window) for path in (two_nodes, reference.checkpoint)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    one, two = (torch.load(path, weights_only=True)["model"] for path in (reference.checkpoint, two_nodes))
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight, rtol=1e-3, atol=1e-5)


def _loss(checkpoint: str, ids, window: int) -> float:
    """The model's mean loss on the first 64 windows of `ids`."""
    import torch

    from mllm.lm.windows import windows
    from mllm.runtime.checkpoint import load_checkpoint

    model = load_checkpoint(checkpoint).model
    starts = np.arange(64) * window
    with torch.no_grad():
        return model(*windows(ids, starts, window))[1].item()


def _download(s3, key: str, folder: Path) -> str:
    path = folder / key.replace("/", "_")
    path.write_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    return str(path)
