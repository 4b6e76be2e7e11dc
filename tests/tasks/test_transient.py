"""Transient server errors are not failures: a real Prefect server and a real MLflow server, each
behind a proxy on loopback that answers `503 Service Unavailable` for a while (tests/servers.py
FaultProxy), under a real sweep. Nothing is mocked: Prefect's and MLflow's own clients meet the
503s, and the project's settings and the sweep's retry of a point decide what happens."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import prewarmed
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName, TaskRunFilterStartTime
from prefect.settings import PREFECT_API_URL, temporary_settings
from servers import FaultProxy
from textdata import make_text

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]  # this checkout's code, wherever the command runs
STEPS = [
    "train.max_steps=60",
    "train.eval_interval=30",
    "train.checkpoint_interval=30",
    "train.log_interval=10",
    "sample.max_new_tokens=10",
    "sample.methods=[greedy]",
]


@pytest.fixture(scope="module")
def servers(prefect_server: str, mlflow_server) -> Iterator[dict]:
    """The session's Prefect server and the module's MLflow server, each behind a FaultProxy: only
    the commands of these tests go through the proxies."""
    prefect_proxy = FaultProxy(urlsplit(prefect_server).port).start()
    mlflow_proxy = FaultProxy(urlsplit(mlflow_server.url).port).start()
    try:
        yield {
            "prefect": prefect_proxy,
            "mlflow": mlflow_proxy,
            "env": {"PREFECT_API_URL": f"{prefect_proxy.url}/api", "MLFLOW_TRACKING_URI": mlflow_proxy.url},
        }
    finally:
        prefect_proxy.stop()
        mlflow_proxy.stop()


def _when_training_starts(root: Path, fault) -> threading.Thread:
    """Call `fault()` once the first point's training has written a checkpoint."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while not list(root.glob("runs/*/checkpoints/last.pt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        fault()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _sweep(servers: dict, tmp_path: Path, seed: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=seed))
    args = [
        "sweep",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        str(tmp_path / "storage"),
        "--grid",
        "train.lr=1e-3,3e-3",
        *[a for s in STEPS for a in ("--set", s)],
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "PYTHONPATH": str(REPO),
        **servers["env"],
        **(env or {}),
    }
    return prewarmed.run("flows.cli", args, env, tmp_path, 600)


