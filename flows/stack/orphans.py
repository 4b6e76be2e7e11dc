"""Flow runs of the stack's pool that its records say are running, but whose process is gone.

A flow run writes its own final state. When it cannot (its database was down, its worker was
killed with it, the machine rebooted), Prefect's records keep it Running for ever, and a
Running (or Pending, Cancelling) flow run holds one of its work pool's slots: with every slot so
held, nothing on the pool would start again. The stack's worker runs its flow runs as processes
on this machine, and Prefect records each one's process id (`infrastructure_pid`), so
`stack up` can tell: such a run whose process is gone, or whose id now belongs to another
process, is marked Crashed through Prefect's client, which frees its slot.
"""

from __future__ import annotations

from datetime import timedelta

CRASHED_BY_STACK = ("its process is gone (the stack's database or worker stopped under it); marked by "
                    "`mllm-pipeline stack up`: run the same command again to resume from its last checkpoint")


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
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    marked: list[str] = []
    in_flight = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=in_flight))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
        for run in runs:
            if _process_gone(run.infrastructure_pid, str(run.id), run.start_time):
                client.set_flow_run_state(run.id, Crashed(message=CRASHED_BY_STACK), force=True)
                marked.append(run.name)
    return marked
