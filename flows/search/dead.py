"""A dead search's flow runs: the search that takes over its trial marks them Crashed, as `stack up`
marks the pool's (flows/stack/orphans.py); left Running, they would keep `stack down` refusing."""

from __future__ import annotations

import os
import socket
from typing import Any

PROCESS_ATTR = "search.process"
CRASHED_BY_SEARCH = (
    "its search's process died (SIGKILL, a crash, the machine); marked by the search that took over "
    "trial {number}, which resumes it from its checkpoint"
)


def this_process() -> dict[str, Any]:
    """This search's flow run and process, kept in each trial it starts."""
    import psutil
    from prefect.runtime import flow_run

    return {
        "flow_run": str(flow_run.get_id() or ""),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": psutil.Process().create_time(),
    }


def _gone(process: dict[str, Any]) -> bool:
    """Whether the search process noted is known to have ended: on this machine, and its id no
    longer runs, or runs a process started later."""
    import psutil

    if process.get("host") != socket.gethostname() or not process.get("pid"):
        return False
    try:
        return abs(psutil.Process(int(process["pid"])).create_time() - float(process.get("started", 0))) > 1
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def crash_flow_runs(trial: Any, known_dead: bool) -> list[str]:
    """The in-flight flow runs of the dead search that ran `trial` (an Optuna FrozenTrial): its own
    and those under it that ran in its process (a training a worker runs is left to the worker),
    marked Crashed; their names. None when its process is not known to be gone, or is this one."""
    from prefect.runtime import flow_run

    process = trial.user_attrs.get(PROCESS_ATTR) or {}
    if (
        not process.get("flow_run")
        or process["flow_run"] == str(flow_run.get_id())
        or not (known_dead or _gone(process))
    ):
        return []
    marked: list[str] = []
    try:
        _crash_under(process["flow_run"], trial.number, marked)
    except Exception:  # noqa: BLE001 (a server that does not answer: `stack down --force` is left)
        pass
    return marked


def _crash_under(run_id: str, number: int, marked: list[str]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        try:
            runs = [client.read_flow_run(run_id)]
        except Exception:  # noqa: BLE001 (another server's run, or deleted: nothing here to mark)
            return
        seen = {str(runs[0].id)}
        while runs:
            run = runs.pop()
            if run.state is None or run.state.is_final() or run.work_pool_name:
                continue  # (under a run that ended, every run of its process ended too)
            client.set_flow_run_state(run.id, Crashed(message=CRASHED_BY_SEARCH.format(number=number)), force=True)
            marked.append(run.name)
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
            )
            runs += [c for c in children if str(c.id) not in seen]
            seen |= {str(c.id) for c in children}
