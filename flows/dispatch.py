"""Training on a Prefect work pool (`--train-on POOL`): hand the `train` flow to a worker through a
deployment, follow the remote run, and submit it again when its worker is lost (docs/deployment.md)."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any
from urllib.parse import urlsplit

from prefect import get_client, get_run_logger
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import LogSort
from prefect.deployments import run_deployment
from prefect.exceptions import MissingContextError, ObjectNotFound
from prefect.logging import get_logger
from prefect.states import Cancelling, Crashed
from prefect.utilities.callables import parameter_schema

import tasks
from flows.settings import settings
from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.settings import environment
from tasks.model import Prepared, Trained
from tasks.model.train import parse_progress, train_job, training_code
from tasks.tracking import store as tracking

ENTRYPOINT = "flows.training:train"


class RemoteTrainingFailed(UserError):
    """The training flow run on the pool failed: its error, and where to read its log."""


def deployment_name(pool: str) -> str:
    return f"train-{pool}"


def ensure_deployment(train: Any, pool: str) -> tuple[str, set[str]]:
    """Create or update the deployment of the `train` flow for `pool`: its full name
    `train/train-<pool>`, and the job variables the pool's job template takes."""
    with get_client(sync_client=True) as client:
        try:
            wp = client.read_work_pool(pool)
        except ObjectNotFound:
            raise UserError(
                f"work pool {pool!r} not found on {_api_url()}: start one with "
                f"`mllm-pipeline stack up` (pool 'local') or create it with "
                f"`prefect work-pool create {pool} --type process`"
            ) from None
        refuse_waiting_on_itself(client, wp)
        flow_id = client.create_flow_from_name(train.name)
        client.create_deployment(
            flow_id=flow_id,
            name=deployment_name(pool),
            work_pool_name=wp.name,
            entrypoint=ENTRYPOINT,
            parameter_openapi_schema=parameter_schema(train).model_dump_for_openapi(),
            description="The pipeline's training stage, run by a worker of this pool. Started by "
            "`mllm-pipeline run --train-on POOL`; its parameters come from the pipeline.",
            tags=["mllm-pipeline", "train"],
        )
    variables = set(wp.base_job_template.get("variables", {}).get("properties", {}))
    return f"{train.name}/{deployment_name(pool)}", variables


def one_slot(pool: str) -> str:
    return (
        f"pool {pool!r} has one slot, which the pipeline's own flow run takes: its training, handed to the same "
        f"pool, would wait for that slot for ever. Give the pool two or more (`mllm-pipeline stack up --slots 2`, "
        f"or `prefect work-pool set-concurrency-limit {pool} 2`), or train on another pool (--train-on)"
    )


def refuse_waiting_on_itself(client: Any, wp: Any) -> None:
    """A flow run on a pool of one slot (a worker runs it: PREFECT__FLOW_RUN_ID) that hands its
    training to that same pool holds the slot the training waits for: refused, not waited on."""
    own = settings().flow_run_id
    if not own or wp.concurrency_limit is None or wp.concurrency_limit > 1:
        return
    try:
        holder = client.read_flow_run(own).work_pool_name
    except (ObjectNotFound, ValueError):  # not a flow run of this server
        return
    if holder == wp.name:
        raise UserError(one_slot(wp.name))


def job_env(root: str) -> dict[str, str]:
    """Settings the training job needs to find storage and MLflow: no credentials."""
    env = {"MLLM_STORAGE": root, "MLFLOW_TRACKING_URI": tracking.tracking_uri(root)}
    here = environment()
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL"):
        if here.get(name):
            env[name] = here[name]
    # Never hand on a URL with user:password in it (the job variables are visible in the UI).
    return {k: v for k, v in env.items() if not (urlsplit(v).password or urlsplit(v).username)}


def gpu_variables(cfg: RunConfig, variables: set[str]) -> dict[str, Any]:
    """The GPUs to ask the pool for: one a rank, none for a CPU training (`train.device=cpu`).
    The kubernetes template takes a count (`gpus`); the docker one takes Docker's own device
    requests, so that no GPU means no request at all: a request, even for 0 GPUs, needs the
    NVIDIA runtime on the Docker host."""
    gpus = 0 if cfg.train.device == "cpu" else cfg.train.nproc_per_node
    if "gpus" in variables:
        return {"gpus": gpus}
    if "device_requests" in variables:
        return {"device_requests": [{"count": gpus, "capabilities": [["gpu"]]}] if gpus else []}
    return {}


def _was_cancelled(flow_run: FlowRun) -> bool:
    """Whether a Crashed run was cancelled (from the UI or the API) and is not to be submitted
    again: a cancel that lands before the training holds SIGTERM (the flow still loading) is
    killed by Prefect's runner the crash way; a Cancelling state follows its last Running one."""
    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(flow_run.id), key=lambda s: s.timestamp)
    kinds = [s.type for s in states]
    running = max((i for i, k in enumerate(kinds) if k == StateType.RUNNING), default=-1)
    return StateType.CANCELLING in kinds[running + 1 :]


# Docker's answer to a GPU request on a host without the NVIDIA Container Toolkit.
_NO_GPU_RUNTIME = "could not select device driver"


