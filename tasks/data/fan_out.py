"""A stage's per-file work mapped over the prepare flow's task runner (processes, threads, Dask),
or done in the flow's own process when it is too little to pay for a pool."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from prefect import unmapped

PACK_BYTES = 32 << 20  # text per pack of small files: a new file re-tokenizes at most this much
SMALL_BYTES = 64 << 20  # less work than this is done in the flow's process: a pool's start costs more


def fan_out(stage: Any, items: list[Any], work_bytes: int, runner: str, *args: Any) -> list[Any]:
    """`stage` over `items` (one task run each) on the flow's task runner; a little work on the
    default runner runs in this process instead, one item after another."""
    if runner == "processes" and work_bytes < SMALL_BYTES:
        return [stage(item, *args) for item in items]
    with _this_server():
        return stage.map(items, *[unmapped(a) for a in args]).result()


@contextlib.contextmanager
def _this_server() -> Iterator[None]:
    """Workers (a process pool's, a Dask cluster's) report their task runs to this flow's Prefect
    server. Prefect's temporary server is known to this process only: each worker would start a
    server of its own (seconds each, and runs recorded nowhere). Both runners hand the current
    settings on to their workers, so the server's address goes there."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = PREFECT_API_URL.value()
    if not url:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            url = str(client.api_url).rstrip("/")
    if not url.startswith("http"):
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield
