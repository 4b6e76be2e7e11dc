"""`python tests/reaper.py WATCHED_PID PGID [FOLDER ...]`: end process group PGID once process
WATCHED_PID is gone, so that a server a test started does not outlive a test run that was killed
(SIGTERM, SIGKILL, a crashed xdist worker) before its fixtures could stop it; then remove the
FOLDERs (the test process's home), which nothing of the group writes to any more.

It leads a session of its own, so the signal that ended the run does not end it too, and exits
by itself once the group has ended."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A parent that died but was not reaped yet is a zombie: gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def main(watched: int, pgid: int, remove: list[str], poll: float = 0.5) -> None:
    while _group_alive(pgid):
        if not _alive(watched):
            os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
            break
        time.sleep(poll)
    for folder in remove:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
