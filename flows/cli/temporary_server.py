"""The process of Prefect's temporary server: `python -m flows.cli.temporary_server PID ARGS` runs
uvicorn with ARGS, as Prefect's `python -m uvicorn ARGS` would, and ends it once the command whose
process is PID is gone, however it went (docs/faults.md)."""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_S = 0.5
GRACE_S = 10.0  # for uvicorn's own shutdown (lifespan, database) before the process is ended outright


def _watch(parent: int) -> None:
    # Once the parent is gone this process has another (init, or a subreaper). Polled, not asked to
    # signal its death: PR_SET_PDEATHSIG fires when the *thread* that started the child ends (here
    # one that ends as soon as the server answers), and a pipe's end is inherited by every process
    # the command forks.
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown, as the command's own stop
    time.sleep(GRACE_S)
    os._exit(1)


def main() -> None:
    parent = int(sys.argv[1])
    threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()
    sys.argv = ["uvicorn", *sys.argv[2:]]
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
