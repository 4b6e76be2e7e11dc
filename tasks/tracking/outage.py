"""An MLflow tracking server that stops answering while a pipeline runs.

Training does not wait for it: during training MLflow's requests fail in seconds instead of
retrying for minutes (`fail_fast`), and metrics that cannot be sent are held and sent when the
server answers again (`HeldMetrics`), with one warning; those still held when training ends are
kept in storage (`keep_unsent`). After training the pipeline asks the server once (`check_back`):
still down, the command ends with one line naming it (`TrackingAway`: a sweep runs the point once
more), the training kept in storage; the MLflow run it leaves open is noted in storage
(`note_unfinished`), and the next run against that storage root that reaches the server sends its
kept metrics and closes it (`settle_unfinished`).
"""

from __future__ import annotations

import contextlib
import http
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Iterator

from mllm import UserError, failures, layout, storage
from mllm.failures import exception_chain
from mllm.redact import strip_userinfo
from tasks.settings import settings

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


def server() -> str | None:
    """The tracking server's URL (without credentials), or None for a local store."""
    uri = settings().mlflow_tracking_uri.strip()
    return strip_userinfo(uri)[0].rstrip("/") if uri.startswith(("http://", "https://")) else None


def answers(timeout: float = 3.0) -> bool:
    """Whether the tracking server answers its health check (a local store always does)."""
    url = server()
    if url is None:
        return True
    req, ctx = health_request(f"{url}/health")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (a proxy in front may guard /health)
    except (OSError, ValueError):
        return False


def health_request(url: str):
    """MLflow's health URL as its client would reach it: its CA file, its credential (a server
    behind the stack's proxy answers /health only to a user it knows)."""
    import base64
    import ssl

    req = urllib.request.Request(url)
    s = settings()
    user, password = s.mlflow_tracking_username, s.mlflow_tracking_password
    if user and password:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    ca = s.mlflow_tracking_server_cert_path
    return req, (ssl.create_default_context(cafile=ca) if ca and url.startswith("https") else None)


def _failed(exc: BaseException | None, silent: str = "stopped answering") -> str:
    """How a server failed, in words: "answered 503 Service Unavailable" when the chain of `exc`
    holds a 5xx answer (MLflow's client gives up on a busy server with "too many 503 error
    responses"), else "stopped answering"."""
    for e in exception_chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        found = re.search(r"\b(5\d\d) (?:error responses|[A-Z])", str(e))
        code = status if isinstance(status, int) and status >= 500 else int(found.group(1)) if found else None
        if code is not None:
            with contextlib.suppress(ValueError):
                return f"answered {code} {http.HTTPStatus(code).phrase}"
            return f"answered {code}"
    return silent


def _advice(how: str, silent: str, restart: str) -> str:
    """What to do about a server that failed `how`: start it again when it is gone; when it
    answered errors, find why in its log and wait for it."""
    return (f"start it again ({restart}) and" if how == silent else
            "see why in its log (`mllm-pipeline stack status` names it) and, once it answers again,")


def tracking_down(exc: BaseException | None) -> str | None:
    """One line when `exc` (or what caused it) is the tracking server not answering, or answering
    only 5xx until the client's retries ran out; else None."""
    url = server()
    for e in exception_chain(exc) if url else ():
        text = str(e)
        if failures.no_answer(e) and (url.split("://", 1)[1] in text or "API request to" in text):
            how = _failed(e)
            fix = _advice(how, "stopped answering", "`mllm-pipeline stack up` restarts one")
            return (f"the MLflow tracking server {url} {how}: {fix} run the same command; finished stages and "
                    "training are kept in storage and reused, and the unfinished MLflow run is closed then")
    return None


_probed: dict[str, tuple[float, bool]] = {}


def wait_for_servers() -> bool:
    """Wait until the Prefect server ($PREFECT_API_URL) and the MLflow server answer their health
    checks with 200, for at most MLLM_SERVERS_WAIT_S seconds (240 by default); whether they did.
    Prefect's is its readiness (`/ready`, which asks its database, as the MLflow server of the
    stack shares that database): its `/health` says 200 while that database is down."""
    urls = [u for u in (settings().prefect_api_url.rstrip("/") + "/ready", (server() or "") + "/health")
            if u.startswith(("http://", "https://"))]
    deadline, pause = time.monotonic() + settings().servers_wait_s, 1.0
    while True:
        pending = []
        for url in urls:
            clean = strip_userinfo(url)[0]
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}) if "127.0.0.1" in clean
                                                 else urllib.request.ProxyHandler())
            try:
                with opener.open(url, timeout=10):
                    pass
            except (OSError, ValueError):  # HTTPError (a 503) is an OSError too
                pending.append(url)
        urls = pending
        if not urls or time.monotonic() + pause > deadline:
            return not urls
        time.sleep(pause)
        pause = min(pause * 2, 15.0)


def prefect_database_down() -> str | None:
    """The Prefect server's API URL when that server answers that its database is not available
    (its /ready says 503; the stack's MLflow server shares that database), else None. One look
    every few seconds at most: the terminal's log filter asks for each failure it sees."""
    api = settings().prefect_api_url.rstrip("/")
    if not api.startswith(("http://", "https://")):
        return None
    at, down = _probed.get(api, (0.0, False))
    if time.monotonic() - at > 5.0:
        try:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}) if "127.0.0.1" in api else
                                                 urllib.request.ProxyHandler())
            with opener.open(f"{api}/ready", timeout=5):
                down = False
        except urllib.error.HTTPError as e:
            down = e.code == 503
        except (OSError, ValueError):
            down = False  # the server itself is away: not its database's doing
        _probed[api] = (time.monotonic(), down)
    return strip_userinfo(api)[0] if down else None


