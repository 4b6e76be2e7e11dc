"""Prefect tasks, one per pipeline stage: caching, retries, storage I/O, MLflow logging."""

from __future__ import annotations

from typing import Any, Callable

# The CLI sets this to draw progress bars; under a worker it stays None and tasks log instead.
progress_hook: Callable[..., None] | None = None

# `logger.info(..., extra=NOTICE)`: a line the terminal shows beside the progress bars (a wait, a
# converted source); the stages' other info lines are in the run record only (flows.cli.terminal).
NOTICE = {"notice": True}


def report_progress(stage: str, completed: float, total: float | None, **fields: Any) -> None:
    if progress_hook is not None:
        progress_hook(stage, completed, total, **fields)
