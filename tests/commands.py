"""The CLI as a user runs it, from a test: `cli` runs `mllm-pipeline ARGS` in a process of its own,
`one_line_error` checks a refusal, `files_holding` finds a secret that must be nowhere; and the
session's Prefect server's folder, whose new database `temporary_server_home` copies."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import prewarmed

SESSION_PREFECT_SERVER: list[Path] = []  # the session server's folder: its database, home and log


def temporary_server_home(prefect: Path) -> None:
    """Make `prefect` a Prefect home whose database exists, as a user's is after their first run:
    the temporary server a command starts there then skips the migrations and the registration of
    Prefect's block types (12.9 s of its CPU here against 25.3 s on a new database,
    docs/benchmarks/test-suite.md). A test about a first run (tests/cli/test_cli.py) starts from an empty home."""
    (server_folder,) = SESSION_PREFECT_SERVER
    prefect.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(server_folder / "new-prefect.db", prefect / "prefect.db")


PASSWORD = "s3cr3t-Passw0rd-xyzzy"
TOKEN = "tok-9f8e7d6c5b4a-secret"


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: int = 600,
    fresh: bool = False,
    **env_vars: str,
) -> subprocess.CompletedProcess:
    """`mllm-pipeline ARGS` in a process of its own, as a user runs it: its exit status, stdout
    and stderr. The process is forked from one that has imported the large libraries already
    (tests/prewarmed.py); `fresh=True` starts a new interpreter, for a test about start-up, as
    MLLM_TESTS_FRESH=1 does for every command (to tell whether a failure is the fork's).
    `prewarmed.start` starts one in the background."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {}), **env_vars}
    return prewarmed.run("flows.cli", list(args), full_env, cwd, timeout, fresh=fresh)


def files_holding(needle: str, *folders: Path) -> list[str]:
    """The files under `folders` whose bytes contain `needle` (a secret that must be nowhere)."""
    return [
        str(path)
        for folder in folders
        for path in folder.rglob("*")
        if path.is_file() and needle.encode() in path.read_bytes()
    ]


def one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    """The one `error:` line a command that refused its input printed, with exit status 2 and no
    traceback."""
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]