def _point_runs(servers: dict, out: subprocess.CompletedProcess, view: int = ViewType.ACTIVE_ONLY) -> list:
    parent = next(line.split()[-1] for line in out.stdout.splitlines() if line.startswith("sweep mlflow run:"))
    client = MlflowClient(servers["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.get_run(parent).info.experiment_id
    return client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent}'", run_view_type=view)


def test_both_servers_answering_503_during_a_sweep_fail_nothing(servers: dict, tmp_path: Path) -> None:
    # 10 s: both clients back off and retry (Prefect doubling from 2 s, PREFECT_CLIENT_MAX_RETRIES
    # times; MLflow likewise), so a window shorter than their budgets costs time and fails nothing.
    # The budgets' lengths (the project's 7 retries, about 4 minutes, against Prefect's default 5,
    # about a minute) are in flows/__init__.py; waiting out a minute here would only re-measure them.
    prefect, mlflow = servers["prefect"], servers["mlflow"]
    before = prefect.answered_503, mlflow.answered_503
    _when_training_starts(
        tmp_path / "storage", lambda: (prefect.unavailable(10, until_met=90), mlflow.unavailable(10, until_met=90))
    )
    # Requests to both during the window: the training's progress line goes to Prefect's API every
    # second, its metrics to MLflow every 2 s (MLLM_METRICS_EVERY_S). On a loaded machine a point
    # can spend all 10 s retrying Prefect and send MLflow nothing (seen once): a window no request
    # met stays open until one does.
    out = _sweep(servers, tmp_path, seed=11, env={"MLLM_LOG_EVERY_S": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert prefect.answered_503 > before[0] and mlflow.answered_503 > before[1]  # the clients did meet them
    assert "FAILED" not in out.stdout and "Traceback" not in out.stderr
    runs = _point_runs(servers, out)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}


def test_a_point_that_still_fails_of_a_503_runs_once_more_on_its_own_and_nothing_is_left_failed(
    servers: dict, tmp_path: Path
) -> None:
    # With Prefect's client told to give up after 2 retries (a user's own setting wins over the
    # project's), Prefect answering 503 to the next four new flow runs fails the point that is
    # about to start one (its three tries); the sweep runs that point once more (5 s later here:
    # MLLM_SWEEP_RETRY_DELAY_S), its client's retry gets past the fourth, and it finishes. Counted,
    # not timed: under load the second point came after a 9-second window and never failed.
    prefect = servers["prefect"]
    before, started = prefect.answered_503, datetime.now(UTC)
    _when_training_starts(tmp_path / "storage", lambda: prefect.unavailable_for(4, only="POST /api/flow_runs/ "))
    # As at a terminal (MLLM_PROGRESS): Prefect's lines, the failed attempt's traceback among them,
    # stay in its run record.
    out = _sweep(
        servers,
        tmp_path,
        seed=12,
        env={"PREFECT_CLIENT_MAX_RETRIES": "2", "MLLM_PROGRESS": "1", "MLLM_SWEEP_RETRY_DELAY_S": "5"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert prefect.answered_503 > before
    assert "FAILED" not in out.stdout, out.stdout
    assert "Traceback" not in out.stderr and "failed" not in out.stderr, out.stderr
    assert "2/2 ended" in out.stderr
    # In Prefect's record: one point ran twice, and every point ended Completed.
    with (
        temporary_settings({PREFECT_API_URL: servers["env"]["PREFECT_API_URL"]}),
        get_client(sync_client=True) as client,
    ):
        points = [
            r
            for r in client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    name=TaskRunFilterName(like_="point train.lr="), start_time=TaskRunFilterStartTime(after_=started)
                )
            )
        ]
    assert sorted(r.run_count for r in points) == [1, 2] and all(r.state.is_completed() for r in points), [
        (r.name, r.run_count, r.state_name) for r in points
    ]
    runs = _point_runs(servers, out)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    # The failed attempt's run is in MLflow's trash, naming the run that stands for its point.
    trashed = _point_runs(servers, out, ViewType.DELETED_ONLY)
    assert trashed and all(r.data.tags["sweep.superseded_by"] in {x.info.run_id for x in runs} for r in trashed)


def test_a_tracking_server_answering_503_during_training_is_named_as_answering_503_not_as_gone(
    servers: dict, monkeypatch
) -> None:
    # During training MLflow's client does not retry (outage.fail_fast): a busy server's 503 reaches
    # the pipeline at once. The warning and the error name what happened: the server answered, with
    # 503, so "start it again" would be the wrong advice.
    from mlflow.entities import Metric

    from tasks.tracking import outage
    from tasks.tracking import servers as tracking_servers

    proxy = servers["mlflow"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
    client = MlflowClient(proxy.url)
    run = client.create_run(client.create_experiment(f"busy-{time.time_ns()}"))

    def send(records: list[dict]) -> None:
        client.log_batch(
            run.info.run_id, metrics=[Metric("train_loss", r["train_loss"], 0, r["step"]) for r in records]
        )

    held = outage.HeldMetrics(send, every_s=0.0)
    warnings: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("tasks.tracking.outage").addHandler(catch)  # whatever Prefect's logging setup did to it
    proxy.unavailable(30)
    try:
        with outage.fail_fast(timeout=5):
            held([{"step": 7, "train_loss": 2.5}])
            try:
                send([{"step": 8, "train_loss": 2.4}])
            except Exception as e:  # noqa: BLE001 (what MLflow raises is what the pipeline meets)
                line = tracking_servers.tracking_down(e)
            else:
                pytest.fail("the proxy answered 503, yet log_batch went through")
    finally:
        proxy.unavailable(0)
        logging.getLogger("tasks.tracking.outage").removeHandler(catch)
    assert held.held and held.away_since_step == 7
    assert f"the MLflow tracking server {proxy.url} answered 503 Service Unavailable at step 7" in " ".join(warnings), (
        warnings
    )
    assert line.startswith(f"the MLflow tracking server {proxy.url} answered 503 Service Unavailable: ")
    assert "start it again" not in line and "stack status" in line
    held([])  # the server answers again: what was held is sent
    assert not held.held
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [7]
