"""What makes a stage's output reusable: its key (its folder's name and Prefect's cache key), where
Prefect keeps results, and retries."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from fsspec.implementations.local import LocalFileSystem
from prefect.filesystems import RemoteFileSystem

from mllm import UserError, failures, layout, storage


def stage_cache(key_fn: Callable[..., str]) -> Callable[[Any, dict[str, Any]], str]:
    """Turn a stage's key function into a Prefect cache_key_fn over the task's parameters."""

    def cache_key(context: Any, parameters: dict[str, Any]) -> str:
        return f"{key_fn.__name__.strip('_')}-{key_fn(**parameters)}"

    return cache_key


def retry_unless_mistake(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: retry I/O failures, never a user's mistake (a retry cannot fix it)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        return True
    if failures.disk_full(exc):
        return False  # no retry makes room
    return not isinstance(exc, UserError) or getattr(exc, "transient", False)


def retry_io_only(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition for costly stages: retry only when storage or the network failed (the
    stage then resumes from what it had written), not a bug or a user's mistake."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if failures.disk_full(exc):
        return False  # no retry makes room (a training would start again from its last checkpoint)
    for e in failures.exception_chain(exc):
        if isinstance(e, UserError):
            return getattr(e, "transient", False)
        if failures.io_failure(e):
            return True
    return False


def result_storage(root: str) -> Path | RemoteFileSystem:
    """Prefect result storage under the storage root, so cached results live beside the data.

    Prefect takes a local folder as a path; any other root becomes a saved RemoteFileSystem
    block (fsspec underneath, credentials from the environment, never stored in the block).
    """
    url = layout.folder(root, layout.PREFECT_RESULTS)
    fs, path = storage.filesystem(url)
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    block = RemoteFileSystem(basepath=url, settings=storage.storage_options(url))
    block.save(f"mllm-results-{storage.digest(url)}", overwrite=True)
    return block


def forget_exception(*hook_args: Any) -> None:
    """An on_failure hook (for tasks and flows): remove the pickled exception Prefect wrote for
    the failed run under a random name in the result storage, where such files pile up. The run's
    state message, in Prefect's database and UI, still says what went wrong."""
    record = getattr(hook_args[-1], "data", None)
    key = getattr(getattr(record, "metadata", None), "storage_key", None)
    if key and ("://" in key or Path(key).is_absolute()):
        try:
            storage.remove(key)
        except Exception:  # noqa: BLE001  (a leftover file is no reason to mask the failure)
            pass
        # A flow that failed before any task kept a result leaves no empty results folder behind
        # (a flow's hook: its tasks have ended, none is about to write there).
        folder = Path(key).parent
        if type(hook_args[0]).__name__ == "Flow" and folder.name == layout.PREFECT_RESULTS and folder.is_dir():
            try:
                folder.rmdir()  # only when empty
            except OSError:
                pass
