"""A search's say in its trials' trainings: the callable that the training loop asks at each
evaluation whether to stop (`mllm.train.train(on_eval=...)`), found by the training's key."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from mllm import storage

EvalHook = Callable[[int, float], bool]  # (step, val loss) -> stop here

_hooks: dict[str, EvalHook] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def asking(key: str, hook: EvalHook) -> Iterator[None]:
    """While inside, a training of `key` in this process asks `hook` at each evaluation. A key has one
    hook at a time: two trials of the same config train into the same folder, so they never run at
    once."""
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


def folder(run_dir: str) -> str:
    return storage.join(run_dir, "search")


def through_storage(run_dir: str, wait_s: float = 120.0) -> EvalHook:
    """On a worker: the hook that asks the search over storage, and waits up to `wait_s` for it."""

    def ask(step: int, val_loss: float) -> bool:
        storage.write_json(storage.join(folder(run_dir), f"eval-{step}.json"), {"step": step, "val_loss": val_loss})
        verdict = storage.join(folder(run_dir), f"verdict-{step}.json")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if storage.exists(verdict):
                return bool(storage.read_json(verdict)["prune"])
            time.sleep(0.5)
        return False

    return ask


@contextlib.contextmanager
def answering(run_dir: str, hook: EvalHook, every_s: float = 0.5) -> Iterator[None]:
    """In the search: while inside, each evaluation a worker's training of `run_dir` reports is
    answered with `hook`'s verdict. Verdicts of an earlier training of the same folder are removed
    first (a pruned trial's, which a new trial of the same config must not read)."""
    storage.remove(folder(run_dir))
    stop = threading.Event()

    def answer() -> None:
        answered: set[str] = set()
        while not stop.wait(every_s):
            try:
                fs, path = storage.filesystem(folder(run_dir))
                fs.invalidate_cache(path)
                names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.exists(path) else []
            except Exception:  # noqa: BLE001 (storage unreachable a moment: the next round answers)
                continue
            for name in names:
                if not name.startswith("eval-") or name in answered:
                    continue
                with contextlib.suppress(Exception):  # a half-written report: read again next round
                    asked = storage.read_json(storage.join(folder(run_dir), name))
                    try:
                        prune = bool(hook(int(asked["step"]), float(asked["val_loss"])))  # numpy's bool too
                    except Exception:  # noqa: BLE001 (a pruner that cannot answer stops no training)
                        prune = False
                    storage.write_json(
                        storage.join(folder(run_dir), name.replace("eval-", "verdict-")), {"prune": prune}
                    )
                    answered.add(name)

    thread = threading.Thread(target=answer, daemon=True, name=f"answering {run_dir}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