def train_on_pool(
    train: Any, cfg: RunConfig, data: Prepared, root: str, run_id: str | None, pool: str, search: bool = False
) -> Trained:
    """Run the `train` flow on a worker of `pool`, follow it, and return what it trained."""
    logger = _logger()
    name, variables = ensure_deployment(train, pool)
    _, run_dir = train_job(cfg, data, root)
    job_variables: dict[str, Any] = {"env": job_env(root), **gpu_variables(cfg, variables)}
    params = {
        "cfg": cfg.model_dump(mode="json"),
        "data": data.model_dump(mode="json"),
        "root": root,
        "run_id": run_id,
        "code": training_code(),
        **({"search": True} if search else {}),
    }
    restarts, lost_after = settings().train_restarts, settings().lost_after_s
    for attempt in range(restarts + 1):
        flow_run = run_deployment(
            name, parameters=params, timeout=0, job_variables=job_variables, tags=["mllm-pipeline"]
        )
        logger.info(
            "training handed to pool %r as flow run %r (%s)", pool, flow_run.name, flow_run.id, extra=tasks.NOTICE
        )
        try:
            final = _follow(flow_run, pool, lost_after)
        except KeyboardInterrupt:  # Ctrl-C stops the training it started, on the worker too
            with contextlib.suppress(Exception), get_client(sync_client=True) as client:
                client.set_flow_run_state(
                    flow_run.id, Cancelling(message="interrupted from the terminal (Ctrl-C)"), force=True
                )
            raise
        if final.state_type == StateType.COMPLETED:
            return Trained.model_validate(storage.read_json(storage.join(run_dir, "trained.json")))
        message = (final.state.message if final.state else "") or final.state_name
        if _NO_GPU_RUNTIME in message:
            raise RemoteTrainingFailed(
                f"the Docker host of pool {pool!r} has no GPU runtime (the NVIDIA Container Toolkit) for the "
                f"GPUs this training asks for (Docker: {_docker_error(message)}): install the toolkit there, "
                "or train on CPU with --set train.device=cpu"
            )
        if final.state_type == StateType.CANCELLED or (final.state_type == StateType.CRASHED and _was_cancelled(final)):
            raise RemoteTrainingFailed(
                f"training flow run {flow_run.name!r} on pool {pool!r} was cancelled (its log: "
                f"{_run_url(flow_run)}); run the command again to resume from its last checkpoint"
            )
        if final.state_type != StateType.CRASHED:
            raise RemoteTrainingFailed(
                f"training flow run {flow_run.name!r} on pool {pool!r} ended "
                f"{final.state_name}: {_one_line(message)} (its log: {_run_url(flow_run)})"
            )
        logger.warning(
            "training flow run %r crashed (%s); %s",
            flow_run.name,
            _one_line(message),
            "submitting it again: it resumes from its last checkpoint" if attempt < restarts else "no restarts left",
        )
    raise RemoteTrainingFailed(
        f"training on pool {pool!r} crashed {restarts + 1} times; the last: "
        f"{_one_line(message)}. Check the pool's workers, then run again (training "
        "resumes from its last checkpoint)"
    )


def _follow(flow_run: FlowRun, pool: str, lost_after: float) -> FlowRun:
    """Wait for the run to end, passing its log lines on. A run that stays silent while
    Running for `lost_after` seconds is marked Crashed."""
    logger = _logger()
    seen_at, last_ts, waiting_said, state = time.monotonic(), None, False, None
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run.id)
            logs = client.read_logs(
                LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]),
                    timestamp=LogFilterTimestamp(after_=last_ts) if last_ts else None,
                ),
                sort=LogSort.TIMESTAMP_ASC,
                limit=200,
            )
            logs = [entry for entry in logs if last_ts is None or entry.timestamp > last_ts]
            for entry in logs:
                _relay(entry.message, logger)
            if logs:
                last_ts = logs[-1].timestamp
            if logs or run.state_type != state:
                seen_at, state = time.monotonic(), run.state_type
            if run.state and run.state.is_final():
                return run
            if run.state_type in (StateType.SCHEDULED, StateType.PENDING) and not waiting_said:
                logger.info("waiting for a worker of pool %r to pick up %r", pool, run.name, extra=tasks.NOTICE)
                waiting_said = True
            if run.state_type == StateType.RUNNING and time.monotonic() - seen_at > lost_after:
                message = (
                    f"no log from the training run for {lost_after:.0f} s: its worker or machine "
                    "is gone (set MLLM_LOST_AFTER_S to wait longer)"
                )
                client.set_flow_run_state(flow_run.id, Crashed(message=message), force=True)
                return client.read_flow_run(flow_run.id)
            time.sleep(1.0)


def _logger() -> Any:
    try:
        return get_run_logger()
    except MissingContextError:  # `mllm-pipeline train --train-on`: no flow around it
        return get_logger("mllm.dispatch")


def _relay(message: str, logger: Any) -> None:
    """A remote log line: as progress when it is one and a progress bar listens, else logged."""
    # A worker's traceback (a container that could not start, the flow's exception) stays in
    # the run's record; the error itself ends the pipeline in one line.
    message = message.split("\nTraceback (most recent call last)")[0]
    progress = parse_progress(message)
    if progress and tasks.progress_hook is not None:
        tasks.report_progress("train", progress["step"], progress["total_steps"], train_loss=progress["train_loss"])
    else:
        logger.info("[worker] %s", message, extra=tasks.NOTICE)


def _docker_error(message: str) -> str:
    """Docker's words, without the brackets of `[[gpu]]` (the terminal would take them for markup)."""
    found = re.search(_NO_GPU_RUNTIME + r"[^\]]*\]*", message.replace('\\"', '"'))
    return re.sub(r"[\[\]]", "", found.group(0)) if found else _NO_GPU_RUNTIME


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:500]


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "the temporary Prefect server (set PREFECT_API_URL)"


def _run_url(flow_run: FlowRun) -> str:
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui}/runs/flow-run/{flow_run.id}" if ui else f"flow run {flow_run.id}"
