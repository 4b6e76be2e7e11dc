"""The secured stack's audit trail and login throttle: every write, every websocket and every
refused credential the gate (flows/stack/gate.py) answers, one JSON line each in
`<home>/auth/audit/audit.jsonl` (0600, in a 0700 folder, rotated at 10 MB, five kept), and the
failed logins counted per user and per source address; `stack audit` reads the file back.
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import os
import time
from collections import defaultdict, deque
from pathlib import Path

ROTATE_BYTES = 10 * 1024 * 1024
KEEP = 5
# Failed logins: more than TRIES within WINDOW_S seconds, from one address or for one user, lock
# that address or user out for LOCK_S seconds (answered 429 without a password check).
TRIES, WINDOW_S, LOCK_S = 10, 60.0, 300.0


def folder(home: Path) -> Path:
    return home / "auth" / "audit"


def audit_file(home: Path) -> Path:
    return folder(home) / "audit.jsonl"


class _Private(logging.handlers.RotatingFileHandler):
    """A rotating file made 0600 from the start (the rotated ones keep their mode)."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8")


class Audit:
    def __init__(self, home: Path):
        folder(home).mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder(home), 0o700)
        self.log = logging.getLogger(f"mllm.stack.audit.{home}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        if not self.log.handlers:
            self.log.addHandler(_Private(audit_file(home), maxBytes=ROTATE_BYTES, backupCount=KEEP))

    def write(self, **entry) -> None:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
        self.log.info(json.dumps({"time": now, **entry}, sort_keys=False))


class Throttle:
    """Failed logins per key (a user's name, an address): a lockout once there are too many."""

    def __init__(self, tries: int = TRIES, window_s: float = WINDOW_S, lock_s: float = LOCK_S):
        self.tries, self.window_s, self.lock_s = tries, window_s, lock_s
        self.failures: dict[str, deque] = defaultdict(deque)
        self.locked_until: dict[str, float] = {}

    def locked(self, *keys: str) -> bool:
        now = time.monotonic()
        return any(self.locked_until.get(k, 0) > now for k in keys)

    def fail(self, *keys: str) -> list[str]:
        """Count a failure against each key; the keys this failure locks out."""
        now, locked = time.monotonic(), []
        for key in keys:
            seen = self.failures[key]
            seen.append(now)
            while seen and seen[0] < now - self.window_s:
                seen.popleft()
            if len(seen) > self.tries and self.locked_until.get(key, 0) <= now:
                self.locked_until[key] = now + self.lock_s
                seen.clear()
                locked.append(key)
        return locked


# -- reading it back (`stack audit`) -------------------------------------------------------------


def since_time(text: str | None) -> datetime.datetime | None:
    """`--since`: an ISO time, or an age such as 30m, 2h, 1d."""
    if not text:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].isdigit():
        return datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=int(text[:-1]) * units[text[-1]])
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.UTC)


def entries(
    home: Path, user: str | None = None, since: datetime.datetime | None = None, failed: bool = False
) -> list[dict]:
    """The audit's entries, oldest first, those of `user`, at or after `since`, refused ones only
    with `failed` (a refused credential or a lockout)."""
    files = [audit_file(home).with_name(f"audit.jsonl.{i}") for i in range(KEEP, 0, -1)] + [audit_file(home)]
    found = []
    for path in files:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if user and entry.get("user") != user:
                continue
            if since and datetime.datetime.fromisoformat(entry["time"]) < since:
                continue
            if failed and entry.get("event") not in ("login_failed", "locked_out", "lockout"):
                continue
            found.append(entry)
    return found


def line(entry: dict) -> str:
    what = entry.get("event", "request")
    detail = f" ({entry['detail']})" if entry.get("detail") else ""
    return (
        f"{entry['time']}  {entry.get('user') or '-':<14} {entry.get('role') or '-':<7} "
        f"{entry.get('source') or '-':<16} {entry.get('status', ''):<4} {what:<12} "
        f"{entry.get('method', '')} {entry.get('path', '')}{detail}"
    )
