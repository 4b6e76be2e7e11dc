"""`stack up`'s judgement of the pool's flow runs that its records call in flight: only a run
whose process is gone, or whose process id another process now holds, is marked Crashed."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.states import Pending, Running

from flows.stack.orphans import crash_orphans


@pytest.mark.integration
def test_a_queued_or_live_run_is_never_crashed_and_a_gone_or_reused_one_is(prefect_server: str) -> None:
    pool = f"orphans-{uuid.uuid4().hex[:8]}"
    alive: list[subprocess.Popen] = []
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = client.create_flow_from_name("orphans")
        deployment = client.create_deployment(flow_id, pool, work_pool_name=pool)
        runs = {
            name: client.create_flow_run_from_deployment(deployment, name=f"{pool}-{name}")
            for name in ("queued", "running", "gone", "reused", "unstarted")
        }
        # The queued run waited: its worker starts its process well after the run was created.
        time.sleep(5.5)

        def process_of(name: str | None) -> subprocess.Popen:
            env = {k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"}
            if name:
                env["PREFECT__FLOW_RUN_ID"] = str(runs[name].id)
            proc = subprocess.Popen(["sleep", "300"], env=env)
            alive.append(proc)
            return proc

        try:
            ended = subprocess.Popen(["true"])
            ended.wait()
            pids = {
                "queued": process_of("queued").pid,
                "running": process_of("running").pid,
                "gone": ended.pid,
                "reused": process_of(None).pid,
            }
            for name, run in runs.items():
                client.set_flow_run_state(
                    run.id, Pending() if name in ("queued", "unstarted") else Running(), force=True
                )
                if name in pids:
                    client.update_flow_run(run.id, infrastructure_pid=str(pids[name]))

            marked = crash_orphans(prefect_server, pool)

            assert sorted(marked) == [f"{pool}-gone", f"{pool}-reused"], marked
            states = {name: client.read_flow_run(run.id).state_type.value for name, run in runs.items()}
            assert states == {
                "queued": "PENDING",
                "running": "RUNNING",
                "gone": "CRASHED",
                "reused": "CRASHED",
                "unstarted": "PENDING",
            }, states
        finally:
            for proc in alive:
                proc.kill()
                proc.wait()


def test_a_flow_run_that_stops_reporting_tries_each_request_once_and_only_in_its_own_context() -> None:
    # A sweep that found the database down calls this before it raises: Prefect's engine then reports
    # its Failed state from the same thread and context, once, not for minutes of back-off.
    import contextvars

    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from flows.stack.orphans import stop_reporting

    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 7}):
        flow_thread = contextvars.copy_context()
        flow_thread.run(stop_reporting)
        assert flow_thread.run(PREFECT_CLIENT_MAX_RETRIES.value) == 0
        assert PREFECT_CLIENT_MAX_RETRIES.value() == 7  # the other threads (the points, the worker's) keep theirs
