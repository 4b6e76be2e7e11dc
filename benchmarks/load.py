"""The stack under load: a sweep of N points on the stack's pool plus M pipelines at once, on
SQLite and on PostgreSQL.

    python -m benchmarks.load [--points 32] [--pipelines 8] [--slots S] [--databases sqlite,postgresql]

For each database a new stack (`flows.stack.servers.up`: Prefect server, a process worker of pool
`local`, MLflow server; SQLite files, or a PostgreSQL cluster of its own from the machine's
binaries) in a temporary folder; then, all at once, `mllm-pipeline sweep --train-on local` over N
learning rates and M `mllm-pipeline run --train-on local`, each with a seed of its own, of the
smoke recipe (30 steps) on War and Peace. The commands reach the two servers through a proxy on
loopback that times each request from its first byte to the end of the answer: the Prefect API's
latency as those clients saw it (median, 95th percentile) and the 5xx answers of either server.
The worker and its trainings talk to the servers directly. Figures per database: points finished
and failed, pipelines finished and failed, 5xx answers (Prefect, MLflow), Prefect's `database is
locked` lines, MLflow runs left RUNNING or FAILED, the wall time, and the peak of the 1-minute
load average (sampled every 2 s).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, corpus, header, load, save, table
from flows.stack.processes import free_port

STEPS = ["train.max_steps=30", "train.eval_interval=30", "train.checkpoint_interval=30", "sample.max_new_tokens=20"]


class TimingProxy:
    """An HTTP forwarder in front of a server that records (seconds, status) of each request; a
    request a connection, so each is seen. A websocket upgrade is passed through, not timed."""

    def __init__(self, upstream_port: int):
        self.upstream, self.port = ("127.0.0.1", upstream_port), free_port()
        self.answers: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(256)
        self.listener = listener
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                t0 = time.perf_counter()
                head, rest = data.split(b"\r\n\r\n", 1)
                lines = head.split(b"\r\n")
                upgrade = any(h.lower().startswith(b"upgrade:") for h in lines[1:])
                if not upgrade:
                    lines = [
                        lines[0],
                        *(h for h in lines[1:] if not h.lower().startswith((b"connection:", b"keep-alive:"))),
                        b"Connection: close",
                    ]
                with socket.create_connection(self.upstream) as server:
                    server.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + rest)
                    up = threading.Thread(target=_pump, args=(client, server), daemon=True)
                    up.start()
                    first = b""
                    while chunk := server.recv(65536):
                        if not first:
                            first = chunk
                        client.sendall(chunk)
                if not upgrade and first.startswith(b"HTTP/"):
                    with self.lock:
                        self.answers.append((time.perf_counter() - t0, int(first.split(b" ", 2)[1])))
            except (OSError, ValueError, IndexError):
                return


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass


def _cli(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )


def _launch(
    commands: list[subprocess.Popen], source: str, points: int, pipelines: int, env: dict[str, str], folder: Path
) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
    """The sweep of `points` learning rates and `pipelines` runs, started together (each added to
    `commands` as it starts, for the caller to stop)."""
    sets = [a for s in STEPS for a in ("--set", s)]
    lrs = ",".join(f"{1e-3 * (1 + i / 4):.6g}" for i in range(points))
    commands.append(
        sweep := _cli(
            "sweep",
            "--recipe",
            "smoke",
            "--source",
            source,
            "--train-on",
            "local",
            "--grid",
            f"train.lr={lrs}",
            *sets,
            env=env,
            log=folder / "sweep.log",
        )
    )
    runs = []
    for i in range(pipelines):
        commands.append(
            run := _cli(
                "run",
                "--recipe",
                "smoke",
                "--source",
                source,
                "--train-on",
                "local",
                *sets,
                "--set",
                f"train.seed={100 + i}",
                env=env,
                log=folder / f"run-{i}.log",
            )
        )
        runs.append(run)
    return sweep, runs


def _outcome(
    folder: Path,
    home: Path,
    env: dict[str, str],
    prefect: "TimingProxy",
    mlflow: "TimingProxy",
    points: int,
    codes: list,
) -> dict[str, Any]:
    """What finished and what failed, as the sweep's table, the exit codes, MLflow's runs and the
    proxies' answers say."""
    from mlflow.tracking import MlflowClient

    table_lines = [line for line in (folder / "sweep.log").read_text().splitlines() if line.startswith("train.lr=")]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiments = [e.experiment_id for e in client.search_experiments()]
    statuses = [r.info.status for r in client.search_runs(experiments, max_results=5000)] if experiments else []
    latencies = sorted(s for s, _ in prefect.answers)
    locked = (home / "logs" / "prefect-server.log").read_text(errors="replace").count("database is locked")
    return {
        "points_finished": sum("FAILED" not in line for line in table_lines),
        "points_failed": points - sum("FAILED" not in line for line in table_lines),
        "sweep_exit": codes[0],
        "pipelines_finished": sum(c == 0 for c in codes[1:]),
        "pipelines_failed": sum(c != 0 for c in codes[1:]),
        "prefect_5xx": sum(s >= 500 for _, s in prefect.answers),
        "mlflow_5xx": sum(s >= 500 for _, s in mlflow.answers),
        "database_locked_lines": locked,
        "prefect_requests": len(latencies),
        "prefect_median_ms": 1000 * statistics.median(latencies) if latencies else None,
        "prefect_p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "mlflow_runs": len(statuses),
        "mlflow_left_running": statuses.count("RUNNING"),
        "mlflow_failed": statuses.count("FAILED"),
    }


