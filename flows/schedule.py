"""Scheduled retraining: a deployment of the pipeline flow per recipe on the Prefect server
(docs/scheduling.md)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from prefect import get_client
from prefect.client.schemas.actions import DeploymentScheduleCreate
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.utilities.callables import parameter_schema

from flows.dispatch import job_env, one_slot
from flows.launch import check_model_name, storage_root, training_pool
from flows.pipeline import pipeline
from mllm import UserError
from mllm.resolve import NO_OVERRIDES, Overrides, resolve

FLOW = "pipeline"
ENTRYPOINT = "flows.pipeline:pipeline"


def _require_server() -> None:
    if not PREFECT_API_URL.value():
        raise UserError(
            "schedules live on a Prefect server: set PREFECT_API_URL (`mllm-pipeline stack up` "
            "starts one and prints it)"
        )


def _schedule(cron: str | None, interval: float | None, timezone: str) -> Any:
    if (cron is None) == (interval is None):
        raise UserError('give one of --cron "MIN HOUR DAY MONTH WEEKDAY" (e.g. "0 3 * * 0") or --interval SECONDS')
    try:
        CronSchedule(cron="0 0 * * *", timezone=timezone)  # Prefect checks the name for a cron only
    except ValueError:
        raise UserError(
            f"unknown --timezone {timezone!r}: give an IANA name such as UTC, Europe/Paris or America/New_York"
        ) from None
    try:
        if cron is not None:
            return CronSchedule(cron=cron, timezone=timezone)
        if interval <= 0:
            raise ValueError("must be above 0")
        return IntervalSchedule(
            interval=dt.timedelta(seconds=interval),
            anchor_date=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
            timezone=timezone,
        )
    except ValueError as e:  # pydantic's ValidationError included
        what = f"--cron {cron!r}" if cron is not None else f"--interval {interval}"
        errors = getattr(e, "errors", None)
        detail = errors()[0]["msg"] if errors else str(e)
        raise UserError(
            f'invalid {what} ({detail}): write a cron line like "0 3 * * 0" (Sundays at 03:00) or a number of seconds'
        ) from None


def upsert(
    recipe: str,
    *,
    cron: str | None = None,
    interval: float | None = None,
    timezone: str = "UTC",
    pool: str = "local",
    train_on: str | None = None,
    source: str | list[str] | None = None,
    storage_url: str | None = None,
    overrides: Overrides | Iterable[str] = NO_OVERRIDES,
    paused: bool = False,
    model: str | None = None,
) -> dict[str, Any]:
    """Create or update the deployment `pipeline/<recipe>` with its schedule."""
    overrides = Overrides.parse(overrides, "override")  # the CLI's parsed ones, or a script's texts
    resolve(recipe, overrides=overrides, source=source)  # a bad recipe or --set fails here
    if model:
        check_model_name(model)
    schedule = _schedule(cron, interval, timezone)
    _require_server()
    root = storage_root(storage_url)
    params: dict[str, Any] = {"recipe": recipe, "storage_url": root, "overrides": overrides.items()}
    if source:
        params["source"] = source
    if train_on:
        params["train_on"] = train_on
    if model:
        params["model"] = model
    with get_client(sync_client=True) as client:
        for name in {pool, train_on} - {None}:
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                raise UserError(
                    f"work pool {name!r} not found on {PREFECT_API_URL.value()}: start its worker "
                    f"(`prefect worker start --pool {name} --type process` creates it)"
                ) from None
        if training_pool(recipe, train_on) == pool and (client.read_work_pool(pool).concurrency_limit or 2) < 2:
            raise UserError(one_slot(pool))
        flow_id = client.create_flow_from_name(FLOW)
        deployment_id = client.create_deployment(
            flow_id=flow_id,
            name=recipe,
            work_pool_name=pool,
            entrypoint=ENTRYPOINT,
            parameters=params,
            parameter_openapi_schema=parameter_schema(pipeline).model_dump_for_openapi(),
            enforce_parameter_schema=True,
            job_variables={"env": job_env(root)},
            schedules=[DeploymentScheduleCreate(schedule=schedule, active=True)],
            concurrency_limit=1,
            paused=paused,
            tags=["mllm-pipeline", "retrain"],
            description=f"Retrain the {recipe} recipe: the source is read again; training is skipped when the "
            "champion was trained on the same data, config and code (force: true evaluates, registers and "
            "judges it again, reusing that training).",
        )
        return _describe(client, client.read_deployment(deployment_id))


def _deployment(client: Any, recipe: str) -> Any:
    try:
        return client.read_deployment_by_name(f"{FLOW}/{recipe}")
    except ObjectNotFound:
        raise UserError(
            f"no schedule for recipe {recipe!r}: create it with `mllm-pipeline schedule --recipe "
            f'{recipe} --cron "0 3 * * 0"` (see `mllm-pipeline schedule list`)'
        ) from None


def pause(recipe: str) -> None:
    _require_server()
    with get_client(sync_client=True) as client:
        client.pause_deployment(_deployment(client, recipe).id)


def resume(recipe: str) -> None:
    _require_server()
    with get_client(sync_client=True) as client:
        client.resume_deployment(_deployment(client, recipe).id)


def delete(recipe: str) -> None:
    _require_server()
    with get_client(sync_client=True) as client:
        client.delete_deployment(_deployment(client, recipe).id)


def list_schedules() -> list[dict[str, Any]]:
    _require_server()
    with get_client(sync_client=True) as client:
        deployments = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW])))
        return [_describe(client, d) for d in sorted(deployments, key=lambda d: d.name)]


def _describe(client: Any, d: Any) -> dict[str, Any]:
    schedules = []
    for s in d.schedules:
        sch = s.schedule
        schedules.append(
            f"cron {sch.cron!r} {sch.timezone or 'UTC'}"
            if isinstance(sch, CronSchedule)
            else f"every {sch.interval.total_seconds():g} s"
            if isinstance(sch, IntervalSchedule)
            else str(sch)
        )
    ours = DeploymentFilter(id=DeploymentFilterId(any_=[d.id]))
    final = FlowRunFilter(
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(
                any_=[StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]
            )
        )
    )
    scheduled = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])))
    done = client.read_flow_runs(
        deployment_filter=ours, flow_run_filter=final, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1
    )
    upcoming = [
        r.expected_start_time
        for r in client.read_flow_runs(
            deployment_filter=ours, flow_run_filter=scheduled, sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1
        )
    ]
    return {
        "name": f"{FLOW}/{d.name}",
        "id": str(d.id),
        "recipe": d.parameters.get("recipe", d.name),
        "schedule": ", ".join(schedules) or "none",
        "paused": bool(d.paused),
        "pool": d.work_pool_name,
        "parameters": d.parameters,
        "next_run": upcoming[0].isoformat() if upcoming and not d.paused else None,
        "last_run": (f"{done[0].name} {done[0].state_name}" if done else None),
    }
