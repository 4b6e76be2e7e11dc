"""infra/: the work pools' base job templates, the compose stack, the image and the scripts.

The templates are rendered with Prefect's own code (BaseJobConfiguration.from_template_and_values,
what a worker runs for each flow run), with the job variables the project sends: env, image, gpus.
When prefect-docker / prefect-kubernetes are installed their real job configuration classes are
used; otherwise a stand-in subclass of Prefect's base class that keeps the same fields.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"
VALUES = {"image": "mllm-pipeline:test", "gpus": 2, "env": {"MLFLOW_TRACKING_URI": "http://x"}}
# Every variable of the workers' default templates (prefect-docker 0.7.4, prefect-kubernetes
# 0.8.0), less the one each template fills itself.
DOCKER_STANDARD = {
    "command",
    "env",
    "labels",
    "name",
    "image",
    "registry_credentials",
    "image_pull_policy",
    "networks",
    "network_mode",
    "auto_remove",
    "volumes",
    "stream_output",
    "mem_limit",
    "memswap_limit",
    "privileged",
}
K8S_STANDARD = {
    "name",
    "env",
    "labels",
    "command",
    "annotations",
    "namespace",
    "image",
    "service_account_name",
    "image_pull_policy",
    "backoff_limit",
    "finished_job_ttl",
    "job_watch_timeout_seconds",
    "pod_watch_timeout_seconds",
    "stream_output",
    "cluster_config",
    "cpu_request",
    "cpu_limit",
    "memory_request",
    "memory_limit",
}


def _template(name: str) -> dict:
    return json.loads((INFRA / "pools" / f"{name}.json").read_text())


def _config_class(kind: str):
    from prefect.workers.base import BaseJobConfiguration
    from pydantic import Field

    try:
        if kind == "docker":
            from prefect_docker.worker import DockerWorkerJobConfiguration

            return DockerWorkerJobConfiguration
        from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

        return KubernetesWorkerJobConfiguration
    except ImportError:
        pass

    class StandIn(BaseJobConfiguration):
        image: Optional[str] = None
        container_create_kwargs: Optional[dict[str, Any]] = None
        job_manifest: dict[str, Any] = Field(default_factory=dict)
        namespace: str = "default"

    return StandIn


def render(kind: str, **overrides) -> Any:
    """The job configuration a worker would build for a flow run with these job variables."""
    values = {**VALUES, **overrides}
    cls = _config_class(kind)
    # The client only resolves block and variable references, which these templates have none of.
    return asyncio.run(cls.from_template_and_values(_template(kind), values, client=mock.AsyncMock()))


@pytest.mark.parametrize("kind, standard", [("docker", DOCKER_STANDARD), ("kubernetes", K8S_STANDARD)])
def test_templates_keep_the_workers_variables(kind, standard):
    template = _template(kind)
    props = template["variables"]["properties"]
    assert standard <= set(props), standard - set(props)
    if kind == "kubernetes":
        assert props["gpus"] == {**props["gpus"], "type": "integer", "default": 1, "minimum": 0}
    else:  # Docker's own device requests: none by default, so any Docker host runs it
        assert props["device_requests"] == {**props["device_requests"], "type": "array", "default": []}
    assert props["image"]["default"] == "mllm-pipeline:latest"
    # every placeholder of the job configuration names a variable of the schema
    placeholders = set(re.findall(r"{{\s*([\w.]+)\s*}}", json.dumps(template["job_configuration"])))
    assert placeholders <= set(props), placeholders - set(props)


GPU_REQUEST = [{"count": 2, "capabilities": [["gpu"]]}]


def test_docker_template_requests_the_gpus():
    config = render("docker", device_requests=GPU_REQUEST)
    assert config.image == "mllm-pipeline:test"
    assert config.env["MLFLOW_TRACKING_URI"] == "http://x"
    kwargs = config.container_create_kwargs
    assert kwargs["device_requests"] == GPU_REQUEST
    assert kwargs["shm_size"] == "8g"

    docker_types = pytest.importorskip("docker.types")
    host = docker_types.HostConfig(version="1.44", **kwargs)
    assert host["DeviceRequests"][0]["Count"] == 2
    assert host["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert host["ShmSize"] == 8 * 1024**3
    # No GPU: no device request at all, so Docker does not look for the NVIDIA runtime.
    none = render("docker").container_create_kwargs
    assert none["device_requests"] == []
    assert docker_types.HostConfig(version="1.44", **none)["DeviceRequests"] == []


@pytest.mark.parametrize(
    "device, nproc, expected",
    [("cpu", 2, []), ("auto", 1, [{"count": 1, "capabilities": [["gpu"]]}]), ("cuda", 2, GPU_REQUEST)],
)
def test_the_pipeline_asks_the_docker_pool_for_one_gpu_a_rank_and_none_on_cpu(device, nproc, expected):
    from flows.dispatch import gpu_variables
    from mllm.config import RunConfig

    cfg = RunConfig.model_validate({"train": {"device": device, "nproc_per_node": nproc, "max_steps": 1}})
    assert gpu_variables(cfg, set(_template("docker")["variables"]["properties"])) == {"device_requests": expected}
    kubernetes = gpu_variables(cfg, set(_template("kubernetes")["variables"]["properties"]))
    assert kubernetes == {"gpus": len(expected) and nproc}


def test_kubernetes_template_requests_the_gpus():
    config = render("kubernetes")
    pod = config.job_manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "prefect-job"  # the name the kubernetes worker looks for
    assert container["image"] == "mllm-pipeline:test"
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "2"
    env = container["env"]
    env = env if isinstance(env, dict) else {e["name"]: e.get("value") for e in env}
    assert env["MLFLOW_TRACKING_URI"] == "http://x"
    assert pod["restartPolicy"] == "Never"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]

    none = render("kubernetes", gpus=0).job_manifest["spec"]["template"]["spec"]["containers"][0]
    assert str(none["resources"]["limits"]["nvidia.com/gpu"]) == "0"


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["docker", "kubernetes"])
def test_server_accepts_the_template(prefect_server, kind):
    """The Prefect server validates a pool's base job template when the pool is created; it
    does so without the worker package installed."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    name = f"test-infra-{kind}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=_template(kind)), overwrite=True)
        pool = client.read_work_pool(name)
    assert pool.type == kind
    gpus = "gpus" if kind == "kubernetes" else "device_requests"
    assert pool.base_job_template["variables"]["properties"][gpus]["default"] == (1 if kind == "kubernetes" else [])
    assert pool.base_job_template["job_configuration"] == _template(kind)["job_configuration"]