def one_database(database: str, points: int, pipelines: int, slots: int | None, folder: Path) -> dict[str, Any]:
    from flows.stack import servers as stack

    home, storage = folder / "stack", folder / "storage"
    home.mkdir(parents=True)
    if database == "sqlite":
        (home / "mlflow.db").touch()  # a home with SQLite records stays on SQLite (flows/stack/database.py)
    # As `stack up` does: without --slots, one a GPU, else one per two cores (0: no limit at all).
    slots = stack.default_slots() if slots is None else slots or None
    state = stack.up(
        home, str(storage), prefect_port=0, mlflow_port=0, slots=slots, worker_env={"OMP_NUM_THREADS": "1"}
    )
    commands: list[subprocess.Popen] = []
    try:
        env = state["env"]
        prefect = TimingProxy(int(env["PREFECT_API_URL"].split(":")[2].split("/")[0]))
        mlflow = TimingProxy(int(env["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1]))
        cmd_env = {
            **os.environ,
            **env,
            "PREFECT_API_URL": f"{prefect.url}/api",
            "MLFLOW_TRACKING_URI": mlflow.url,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "COLUMNS": "200",
        }
        source = str(corpus("warandpeace"))
        peak, done = [load()], threading.Event()

        def sample() -> None:
            while not done.wait(2.0):
                peak.append(load())

        threading.Thread(target=sample, daemon=True).start()
        t0 = time.perf_counter()
        sweep, runs = _launch(commands, source, points, pipelines, cmd_env, folder)
        codes = [p.wait() for p in [sweep, *runs]]
        wall = time.perf_counter() - t0
        done.set()
        outcome = _outcome(folder, home, env, prefect, mlflow, points, codes)
        prefect.close()
        mlflow.close()
        return {
            "database": database,
            "points": points,
            "pipelines": pipelines,
            "slots": slots or "no limit",
            **outcome,
            "wall_s": wall,
            "peak_load": max(peak),
        }
    finally:
        _stop(commands)  # left running only when this ends early (Ctrl-C, an error)
        stack.down(home, force=True)


def _stop(commands: list[subprocess.Popen]) -> None:
    """Stop the sweep and pipelines still running: SIGTERM (the CLI's own way out), then SIGKILL."""
    running = [p for p in commands if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + 15
    for p in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> None:
    import argparse

    from flows.stack import database

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=int, default=32, help="the sweep's points")
    p.add_argument("--pipelines", type=int, default=8, help="pipelines started beside it")
    p.add_argument("--slots", type=int, default=None, help="the pool's slots, 0 for no limit [the stack's default]")
    p.add_argument("--databases", default="sqlite,postgresql")
    args = p.parse_args()
    m = header(f"the stack under load: a sweep of {args.points} points and {args.pipelines} pipelines", False)
    rows = []
    for db in args.databases.split(","):
        if db == "postgresql" and database.server_bin() is None:
            print(f"skipped postgresql: its server is not installed ({database.INSTALL})")
            continue
        # A folder the cluster's user can enter when we are root (flows/stack/database.py runs it as postgres).
        folder = Path(tempfile.mkdtemp(prefix=f"mllm-load-{db}-"))
        folder.chmod(0o755)
        print(f"{db}: stack and logs in {folder}", flush=True)
        try:
            rows.append(one_database(db, args.points, args.pipelines, args.slots, folder))
        except KeyboardInterrupt:
            print(
                f"interrupted: the {db} stack, its sweep and pipelines are stopped; its logs stay in {folder}",
                file=sys.stderr,
            )
            sys.exit(130)
        print(table(rows[-1:], COLUMNS), flush=True)
    print()
    print(table(rows, COLUMNS))
    save("load", {"machine": m, "args": vars(args), "rows": rows, "load_end": load()})


COLUMNS = [
    ("database", "database"),
    ("slots", "slots"),
    ("points_finished", "points done"),
    ("points_failed", "points failed"),
    ("pipelines_finished", "pipelines done"),
    ("pipelines_failed", "pipelines failed"),
    ("prefect_5xx", "Prefect 5xx"),
    ("mlflow_5xx", "MLflow 5xx"),
    ("database_locked_lines", "'database is locked'"),
    ("prefect_median_ms", "Prefect API median ms"),
    ("prefect_p95_ms", "p95 ms"),
    ("mlflow_left_running", "MLflow runs RUNNING"),
    ("mlflow_failed", "MLflow runs FAILED"),
    ("wall_s", "wall s"),
    ("peak_load", "peak load"),
]


if __name__ == "__main__":
    main()
