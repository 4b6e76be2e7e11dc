"""What the CLI shows on the terminal: a user's mistake as one `error:` line with exit status 2,
Prefect's own lines about such a failure kept off the terminal, and progress bars."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
from typing import Any, Iterator

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import tasks
from flows.cli.temporary_start import servers, start_temporary_server
from flows.launch import remove_empty_roots
from flows.settings import settings
from flows.stack.auth_errors import auth_line
from flows.stack.database import DOWN, down_line
from flows.stack.orphans import leave_in_flight
from flows.stack.state import stack_home
from mllm import UserError
from mllm.failures import disk_full, unreachable
from mllm.redact import scrub
from tasks.tracking.servers import prefect_down, tracking_down

console = Console(stderr=True)

# A first run on a new SQLite tracking store: MLflow announces the tables it creates ("Creating
# initial MLflow database tables...", "Updating database tables") and alembic its migrations, at
# INFO. Nothing for the user to do; a warning still shows.
for _name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def fail(message: str) -> None:
    # Escaped: a message's [brackets] are text ('mllm-pipeline[embeddings]'), not markup.
    console.print(f"[bold red]error:[/] {escape(scrub(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user's mistake ends the command with one line and exit status 2, never a traceback."""
    try:
        yield
    except UserError as e:
        remove_empty_roots()
        if str(e).startswith(DOWN):
            leave_in_flight(stack_home())
            drop_unsent_to_prefect()
        fail(str(e))
    except Exception as e:
        message = auth_line(e) or down_line(e) or tracking_down(e) or prefect_down(e) or unreachable(e)
        if message is None:
            raise
        remove_empty_roots()
        if message.startswith(DOWN):  # the flow runs it ran could not be closed: `stack up` closes them
            leave_in_flight(stack_home())
        if message.startswith(DOWN) or message == prefect_down(e):
            drop_unsent_to_prefect()
        fail(message)
    except KeyboardInterrupt:
        console.print(
            "[bold red]error:[/] interrupted: finished stages and the last checkpoint are kept; run the "
            "same command to continue from them",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(128 + (interrupted_by[0] if interrupted_by else signal.SIGINT)) from None


def drop_unsent_to_prefect() -> None:
    """Once the Prefect server (or its database) is down for longer than its client's retries, the
    log lines and events of this command's runs that did not reach it are dropped, and later ones
    are not sent: else the process, its `error:` line printed, would wait at exit for Prefect's
    client to send them, retrying each batch for as long as before that line (about 4 minutes with
    PREFECT_CLIENT_MAX_RETRIES 7), the prompt held all that time. Those the terminal showed stay
    there (or wherever stderr goes); Prefect's own lines about the failure, kept off the terminal
    (`_QuietAfterUserError`), are lost. The runs' states in Prefect stay as they were (`stack up`
    marks the flow runs left in flight Crashed); MLflow's records are not affected.

    Prefect 3.8 has no public way to abandon its queue services (`APILogWorker`, `EventsWorker`,
    `prefect._internal.concurrency.services`): each one is drained at interpreter exit
    (`threading._register_atexit` -> `drain(at_exit=True)`) with no timeout. So their tasks are
    cancelled on Prefect's loop thread here (private attributes `_task`, `_loop` of Prefect
    3.8.8's `_QueueServiceBase`), and that drain finds them done; the API log handlers are taken
    off first, lest a later line start a new log worker that exit would drain again."""
    from prefect._internal.concurrency import services
    from prefect.logging.handlers import APILogHandler

    _quiet.failed = True  # the cancelled services say so on Prefect's debug handler: not the user's concern
    for logger in [logging.root, *logging.root.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", ())):
            if isinstance(handler, APILogHandler):
                logger.removeHandler(handler)
    for service in list(services._active_services):
        task, loop = getattr(service, "_task", None), getattr(service, "_loop", None)
        if task is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: nothing left to wait for
                loop.call_soon_threadsafe(task.cancel)


class _QuietAfterUserError(logging.Filter):
    """On the terminal, a user's mistake is the one `error:` line: Prefect's own lines about the
    failure (the failed task and flow, their hooks, the temporary server stopping) are dropped
    from the console from the first of them on. Prefect's run record keeps them all, unless its
    server is down (`drop_unsent_to_prefect`).

    Where progress bars are shown (`terse`: a terminal, or MLLM_PROGRESS), the bars and the outcome
    are what the terminal shows:
    of the info lines only a retry and the stages' notices (`tasks.NOTICE`: a wait, a converted
    source) stay, not Prefect's "Finished in state Cached" of each stage reused; warnings and
    errors always do. Without a
    terminal (a log file, CI) every line stays: there they are the progress."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False
        self.terse = False
        self.silent = False  # a sweep's terminal: its bar of points, its failures and its table only

    def filter(self, record: logging.LogRecord) -> bool:
        if self.failed or self.silent:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        names = {c.__name__ for c in _subclasses(UserError)}
        message = record.getMessage()
        if " - Retry " in message:
            _plain_retry(record)
            return True  # a passing failure that a retry may mend: the user wants to see it
        if message.startswith(("Running hook '", "Hook '")) and exc is None:
            return False  # our own clean-up hooks (forget_exception): nothing for the user to do
        if "aborted by a termination signal" in message:  # SIGTERM: our one line says it
            self.failed = True
            return False
        if (
            exc is not None
            and (
                isinstance(exc, UserError)
                or unreachable(exc)
                or tracking_down(exc)
                or prefect_down(exc)
                or disk_full(exc)
                or down_line(exc)
            )
        ) or any(f"{n}:" in message or f"{n}(" in message for n in names):
            self.failed = True
            return False
        if self.terse and record.levelno < logging.WARNING:
            return bool(getattr(record, "notice", False))
        return True


def _plain_retry(record: logging.LogRecord) -> None:
    """Prefect's line of a task's retry names the failure by its repr: for the servers' database
    down, a driver's error with its SQL and a link (`RestException('BAD_REQUEST: (psycopg...`),
    which the line's own words then replace."""
    args = record.args
    if (
        isinstance(args, tuple)
        and len(args) == 5
        and isinstance(args[1], BaseException)
        and "%r" in str(record.msg)
        and down_line(args[1])
    ):
        record.msg, record.args = str(record.msg).replace("%r", "%s"), (args[0], DOWN, *args[2:])


def _console_handlers() -> set[logging.Handler]:
    """The handlers through which Prefect's lines reach the terminal: those of Prefect's logging
    configuration (its console and its debug stream), not its run record (`APILogHandler`), nor a
    handler someone else put on the root logger (a test runner's capture would keep the filter, and
    its state, for a whole session)."""
    from prefect.logging.handlers import APILogHandler

    names = ["", *(n for n in logging.root.manager.loggerDict if n.startswith("prefect"))]
    return {
        h
        for n in names
        for h in logging.getLogger(n).handlers
        if type(h).__module__.startswith("prefect.") and not isinstance(h, APILogHandler)
    }


class _AboveTheBars:
    """Stands in for a Prefect console handler's own console while bars are drawn: its lines go
    through the console the bars live on, which prints them above the bars, not through them."""

    def print(self, message: Any, **_: Any) -> None:
        console.print(message, markup=False, highlight=False, soft_wrap=True)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


_quiet = _QuietAfterUserError()
interrupted_by: list[int] = []  # the signal that stopped this command, if one did


def flows_module():
    """The flows module, imported on first use (Prefect takes seconds to import)."""
    from flows import pipeline

    for handler in _console_handlers():
        if _quiet not in handler.filters:
            handler.addFilter(_quiet)
    # A flow that fails within a second can race its own heartbeat thread against the shutdown
    # of Prefect's event worker; Prefect then logs that (harmless) failure with a traceback.
    logging.getLogger("prefect.events.utilities").setLevel(logging.CRITICAL)
    # Prefect's log sender writes each batch its server refused to stderr ("--- Error logging to
    # API ---", a server whose database is down): the command's own error line says what is wrong.
    logging.raiseExceptions = False
    return pipeline


@contextlib.contextmanager
def flow_session() -> Iterator[Any]:
    """The flows module, for a command about to run flows in this process.

    When no PREFECT_API_URL names a server, Prefect's temporary server is started first, in the
    background, so that its start-up (a process importing Prefect's server and opening its
    database) runs on the other core while this one imports torch, MLflow and the flows; Prefect
    would start it only at the first flow run, after those imports. With that server, which ends
    with this process, flow runs send no heartbeats: nothing could ever read them, and stopping
    each run's heartbeat thread costs up to a second.

    Ctrl-C belongs to this process: the temporary server runs in a process group of its own, so
    neither the terminal's Ctrl-C nor a SIGTERM to this command's group (`timeout`, a batch
    scheduler) kills it under the runs it records; the first signal stops the work and marks its
    flow runs Cancelled (the MLflow run ends KILLED), and a second one exits at once."""
    started = datetime.datetime.now(datetime.timezone.utc)
    waiting = start_temporary_server()
    fl = flows_module()
    with _ctrl_c():
        try:
            if waiting is None:
                yield fl
                return
            waiting()
            from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

            with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                yield fl
        except KeyboardInterrupt:
            _cancel_interrupted_runs(started)
            raise


@contextlib.contextmanager
def _ctrl_c() -> Iterator[None]:
    """The first SIGINT raises KeyboardInterrupt where the work is and silences Prefect's lines
    about the crash it causes; the second ends the process at once, without a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def again(signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError):  # a terminal that hung up
            sys.stderr.write("error: interrupted again: stopped at once; run the same command to continue\n")
            sys.stderr.flush()
        # No atexit handler runs after os._exit: the temporary server, in a process group of its
        # own, would outlive this process.
        for server in servers:
            with contextlib.suppress(Exception):
                server.server_process.kill()
        os._exit(128 + signum)

    def first(signum: int, frame: Any) -> None:
        for s in previous:
            signal.signal(s, again)
        _quiet.failed = True  # the terminal shows our one line, not Prefect's "Crash detected!"
        interrupted_by[:] = [signum]
        raise KeyboardInterrupt

    # SIGTERM (docker stop, Kubernetes, a spot reclaim) ends the command as Ctrl-C does: training
    # writes its checkpoint first (mllm.train), the runs are marked, the exit status says which.
    # SIGHUP (the terminal closed) too, unless ignored (nohup): the temporary server, in a process
    # group of its own, does not get the terminal's hang-up and must be stopped by this process.
    wanted = [
        s
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN
    ]
    previous = {s: signal.signal(s, first) for s in wanted}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _cancel_interrupted_runs(since: datetime.datetime) -> None:
    """Mark the flow runs that Ctrl-C stopped (Prefect records them as Crashed by an interrupt
    signal) as Cancelled: they were stopped on purpose and nothing is wrong with them."""
    with contextlib.suppress(Exception):  # the interruption is what the user must hear about
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter
        from prefect.settings import (
            PREFECT_API_REQUEST_TIMEOUT,
            PREFECT_CLIENT_MAX_RETRIES,
            temporary_settings,
        )
        from prefect.states import Cancelled

        # Seconds at most, not a client's minutes of retries: the user asked to stop.
        with (
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_REQUEST_TIMEOUT: 5.0}),
            get_client(sync_client=True) as client,
        ):
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state={"type": {"any_": ["CRASHED"]}}, start_time={"after_": since})
            )
            for run in runs:
                if any(w in (run.state.message or "") for w in ("interrupt signal", "termination signal")):
                    client.set_flow_run_state(
                        run.id, Cancelled(message="interrupted from the terminal (Ctrl-C)"), force=True
                    )


@contextlib.contextmanager
def progress(stages: tuple[str, ...] | None = None, silent: bool = False) -> Iterator[None]:
    """Progress bars for download, tokenization and training, fed by the tasks' hook; `stages`:
    only those bars (a sweep's `points`: its points' own trainings would fight over one bar).
    `silent`: none of Prefect's lines on the terminal from the first bar on (they stay in the
    run record): a sweep of many points would print hundreds of them."""
    if not sys.stderr.isatty() and not settings().progress:
        yield
        return
    bars: dict[str, Any] = {}
    progress = Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )

    lock = threading.Lock()  # a sweep's points end in threads of their own

    def hook(stage: str, completed: float, total: float | None, **f: Any) -> None:
        if stages is not None and stage not in stages:
            return
        with lock:
            draw(stage, completed, total, **f)

    def draw(stage: str, completed: float, total: float | None, **f: Any) -> None:
        if stage not in bars:
            progress.start()  # at the first bar: a command that ends before one leaves no blank line
            bars[stage] = progress.add_task(stage, total=total, info="")
        info = ""
        if stage == "train":
            loss = f.get("train_loss")
            # A time budget's bar runs over its seconds (a known end, its ETA the budget's), so the
            # steps stand alone; else over the steps.
            steps = f"step {f.get('step', int(completed))}" + ("" if f.get("budget_s") else f"/{int(total or 0)}")
            info = (
                steps + (f" loss {loss:.4f}" if loss is not None else "") + f" {f.get('tokens_per_s') or 0:,.0f} tok/s"
            )
        elif stage == "download":
            info = f"{completed / 1e6:.1f} MB"
        elif stage == "tokenize":
            info = f"{int(completed):,} tokens"
        elif stage in ("points", "trials"):
            info = (
                f"{int(completed)}/{int(total or 0)} ended"
                + (f", {f['failed']} failed" if f.get("failed") else "")
                + (f"; last: {f['last']}" if f.get("last") else "")
            )
        progress.update(bars[stage], completed=completed, total=total, info=info)

    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in _console_handlers() if isinstance(h, PrefectConsoleHandler)]
    own = {h: h.console for h in handlers}
    _quiet.terse = True  # for good: the temporary server's "Stopping" line comes after the bars
    _quiet.silent = silent
    tasks.progress_hook = hook
    try:
        for h in handlers:
            h.console = _AboveTheBars()
        yield
    finally:
        tasks.progress_hook = None
        if bars:
            progress.stop()
        for h, own_console in own.items():
            h.console = own_console
