"""The stack's work pool, made by the stack itself (as its admin on a secured stack) before any
worker starts: a process pool whose base job template has no `command` variable, so what its
workers run is Prefect's engine for the deployment's flow, whatever a flow run asks for."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

# The variables no flow run may set on the stack's pools: what a worker runs, and where.
FIXED = ("command", "working_dir")


def base_job_template() -> dict:
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    for name in FIXED:
        template["job_configuration"].pop(name, None)
        template["variables"]["properties"].pop(name, None)
    return template


def ensure_pool(api: str, pool: str, open_url) -> None:
    """Create `pool` with the fixed template, or give an existing one that template."""
    template = base_job_template()
    create = urllib.request.Request(
        f"{api}/work_pools/",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"name": pool, "type": "process", "base_job_template": template}).encode(),
    )
    update = urllib.request.Request(
        f"{api}/work_pools/{pool}",
        method="PATCH",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"base_job_template": template}).encode(),
    )
    deadline = time.monotonic() + 60
    for req in (create, update):
        while True:
            try:
                with open_url(req, 30):
                    return
            except urllib.error.HTTPError as e:
                if e.code == 409 and req is create:
                    break  # the pool exists: give it the template
                # SQLite busy with another write: 503, tried again for a while
                if e.code < 500 or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Prefect server did not take pool {pool!r}: HTTP {e.code} {e.read()[:300]!r}"
                    ) from None
            time.sleep(1.0)
