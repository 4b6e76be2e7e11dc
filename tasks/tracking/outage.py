"""An MLflow tracking server that stops answering while a pipeline runs: training goes on and holds its
metrics, and a later run sends them and closes the MLflow run (docs/faults.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

from mllm import UserError, layout, storage
from mllm.settings import export, export_defaults
from tasks.settings import settings
from tasks.tracking.servers import answers, how_failed, server, tracking_down

log = logging.getLogger(__name__)


def _logger() -> Any:
    """The Prefect run's logger inside a task or flow (its lines reach the terminal), else ours."""
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # noqa: BLE001 (no run context)
        return log


HOLD_AT_MOST = 200_000  # metric records held while the server is away; older ones are dropped


def metrics_every_s() -> float:
    """Seconds between two metric requests of a training (MLLM_METRICS_EVERY_S, default 2): one
    log_batch costs 25-55 ms over HTTP on a 2-core machine, 3-5% of a small model's training
    when sent at every log step (docs/team-stack.md, tracking overhead). 0 sends every log step."""
    return settings().metrics_every_s


def retry_every_s() -> float:
    """Seconds between two looks at a tracking server that stopped answering during a training
    (MLLM_METRICS_RETRY_S, default 10; each look a 2 s health check)."""
    return settings().metrics_retry_s


# fail_fast's blocks in flight in this process, and the settings it put in the environment for
# them: MLflow's client reads its settings from the environment, which every thread shares.
_fast_lock = threading.Lock()
_fast_blocks = 0
_fast_set: list[str] = []


@contextlib.contextmanager
def fail_fast(timeout: float = 10.0) -> Iterator[None]:
    """MLflow's requests without its retries (minutes of them) while the block runs: a request to
    a server that is away fails in seconds and its caller decides what to do.

    The settings are the process's (MLflow reads them from the environment), so they hold until
    the last block in flight ends: a sweep's points close their failed runs in threads side by
    side, and a block that ended first must not hand the others back minutes of retries. The
    first block's `timeout` holds for those that overlap it; the user's own settings win."""
    global _fast_blocks
    wanted = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout))}
    with _fast_lock:
        if _fast_blocks == 0:
            _fast_set[:] = export_defaults(wanted)
        _fast_blocks += 1
    try:
        yield
    finally:
        with _fast_lock:
            _fast_blocks -= 1
            if _fast_blocks == 0:
                export(dict.fromkeys(_fast_set))
                _fast_set.clear()


class HeldMetrics:
    """`send` (a RunTracker's log_metrics) that holds what it could not send while the tracking
    server is away, and sends it with the next records once the server answers again.

    While the server answers, records are also held for up to `pace_s` seconds and sent together
    (one request, not one per log step), except that an evaluation's records, and those of a step
    that `urgent(step)` names (a checkpoint's: a training resumed from it never logs the steps
    before it again), go at once with everything held."""

    def __init__(
        self,
        send: Callable[[list[dict]], None],
        every_s: float = 10.0,
        pace_s: float = 0.0,
        urgent: Callable[[int], bool] | None = None,
        keep: Callable[[list[dict]], str] | None = None,
    ):
        self.send, self.every_s, self.pace_s, self.urgent = send, every_s, pace_s, urgent
        self.keep = keep  # where what is still held when training ends goes (keep_unsent); None: dropped
        self.held: list[dict] = []
        self.dropped = 0
        self.away_since_step: int | None = None
        self.next_try = 0.0
        self.last_sent = time.monotonic()

    def __call__(self, records: list[dict]) -> None:
        self.held += records
        if len(self.held) > HOLD_AT_MOST:
            self.dropped += len(self.held) - HOLD_AT_MOST
            self.held = self.held[-HOLD_AT_MOST:]
        if not self.held:
            return
        if (
            records
            and self.away_since_step is None
            and time.monotonic() - self.last_sent < self.pace_s
            and not any("val_loss" in r or (self.urgent is not None and self.urgent(int(r["step"]))) for r in records)
        ):
            return
        if self.away_since_step is not None:
            if time.monotonic() < self.next_try:
                return
            if not answers(2.0):  # one look every few seconds, not a request per log step
                self.next_try = time.monotonic() + self.every_s
                return
        try:
            self.send(self.held)
        except Exception as e:
            if tracking_down(e) is None:
                raise
            if self.away_since_step is None:
                self.away_since_step = int(self.held[0]["step"]) if self.held else -1
                _logger().warning(
                    "the MLflow tracking server %s %s at step %d: training goes on; its metrics are "
                    "held and sent when the server answers again",
                    server(),
                    how_failed(e),
                    self.away_since_step,
                )
            self.next_try = time.monotonic() + self.every_s
            return
        if self.away_since_step is not None:
            lost = f" ({self.dropped} of the oldest were dropped)" if self.dropped else ""
            _logger().warning(
                "the MLflow tracking server answers again: sent the metrics held since step %d%s",
                self.away_since_step,
                lost,
            )
            self.away_since_step, self.dropped = None, 0
        self.held = []
        self.last_sent = time.monotonic()

    def flush(self) -> None:
        """A last try at what is held (training ended); what the server cannot take is kept in
        storage (`keep`) for the next run that reaches it to send (`settle_unfinished`)."""
        self.next_try = 0.0
        if self.held:
            self([])
        if not self.held:
            return
        where = None
        if self.keep is not None:
            try:
                where = self.keep(self.held)
            except Exception as e:  # noqa: BLE001 (storage away too: the warning says they are lost)
                log.debug("could not keep the unsent metrics: %s", e)
        fate = (
            "were not sent"
            if where is None
            else f"are kept in {where} and sent by the next run that reaches it (the same command, run again)"
        )
        _logger().warning(
            "the MLflow tracking server %s did not answer again before training ended: %d metric "
            "records since step %d %s",
            server(),
            len(self.held),
            self.away_since_step,
            fate,
        )
        self.held = []