def test_compose_worker_owns_a_gpu_and_talks_to_the_stack():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "minio-init", "prefect", "mlflow", "worker"} <= set(services)
    assert services["prefect"]["image"] == "prefecthq/prefect:3.8.8-python3.11"

    worker = services["worker"]
    assert worker["build"]["dockerfile"].endswith("infra/Dockerfile")
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    env = worker["environment"]
    assert re.fullmatch(r"http://prefect:4200/api", env["PREFECT_API_URL"])
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert env["MLLM_STORAGE"].startswith("s3://")
    command = worker["command"]
    command = command if isinstance(command, str) else " ".join(command)
    assert "prefect worker start" in command and "--type process" in command

    # secrets only as ${VAR:?...}, never a bare literal in an AWS or password variable
    for svc in services.values():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"SECRET|PASSWORD", key) and value is not None:
                assert str(value).startswith("${"), (key, value)


def test_compose_has_no_default_password_and_publishes_on_loopback_only():
    """No password works by default: each is `${VAR:?message}` (compose refuses to start without
    it), infra/make-env.sh makes exactly those, random; and with no proxy in front (neither server
    checks who calls) every published port is on 127.0.0.1."""
    text = (INFRA / "compose.yaml").read_text()
    used = re.findall(r"\$\{(\w+)(:?[-?])?([^}]*)\}", text)
    secret = {name for name, _, _ in used if re.search(r"PASSWORD|SECRET|_USER$|TOKEN|KEY", name)}
    assert secret == {"POSTGRES_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
    for name, how, message in used:
        if name in secret:
            assert how == ":?" and "infra/make-env.sh > infra/.env" in message, (name, how, message)
    assert "local-only" not in text and "password1234" not in text
    for name, svc in yaml.safe_load(text)["services"].items():
        for port in svc.get("ports") or []:
            assert str(port).startswith("127.0.0.1:"), (name, port)
        assert svc.get("network_mode") != "host", name

    made = [
        subprocess.run(["bash", str(INFRA / "make-env.sh")], check=True, capture_output=True, text=True).stdout
        for _ in range(2)
    ]
    envs = [dict(line.split("=", 1) for line in out.splitlines()) for out in made]
    assert set(envs[0]) == secret
    for key in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"):
        assert re.fullmatch(r"[A-Za-z0-9]{40}", envs[0][key]) and envs[0][key] != envs[1][key]  # URL-safe, random
    assert "infra/.env" in (INFRA.parent / ".gitignore").read_text().split()


def test_dockerfile_installs_with_the_constraints():
    text = (INFRA / "Dockerfile").read_text()
    # The dependencies of mllm and the pipeline extra at constraints.txt's versions, then the
    # project itself with no index: nothing unpinned comes in with it.
    assert re.search(r"pip install -c /tmp/project/constraints\.txt -r /tmp/requirements\.txt", text)
    assert "['optional-dependencies']['pipeline']" in text
    assert "pip install --no-deps --no-build-isolation --no-index ." in text
    assert re.search(r"^USER (?!root)", text, re.M)
    # The commit it was built from, since .git stays out: a label, and what runs record.
    assert re.search(r"^ARG GIT_COMMIT", text, re.M) and 'ENV MLLM_GIT_COMMIT="${GIT_COMMIT}"' in text
    assert 'org.opencontainers.image.revision="${GIT_COMMIT}"' in text
    ignored = (INFRA.parent / ".dockerignore").read_text().split()
    assert {".venv", ".git", "storage", "mlruns", "benchmarks/out"} <= set(ignored)


@pytest.mark.parametrize(
    "script",
    sorted([*(INFRA / "paperspace").glob("*.sh"), *(INFRA / "docker").glob("*.sh"), *INFRA.glob("*.sh")]),
    ids=lambda p: p.name,
)
def test_shell_scripts_parse(script):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text
    assert "usage" in text.lower()