def prefect_down(exc: BaseException | None) -> str | None:
    """One line when `exc` (or what caused it) is Prefect's client (httpx) meeting no answer, or only
    5xx answers, from its server; else None. Without $PREFECT_API_URL that server is the temporary
    one Prefect starts inside the command."""
    for e in exception_chain(exc):
        if failures.from_http_client(e) and (failures.dropped(e) or failures.server_error(e)):
            api = settings().prefect_api_url.rstrip("/")
            how = _failed(e, "does not answer")
            if not api:
                return (f"Prefect's temporary server (started by this command, as PREFECT_API_URL is not set) {how}: "
                        "run the same command again (finished stages and training are kept in storage and "
                        "reused); commands run side by side do better on one server (`mllm-pipeline stack up`)")
            fix = _advice(how, "does not answer", "`mllm-pipeline stack up` restarts the stack's")
            return (f"the Prefect server {strip_userinfo(api)[0]} {how}: {fix} run the same command; finished "
                    "stages and training are kept in storage and reused")
    return None


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
            _fast_set[:] = [k for k in wanted if k not in os.environ]
            os.environ.update({k: wanted[k] for k in _fast_set})
        _fast_blocks += 1
    try:
        yield
    finally:
        with _fast_lock:
            _fast_blocks -= 1
            if _fast_blocks == 0:
                for k in _fast_set:
                    os.environ.pop(k, None)
                _fast_set.clear()


class HeldMetrics:
    """`send` (a RunTracker's log_metrics) that holds what it could not send while the tracking
    server is away, and sends it with the next records once the server answers again.

    While the server answers, records are also held for up to `pace_s` seconds and sent together
    (one request, not one per log step), except that an evaluation's records, and those of a step
    that `urgent(step)` names (a checkpoint's: a training resumed from it never logs the steps
    before it again), go at once with everything held."""

    def __init__(self, send: Callable[[list[dict]], None], every_s: float = 10.0, pace_s: float = 0.0,
                 urgent: Callable[[int], bool] | None = None, keep: Callable[[list[dict]], str] | None = None):
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
        if records and self.away_since_step is None and time.monotonic() - self.last_sent < self.pace_s and not any(
                "val_loss" in r or (self.urgent is not None and self.urgent(int(r["step"]))) for r in records):
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
                _logger().warning("the MLflow tracking server %s %s at step %d: training goes on; its metrics are "
                                  "held and sent when the server answers again", server(), _failed(e),
                                  self.away_since_step)
            self.next_try = time.monotonic() + self.every_s
            return
        if self.away_since_step is not None:
            lost = f" ({self.dropped} of the oldest were dropped)" if self.dropped else ""
            _logger().warning("the MLflow tracking server answers again: sent the metrics held since step %d%s",
                        self.away_since_step, lost)
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
        fate = ("were not sent" if where is None else
                f"are kept in {where} and sent by the next run that reaches it (the same command, run again)")
        _logger().warning("the MLflow tracking server %s did not answer again before training ended: %d metric "
                          "records since step %d %s", server(), len(self.held), self.away_since_step, fate)
        self.held = []


class TrackingAway(UserError):
    """The tracking server was away when training ended: the training is kept, and the same
    command, once the server is back, records it. A sweep runs such a point once more (after
    waiting for the server), as it does a point that failed of a refused connection."""


def check_back(run_dir: str) -> None:
    """After training: the server must answer before the outcome is recorded (MLflow's client
    would retry for minutes, then fail naming no server)."""
    if not answers(5.0):
        raise TrackingAway(f"the MLflow tracking server {server()} stopped answering during the run: the training is "
                        f"finished and kept in {run_dir}; start the server again (`mllm-pipeline stack up` restarts "
                        "one) and run the same command to evaluate, register and record it (training is reused)")


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
                _logger().info("dropped %d metric records kept for MLflow run %s: the run is deleted",
                               len(kept["records"]), kept["run_id"])
                continue
            send(kept["run_id"], kept["records"])
            storage.remove(url)
            _logger().info("sent %d metric records of MLflow run %s kept while the tracking server was away",
                           len(kept["records"]), kept["run_id"])


def note_unfinished(root: str, run_id: str, status: str, error: str) -> None:
    """A run the away server could not close, for `settle_unfinished` to close later."""
    with contextlib.suppress(Exception):  # the error the user sees matters more than this note
        storage.write_json(storage.join(_unfinished(root), f"{run_id}.json"),
                           {"run_id": run_id, "status": status, "error": error, "server": server()})


def forget_run(root: str, run_id: str) -> None:
    """What storage keeps for `run_id` (its unsent metrics, the note to close it), for a run
    deleted on purpose: nothing could ever be sent into it."""
    for folder, pattern in ((_unsent(root), f"{run_id}-*.json"), (_unfinished(root), f"{run_id}.json")):
        if not storage.exists(folder):
            continue
        fs, path = storage.filesystem(folder)
        for name in fs.glob(f"{path.rstrip('/')}/{pattern}"):
            storage.remove(storage.join(folder, os.path.basename(name)))


def settle_unfinished(client: Any, root: str, send: Callable[[str, list[dict]], None],
                      deleted: Callable[[str], bool]) -> None:
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
            _logger().info("closed MLflow run %s, left %s when the tracking server stopped answering",
                     note["run_id"], note["status"])
            storage.remove(url)
