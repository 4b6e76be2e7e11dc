"""The suite cleans up after itself however it ends: a server a test started, and any process a
test worker left behind, end with the process that started them, SIGKILL included."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _gone(pid: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reaped by no one yet (its parent died): a zombie is gone too
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def _killed_after(tmp_path: Path, body: str) -> int:
    """Run `body` in a process that then kills itself with SIGKILL (no finaliser, no atexit);
    the pid it printed."""
    script = tmp_path / "dies.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, subprocess, sys
        sys.path.insert(0, {str(TESTS)!r})
        sys.path.insert(0, {str(TESTS.parent)!r})
    """)
        + textwrap.dedent(body)
        + "\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == -9, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_a_server_a_test_started_ends_when_the_test_process_is_killed(tmp_path: Path) -> None:
    pid = _killed_after(
        tmp_path,
        """
        from flows.stack.processes import free_port
        from servers import background
        port = free_port()
        server = background([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                            f"http://127.0.0.1:{port}/", "server.log")
        server.wait_ready(60)
        print(server.pid, flush=True)
    """,
    )
    assert _gone(pid), "the server outlived the process that started it"


def test_a_workers_leftover_processes_end_with_the_worker_and_its_home_goes(tmp_path: Path) -> None:
    # What conftest.pytest_configure does in an xdist worker: a group of its own, reaped, and its
    # home (the Prefect and MLflow folders, its commands' temporary files) removed after.
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    pid = _killed_after(
        tmp_path,
        f"""
        from servers import reap
        os.setpgid(0, 0)
        reap(os.getpid(), remove=[{str(home)!r}])
        left = subprocess.Popen(["sleep", "600"])  # in the worker's group, as a command a test ran
        print(left.pid, flush=True)
    """,
    )
    assert _gone(pid), "a process the worker started outlived it"
    deadline = time.monotonic() + 20
    while home.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not home.exists(), "the killed worker's home was left behind"


@pytest.mark.slow  # starts the fork server (8 s)
def test_a_forked_command_past_its_timeout_says_where_its_main_thread_waits(tmp_path: Path) -> None:
    """A command the fork server started that outlasts its timeout: the failure shows its last
    lines and the stack of the thread that waits, not a screenful of idle threads' stacks."""
    import prewarmed

    script = tmp_path / "waits_for_a_worker.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, threading, time
            def idle():
                time.sleep(600)
            for _ in range(8):
                threading.Thread(target=idle, daemon=True).start()
            print("loaded the data", file=sys.stderr, flush=True)
            def wait_for_the_worker():
                time.sleep(600)
            wait_for_the_worker()
            """
        )
    )
    proc = prewarmed.start("waits_for_a_worker", [], dict(os.environ), tmp_path)
    try:
        proc.communicate(timeout=3)
    except prewarmed.Timeout as e:
        text = str(e)
    else:
        raise AssertionError("the command ended")
    finally:
        proc.kill()
    assert "still running" in text and "loaded the data" in text
    main = text.split("--- its main thread\n", 1)[1]
    assert main.startswith("Current thread 0x") and "wait_for_the_worker" in main and " idle" not in main
