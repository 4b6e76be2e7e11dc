"""A search's say in its trials' trainings: the callable that the training loop asks at each
evaluation whether to stop (`mllm.train.train(on_eval=...)`), found by the training's key.

The search (flows/search.py) registers one for the key a trial trains under before it starts the
trial's pipeline, and the training stage in this process picks it up. A key has one hook at a
time: two trials of the same config train into the same folder, so they never run at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

EvalHook = Callable[[int, float], bool]  # (step, val loss) -> stop here

_hooks: dict[str, EvalHook] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def asking(key: str, hook: EvalHook) -> Iterator[None]:
    """While inside, a training of `key` in this process asks `hook` at each evaluation."""
    with _lock:
        if key in _hooks:
            raise RuntimeError(f"training {key} already has a search hook")
        _hooks[key] = hook
    try:
        yield
    finally:
        with _lock:
            _hooks.pop(key, None)


def hook_for(key: str) -> EvalHook | None:
    with _lock:
        return _hooks.get(key)
