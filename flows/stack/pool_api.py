"""The stack's own calls to its Prefect server (as itself on a secured stack): whether a worker
of its pool is online, the pool's slots, and the flow runs in flight that `stack down` waits for."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from flows.stack import auth as stack_auth


def _worker_online(api: str, pool: str, pid: int | None = None) -> bool:
    """Whether a worker of `pool` has sent the server a heartbeat (since `pid` started)."""
    try:
        workers = _post(f"{api}/work_pools/{pool}/workers/filter", {}, timeout=5)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    started = _started_at(pid)
    return any(
        w.get("status") == "ONLINE" and (started is None or _timestamp(w["last_heartbeat_time"]) > started)
        for w in workers
    )


def default_slots() -> int:
    """Trainings a pool runs at once unless told: one per GPU, else one per two cores."""
    import torch

    return torch.cuda.device_count() or max(1, (os.cpu_count() or 1) // 2)


def set_slots(api: str, pool: str, slots: int | None) -> None:
    """Set the work pool's concurrency limit: flow runs beyond it wait, Scheduled, for a slot."""
    if slots is None:
        return
    req = urllib.request.Request(
        f"{api}/work_pools/{pool}",
        data=json.dumps({"concurrency_limit": slots}).encode(),
        method="PATCH",
        headers={"Content-Type": "application/json"},
    )
    # A server on SQLite answers 503 while another write holds the database (the new worker's):
    # such an answer is tried again for a while, anything else is raised.
    deadline = time.monotonic() + 60
    while True:
        try:
            with _open(req, timeout=30):
                return
        except urllib.error.HTTPError as e:
            if e.code < 500 or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Prefect server did not take the pool's limit of {slots} slots: HTTP {e.code} {e.reason}"
                ) from None
        except (urllib.error.URLError, OSError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not take the pool's limit of {slots} slots: {e}") from None
        time.sleep(1.0)


def slots_of(api: str, pool: str) -> int | None:
    try:
        with _open(f"{api}/work_pools/{pool}", timeout=5) as r:
            return json.loads(r.read()).get("concurrency_limit")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _started_at(pid: int | None) -> float | None:
    try:
        return os.stat(f"/proc/{pid}").st_mtime if pid else None
    except OSError:
        return None


def _timestamp(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def in_flight(state: dict) -> list[str]:
    """The stack's flow runs that are Pending, Running or Cancelling, as `flow/run (STATE)`; none
    when its Prefect server does not answer (nothing can then report to it)."""
    api = state.get("env", {}).get("PREFECT_API_URL")
    if not api:
        return []
    body = {"flow_runs": {"state": {"type": {"any_": ["PENDING", "RUNNING", "CANCELLING"]}}}, "limit": 50}
    try:
        runs = _post(f"{api}/flow_runs/filter", body)
        flows = {
            f["id"]: f["name"]
            for f in _post(f"{api}/flows/filter", {"flows": {"id": {"any_": list({r["flow_id"] for r in runs})}}})
        }
    except (urllib.error.URLError, OSError, ValueError):
        return []
    return [f"{flows.get(r['flow_id'], '?')}/{r['name']} ({r['state_type']})" for r in runs]


def _post(url: str, body: dict, timeout: float = 10) -> list:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with _open(req, timeout=timeout) as r:
        return json.loads(r.read())


def _open(req, timeout: float):
    """The stack's own request to its server: as itself on a secured stack (flows/stack/auth.py)."""
    return stack_auth.open_url(req, timeout)
