"""Prefect tasks, one per pipeline stage: caching, retries, storage I/O, MLflow logging."""

from __future__ import annotations

from typing import Any, Callable

# The CLI sets this to draw progress bars; under a worker it stays None and tasks log instead.
progress_hook: Callable[..., None] | None = None


def report_progress(stage: str, completed: float, total: float | None, **fields: Any) -> None:
    if progress_hook is not None:
        progress_hook(stage, completed, total, **fields)