class TrackingAway(UserError):
    """The tracking server was away when training ended: the training is kept, and the same
    command, once the server is back, records it. A sweep runs such a point once more (after
    waiting for the server), as it does a point that failed of a refused connection."""


def check_back(run_dir: str) -> None:
    """After training: the server must answer before the outcome is recorded (MLflow's client
    would retry for minutes, then fail naming no server)."""
    if not answers(5.0):
        raise TrackingAway(
            f"the MLflow tracking server {server()} stopped answering during the run: the training is "
            f"finished and kept in {run_dir}; start the server again (`mllm-pipeline stack up` restarts "
            "one) and run the same command to evaluate, register and record it (training is reused)"
        )


def _unfinished(root: str) -> str:
    return layout.folder(root, layout.TRACKING, "unfinished")


def _unsent(root: str) -> str:
    return layout.folder(root, layout.TRACKING, "unsent")


def keep_unsent(root: str, run_id: str, records: list[dict]) -> str:
    """Metric records of `run_id` that the away server could not take, written to storage for
    `settle_unfinished`; the file's URL."""
    url = storage.join(_unsent(root), f"{run_id}-{time.time_ns()}.json")
    storage.write_json(url, {"run_id": run_id, "server": server(), "records": records})
    return url


def send_unsent(root: str, send: Callable[[str, list[dict]], None], deleted: Callable[[str], bool]) -> None:
    """Send the metric records kept for this server's runs (`keep_unsent`), each file once. Those
    of a run that was `deleted` since (the MLflow UI, `mlflow runs delete`, `mlflow gc`) are
    dropped: the server refuses metrics for a deleted run, and the file would fail every later
    run's attempt, and hold back the files after it."""
    folder = _unsent(root)
    if not storage.exists(folder):
        return
    fs, path = storage.filesystem(folder)
    with storage.exclusive(folder):  # runs side by side (a sweep's points) send each file once
        for name in sorted(fs.glob(f"{path.rstrip('/')}/*.json")):
            url = storage.join(folder, os.path.basename(name))
            kept = storage.read_json(url)
            if kept.get("server") != server():
                continue  # another server's run
            if deleted(kept["run_id"]):
                storage.remove(url)
                _logger().info(
                    "dropped %d metric records kept for MLflow run %s: the run is deleted",
                    len(kept["records"]),
                    kept["run_id"],
                )
                continue
            send(kept["run_id"], kept["records"])
            storage.remove(url)
            _logger().info(
                "sent %d metric records of MLflow run %s kept while the tracking server was away",
                len(kept["records"]),
                kept["run_id"],
            )


def note_unfinished(root: str, run_id: str, status: str, error: str) -> None:
    """A run the away server could not close, for `settle_unfinished` to close later."""
    with contextlib.suppress(Exception):  # the error the user sees matters more than this note
        storage.write_json(
            storage.join(_unfinished(root), f"{run_id}.json"),
            {"run_id": run_id, "status": status, "error": error, "server": server()},
        )


def forget_run(root: str, run_id: str) -> None:
    """What storage keeps for `run_id` (its unsent metrics, the note to close it), for a run
    deleted on purpose: nothing could ever be sent into it."""
    for folder, pattern in ((_unsent(root), f"{run_id}-*.json"), (_unfinished(root), f"{run_id}.json")):
        if not storage.exists(folder):
            continue
        fs, path = storage.filesystem(folder)
        for name in fs.glob(f"{path.rstrip('/')}/{pattern}"):
            storage.remove(storage.join(folder, os.path.basename(name)))


def settle_unfinished(
    client: Any, root: str, send: Callable[[str, list[dict]], None], deleted: Callable[[str], bool]
) -> None:
    """Send the metrics an away server could not take (`send(run_id, records)`), then close the
    runs it left open, with the status and error they ended with; what is kept for a run that was
    `deleted` since is dropped (`send_unsent`)."""
    with contextlib.suppress(Exception):  # kept for the next run: this one goes on
        send_unsent(root, send, deleted)
    folder = _unfinished(root)
    with contextlib.suppress(Exception):
        if not storage.exists(folder):
            return
        fs, path = storage.filesystem(folder)
        for name in fs.glob(f"{path.rstrip('/')}/*.json"):
            url = storage.join(folder, os.path.basename(name))
            note = storage.read_json(url)
            if note.get("server") != server():
                continue  # another server's run
            if deleted(note["run_id"]):  # the server refuses to close a deleted run
                storage.remove(url)
                continue
            client.set_tag(note["run_id"], "error", note["error"])
            client.set_terminated(note["run_id"], note["status"])
            _logger().info(
                "closed MLflow run %s, left %s when the tracking server stopped answering",
                note["run_id"],
                note["status"],
            )
            storage.remove(url)
