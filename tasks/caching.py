"""What makes a stage's output reusable: its key, where Prefect keeps results, and retries.

A stage's key is a digest of its inputs' content, its config and the source of the code that
does the work. It names the stage's folder under the storage root and is Prefect's cache key, so
Prefect shows a stage whose output already exists as Cached instead of running it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from fsspec.implementations.local import LocalFileSystem
from prefect.filesystems import RemoteFileSystem

import mllm
from mllm import UserError, layout, storage


@functools.cache
def code_digest(*objects: Any) -> str:
    """Digest of the source of the modules or classes a stage runs, and the package version."""
    h = hashlib.sha256(mllm.__version__.encode())
    for obj in objects:
        h.update(layout.source_before_moves(inspect.getsource(obj)).encode())
    return h.hexdigest()[:16]


# No model runs these: what a stage's folder is called, and what kind of failure an exception is.
_NOT_MODEL_CODE = {"layout.py", "failures.py"}


def _is_docstring_only(text: str) -> bool:
    body = ast.parse(text).body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)


@functools.cache
def package_digest() -> str:
    """Digest of every source file of the `mllm` package and its version: what the training,
    evaluation and sample keys take, so that no change to the code a model runs (a batcher, a
    loader, a decoder) leaves a model made by other code looking current."""
    root = Path(mllm.__file__).parent
    files = []
    for path in root.rglob("*.py"):
        relative, text = path.relative_to(root).as_posix(), path.read_bytes().decode()
        if relative in _NOT_MODEL_CODE or _is_docstring_only(text):  # a package's __init__, say
            continue
        # Each file as it was named and written before the modules moved: a move is no change.
        previous = layout.previous_path(relative)
        files.append((PurePosixPath(previous).parts, previous, layout.source_before_moves(text)))
    h = hashlib.sha256(mllm.__version__.encode())
    for _, relative, text in sorted(files):
        h.update(relative.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def stage_cache(key_fn: Callable[..., str]) -> Callable[[Any, dict[str, Any]], str]:
    """Turn a stage's key function into a Prefect cache_key_fn over the task's parameters."""

    def cache_key(context: Any, parameters: dict[str, Any]) -> str:
        return f"{key_fn.__name__.strip('_')}-{key_fn(**parameters)}"

    return cache_key


def transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: retry I/O failures, never a user's mistake (a retry cannot fix it)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        return True
    if storage.disk_full(exc):
        return False  # no retry makes room
    return not isinstance(exc, UserError) or getattr(exc, "transient", False)


def io_error(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition for costly stages: retry only when storage or the network failed (the
    stage then resumes from what it had written), not a bug or a user's mistake."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if storage.disk_full(exc):
        return False  # no retry makes room (a training would start again from its last checkpoint)
    while exc is not None:
        if isinstance(exc, UserError):
            return getattr(exc, "transient", False)
        if isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.split(".")[0] in _IO_MODULES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# Libraries whose exceptions all mean the storage or the network failed.
_IO_MODULES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3", "requests"}


def result_storage(root: str) -> Path | RemoteFileSystem:
    """Prefect result storage under the storage root, so cached results live beside the data.

    Prefect takes a local folder as a path; any other root becomes a saved RemoteFileSystem
    block (fsspec underneath, credentials from the environment, never stored in the block).
    """
    url = storage.join(root, "prefect-results")
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
