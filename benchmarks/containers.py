"""What training in a container costs: the image build (cold and cached), the image's size, and
the time from `--train-on` to the first training step on a docker pool against a process pool.

    python -m benchmarks.containers [--quick] [--no-cold]

Needs a Docker engine, Debian's docker-registry and, for the local base image, root and
debootstrap (`make docker-setup`). What it starts, on 127.0.0.1 with free ports, and stops after:
a registry, moto's S3 server, the stack (`mllm-pipeline stack up`: Prefect server, MLflow
server, a process worker of pool "local") and a prefect-docker worker of a docker pool made from
infra/pools/docker.json, which runs containers on the host's network with a credentials file
mounted read-only, as tests/infra/test_docker.py does.

- build, cold: infra/docker/base-image.sh after removing its image (debootstrap), then
  build-image.sh --no-cache: every layer, torch and the dependencies installed from the index;
- build, cached: build-image.sh again at the same commit (Docker's layer cache);
- push: to an empty registry (the layers of torch and of the dependencies are most of it);
- to the first step: `mllm-pipeline run --recipe smoke --train-on POOL` with the data stages
  already done (the same source and storage; a new seed each time, so a new training): from the
  creation of the `train` flow run (Prefect's record) to the timestamp of the first `train_loss`
  that reaches MLflow (logged at step 1). On the docker pool that includes the worker's poll,
  pulling the image (present: a manifest check), the container's start and Python's imports.

--no-cold keeps the images Docker has (no cold build). The figures are those of this machine at
its load average; compare the two pools' rows of one run, not absolute times across machines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, header, load, median, parse_args, save, table

BUCKET = "bench"
SECRET = "bench-secret-key"


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def timed(*cmd: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = sh(*cmd)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0, out.stdout.strip().splitlines()[-1]


def torch_wheel() -> str:
    import torch

    found = sorted(Path("/opt/wheels").glob(f"torch-{torch.__version__}-cp311-*.whl"))
    folders = (
        os.environ.get("PIP_FIND_LINKS", "").split()
        + sh(sys.executable, "-m", "pip", "config", "get", "global.find-links").stdout.split()
    )
    for folder in folders:
        found += sorted(Path(folder).glob(f"torch-{torch.__version__}-cp311-*.whl"))
    if not found:
        raise SystemExit("no local wheel of this torch in pip's find-links (the image would pull PyPI's CUDA build)")
    return str(found[0])


def builds(registry: str, cold: bool) -> dict:
    build = [str(REPO / "infra/docker/build-image.sh"), "--local-base", "--torch-wheel", torch_wheel()]
    figures = {}
    if cold:
        base = sh(str(REPO / "infra/docker/base-image.sh")).stdout.strip()
        if base:
            sh("docker", "rmi", "-f", base)
        figures["base_cold_s"], _ = timed(str(REPO / "infra/docker/base-image.sh"))
        figures["build_cold_s"], image = timed(*build, "--no-cache")
    figures["base_cached_s"], _ = timed(str(REPO / "infra/docker/base-image.sh"))
    figures["build_cached_s"], image = timed(*build)
    figures["push_empty_registry_s"], remote = timed(*build, "--push", registry)
    figures["push_again_s"], remote = timed(*build, "--push", registry)
    inspect = json.loads(sh("docker", "image", "inspect", image).stdout)[0]
    base_image = sh(str(REPO / "infra/docker/base-image.sh")).stdout.strip()
    base_size = json.loads(sh("docker", "image", "inspect", base_image).stdout)[0]["Size"]
    figures.update(image=remote, image_size_gb=inspect["Size"] / 1e9, base_size_gb=base_size / 1e9)
    return figures


def start(name: str, cmd: list[str], folder: Path, env: dict[str, str], health: str | None = None, ready=None):
    from flows.stack.servers import Service

    service = Service(name, cmd, str(folder / f"{name}.log"), health, env=env).start()
    service.wait_ready(180, ready=ready)
    return service


def first_step_latency(env: dict[str, str], pool: str, seed: int, cwd: Path) -> dict:
    """`mllm-pipeline run --train-on pool`; seconds from the train flow run's creation to its
    first train_loss in MLflow."""
    from mlflow.tracking import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    t0 = time.perf_counter()
    out = subprocess.run(
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
            f"s3://{BUCKET}/storage",
            "--train-on",
            pool,
            "--set",
            "train.device=cpu",
            "--set",
            f"train.seed={seed}",
            "--set",
            "train.log_interval=1",
            "--set",
            "train.max_steps=20",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"train on {pool} failed:\n{out.stderr[-3000:]}")
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        run = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])), sort=FlowRunSort.START_TIME_DESC, limit=1
        )[0]
    mlflow = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run_id = run.parameters["run_id"]  # the pipeline's MLflow run, which the train flow logs into
    first = min(m.timestamp for m in mlflow.get_metric_history(run_id, "train_loss"))
    return {
        "pool": pool,
        "seed": seed,
        "to_first_step_s": first / 1000 - run.created.timestamp(),
        "train_flow_run_s": (run.end_time - run.created).total_seconds(),
        "command_s": wall,
    }


def print_builds(figures: dict) -> None:
    print(
        table(
            [figures],
            [
                ("base_cold_s", "base, cold (s)"),
                ("build_cold_s", "build, cold (s)"),
                ("base_cached_s", "base, cached (s)"),
                ("build_cached_s", "build, cached (s)"),
                ("push_empty_registry_s", "push, empty registry (s)"),
                ("push_again_s", "push again (s)"),
                ("image_size_gb", "image (GB)"),
                ("base_size_gb", "of which base (GB)"),
            ],
        )
        + "\n",
        flush=True,
    )


def s3_bucket(tmp: Path, quiet: dict[str, str], services: list) -> dict[str, str]:
    """moto's S3 on loopback with the corpus in a bucket (the server added to `services`): the
    AWS variables that reach it."""
    import boto3

    from flows.stack.servers import free_port

    s3_port = free_port()
    s3 = f"http://127.0.0.1:{s3_port}"
    services.append(
        start(
            "moto",
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
            tmp,
            quiet,
            f"{s3}/moto-api/",
        )
    )
    aws = {
        "AWS_ENDPOINT_URL": s3,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": SECRET,
    }
    client = boto3.client(
        "s3", endpoint_url=s3, region_name="us-east-1", aws_access_key_id="bench", aws_secret_access_key=SECRET
    )
    client.create_bucket(Bucket=BUCKET)
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_text

    client.put_object(Bucket=BUCKET, Key="corpus.txt", Body=make_text(6000).encode())
    return aws


def stack_up(tmp: Path, quiet: dict[str, str], aws: dict[str, str]) -> dict[str, str]:
    """`mllm-pipeline stack up` with its servers on free ports: the variables it says to export."""
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "stack",
            "up",
            "--home",
            str(tmp / "stack"),
            "--storage",
            str(tmp / "mlflow-storage"),
            "--prefect-port",
            "0",
            "--mlflow-port",
            "0",
        ],
        capture_output=True,
        text=True,
        env={**quiet, **aws, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    if up.returncode:
        raise SystemExit(f"stack up failed:\n{up.stderr[-3000:]}")
    return dict(e.split("=", 1) for e in re.search(r"export (.*)", up.stdout).group(1).split())


def docker_pool(tmp: Path, quiet: dict[str, str], api: str, image: str, services: list) -> None:
    """A docker work pool on the image just pushed, and a worker on it (added to `services`)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.stack.servers import _worker_online

    creds = tmp / "aws-credentials"
    creds.write_text(f"[default]\naws_access_key_id = bench\naws_secret_access_key = {SECRET}\n")
    os.chown(creds, 1000, 1000) if os.geteuid() == 0 else creds.chmod(0o444)
    template = json.loads((REPO / "infra/pools/docker.json").read_text())
    defaults = {
        "image": image,
        "image_pull_policy": "Always",
        "network_mode": "host",
        "volumes": [f"{creds}:/home/mllm/.aws/credentials:ro"],
        "auto_remove": True,
        "env": {"OMP_NUM_THREADS": "1"},
    }
    for k, v in defaults.items():
        template["variables"]["properties"][k]["default"] = v
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        prefect.create_work_pool(
            WorkPoolCreate(name="bench-docker", type="docker", base_job_template=template), overwrite=True
        )
    worker_env = {k: v for k, v in quiet.items() if not k.startswith("AWS_")}
    worker_env.update(PREFECT_API_URL=api, PREFECT_HOME=str(tmp / "docker-worker"))
    services.append(
        start(
            "docker-worker",
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "bench-docker", "--type", "docker"],
            tmp,
            worker_env,
            ready=lambda: _worker_online(api, "bench-docker"),
        )
    )


