"""Flow runs that the stack's records say are running but whose process is gone, marked Crashed at
`stack up` so that they free their pool's slots (docs/stack.md)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

from flows.settings import settings
from flows.stack import state

CRASHED_BY_STACK = (
    "its process is gone (the stack's database or worker stopped under it); marked by "
    "`mllm-pipeline stack up`: run the same command again to resume from its last checkpoint"
)


def _process_gone(pid_text: str | None, run_id: str, started: object) -> bool:
    """Whether the process `pid_text` of flow run `run_id` no longer runs. A run with no process
    id yet (a worker is still starting it) is not judged, nor is a live process that may be its own.

    A live id may have been taken again by another process. The worker gives the run's process
    PREFECT__FLOW_RUN_ID, so its environment says whose it is; where it cannot be read, a process
    started after the run entered Running (`started`) is another's. The run's creation time is no
    such bound: a run that waited in the queue gets its process long after it was created."""
    import psutil

    if not pid_text or not pid_text.strip().isdigit():
        return False
    try:
        process = psutil.Process(int(pid_text))
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        created = process.create_time()
        try:
            return process.environ().get("PREFECT__FLOW_RUN_ID") != run_id
        except psutil.AccessDenied:
            pass
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    return started is not None and created > (started + timedelta(seconds=5)).timestamp()


def crash_orphans(api: str, pool: str) -> list[str]:
    """Mark Crashed the flow runs of `pool` on the Prefect server `api` that are Pending, Running or
    Cancelling but whose process on this machine is gone; their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    marked: list[str] = []
    in_flight = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=in_flight))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
        for run in runs:
            if _process_gone(run.infrastructure_pid, str(run.id), run.start_time):
                client.set_flow_run_state(run.id, Crashed(message=CRASHED_BY_STACK), force=True)
                marked.append(run.name)
    return marked


IN_FLIGHT = "flow-runs-in-flight.json"
CRASHED_BY_OUTAGE = (
    "its command ended as the stack's database was down; marked by `mllm-pipeline stack up`: run "
    "the same command again (finished stages and trainings are reused)"
)
CANCELLED_BY_OUTAGE = (
    "the command that handed this training to the pool ended as the stack's database was down; "
    "cancelled by `mllm-pipeline stack up` before a worker took it"
)
_here: set[str] = set()
_lock = threading.Lock()


def running_here(run_id: object) -> None:
    """Note a flow run that this process runs (the points of a sweep run in threads)."""
    if run_id:  # (none: the flow's function called as a function)
        with _lock:
            _here.add(str(run_id))


def stop_reporting() -> None:
    """A flow run that ends because the stack's database is down: the states Prefect's engine then
    reports for it cannot be written, and its client would retry each report with back-off
    (PREFECT_CLIENT_MAX_RETRIES, doubling from 2 s: about 4 minutes with this project's 7) before
    the command could print why it ended. From here on, in this thread, each request is tried once;
    the run is left in flight, for `stack up` to mark Crashed once the database is back
    (`crash_left_in_flight`). Called in the flow's own thread just before it raises: Prefect's
    engine reports from that thread and context, and reads the setting at each request."""
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

    now = get_settings_context()
    # Entered and never left: the flow's engine resets its own contexts as it ends.
    SettingsContext(
        profile=now.profile, settings=now.settings.copy_with_update(updates={PREFECT_CLIENT_MAX_RETRIES: 0})
    ).__enter__()


def leave_in_flight(home: Path) -> None:
    """At the end of a command whose stack's database is down: the flow runs it ran, left in `home`
    for `stack up` (only when $PREFECT_API_URL is that stack's)."""
    api = settings().prefect_api_url.rstrip("/")
    if not _here or not api or state.load(home)["env"].get("PREFECT_API_URL", "").rstrip("/") != api:
        return
    path = home / IN_FLIGHT
    try:
        kept = set(json.loads(path.read_text()))
    except (OSError, ValueError):
        kept = set()
    with _lock:
        path.write_text(json.dumps(sorted(kept | _here)) + "\n")


def crash_left_in_flight(api: str, home: Path) -> tuple[list[str], list[str]]:
    """The flow runs that commands left in `home` when the database was down, marked Crashed where
    still in flight, and the trainings they had handed to a pool that still wait in its queue,
    cancelled (no one follows them: run, they would take a slot from the commands run again);
    the names of each. A training a worker already runs is left to finish: the command run again
    finds it in storage. The note is gone once read."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelled, Crashed

    path = home / IN_FLIGHT
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], []
    marked: list[str] = []
    cancelled: list[str] = []
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        for run_id in ids:
            try:
                run = client.read_flow_run(run_id)
            except Exception:  # noqa: BLE001 (deleted since: nothing to mark)
                continue
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(run.id, Crashed(message=CRASHED_BY_OUTAGE), force=True)
                marked.append(run.name)
        if ids:
            queued = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=ids),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                )
            )
            for run in queued:
                if run.work_pool_name:
                    client.set_flow_run_state(run.id, Cancelled(message=CANCELLED_BY_OUTAGE), force=True)
                    cancelled.append(run.name)
    path.unlink(missing_ok=True)
    return marked, cancelled
