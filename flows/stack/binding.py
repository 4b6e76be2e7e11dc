"""Which pools a worker user bound to pools (`stack user add NAME --role worker --pool POOL`) may
serve and start runs on: the gate asks `pool_problem` before passing on such a user's write."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Awaitable, Callable

_POOL_PATH = re.compile(r"^/api/work_pools/([^/]+)/")
# Polls that name no pool: a bound worker polls its pools' own routes instead.
_UNBOUND_POLLS = ("/api/deployments/get_scheduled_flow_runs", "/api/work_queues/{id}/get_runs")
# The routes whose body names the pool (a deployment's, or the deployment of a new flow run).
NEEDS_BODY = ("/api/deployments/", "/api/flow_runs/")
# Writes on an object whose pool is the one it was made for: (route, what to look up).
_LOOKUPS = {
    "/api/deployments/{id}/create_flow_run": "deployments",
    "/api/flow_runs/{id}/set_state": "flow_runs",
    "/api/flow_runs/{id}": "flow_runs",
}


def _refused(pool: str | None, pools: list[str]) -> str | None:
    if pool is None or pool in pools:
        return None  # a run of no pool runs in its caller's own process (a pipeline's parent flow)
    return f"this worker user serves and starts runs of pool(s) {', '.join(pools)} only, not {pool!r}"


async def pool_problem(
    pools: list[str],
    route: str | None,
    path: str,
    body: bytes | None,
    lookup: Callable[[str], Awaitable[dict | None]],
) -> str | None:
    """Why a worker bound to `pools` may not make this write (a sentence), or None. `lookup(url
    path)` reads an object from the server (None when it is not found)."""
    named = _POOL_PATH.match(path)
    if named:
        return _refused(urllib.parse.unquote(named.group(1)), pools)
    if route in _UNBOUND_POLLS:
        return f"this worker user is bound to pool(s) {', '.join(pools)}: it polls them by name"
    data = {}
    if body:
        try:
            data = json.loads(body)
        except ValueError:
            data = {}
    if not isinstance(data, dict):
        data = {}
    if route == "/api/deployments/":
        return _refused(data.get("work_pool_name"), pools)
    if route == "/api/flow_runs/" and data.get("deployment_id"):
        found = await lookup(f"/api/deployments/{data['deployment_id']}")
        return _refused((found or {}).get("work_pool_name"), pools)
    if route in _LOOKUPS:
        object_id = path.split("/")[3]
        found = await lookup(f"/api/{_LOOKUPS[route]}/{object_id}")
        return _refused((found or {}).get("work_pool_name"), pools)
    return None