def summarise(rows: list[dict]) -> list[dict]:
    """The median of each pool's runs, and the table of them."""
    summary = [
        {
            "pool": pool,
            "runs": len(rs),
            "to_first_step_s": median([r["to_first_step_s"] for r in rs]),
            "train_flow_run_s": median([r["train_flow_run_s"] for r in rs]),
            "command_s": median([r["command_s"] for r in rs]),
        }
        for pool in ("local", "bench-docker")
        for rs in [[r for r in rows if r["pool"] == pool]]
    ]
    print()
    print(
        table(
            summary,
            [
                ("pool", "pool"),
                ("runs", "runs"),
                ("to_first_step_s", "train flow run created to first step (s)"),
                ("train_flow_run_s", "train flow run, 20 steps (s)"),
                ("command_s", "whole command (s)"),
            ],
        )
    )
    return summary


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument(
            "--no-cold", action="store_true", help="keep Docker's images and cache: no cold build"
        ),
    )
    machine = header("containers", args.quick)
    import docker

    from flows import QUIET_ENV
    from flows.stack.servers import free_port

    docker.from_env().ping()
    registry_bin = shutil.which("docker-registry") or shutil.which("registry")
    if registry_bin is None:
        raise SystemExit("no docker-registry: run `make docker-setup` as root")
    repeats = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="mllm-bench-containers-") as tmp_name:
        tmp = Path(tmp_name)
        quiet = {**os.environ, **QUIET_ENV, "HOME": str(tmp / "home"), "PREFECT_HOME": str(tmp / "prefect")}
        services = []
        try:
            port = free_port()
            (tmp / "registry.yml").write_text(
                f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp / 'reg'}\n"
                f"http:\n  addr: 127.0.0.1:{port}\n"
            )
            services.append(
                start(
                    "registry",
                    [registry_bin, "serve", str(tmp / "registry.yml")],
                    tmp,
                    quiet,
                    f"http://127.0.0.1:{port}/v2/",
                )
            )
            figures = builds(f"127.0.0.1:{port}", cold=not args.no_cold)
            print_builds(figures)
            aws = s3_bucket(tmp, quiet, services)
            stack_env = stack_up(tmp, quiet, aws)
            api = stack_env["PREFECT_API_URL"]
            docker_pool(tmp, quiet, api, figures["image"], services)
            env = {**quiet, **aws, **stack_env, "OMP_NUM_THREADS": "1"}
            # The data stages once, on this machine; each measured run then trains only.
            first_step_latency(env, "local", 0, tmp)
            rows = []
            for i in range(repeats):
                for pool in ("local", "bench-docker"):
                    rows.append(first_step_latency(env, pool, 100 + 2 * i + (pool != "local"), tmp))
                    print(f"  {rows[-1]}", flush=True)
        finally:
            subprocess.run(
                [sys.executable, "-m", "flows.cli", "stack", "down", "--home", str(tmp / "stack")],
                capture_output=True,
                text=True,
                env=quiet,
            )
            for s in reversed(services):
                s.stop()
    summary = summarise(rows)
    print(f"\nload average at the end: {load()}")
    save("containers", {"machine": machine, "build": figures, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
