"""The stack for real on loopback: training on a work pool with everything in S3, a killed
worker, a storage outage, and scheduled retraining with its decisions.

The stack (`flows.stack.up`: a Prefect server, a process worker, an MLflow server) and moto's S3
server (behind a proxy that can be switched off) run for the whole module; the storage root is
`s3://<bucket>/...`, MLflow's artifacts go to the same bucket.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import prewarmed
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterName,
)
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL, temporary_settings
from servers import S3Server, run_s3_server
from textdata import make_text

import mllm.train
from flows.stack import servers as stack
from mllm import storage
from mllm.config import RunConfig

pytestmark = pytest.mark.integration

BUCKET = "mllm-test"
FAST = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=20",
]
# Long enough (about 20 s on one thread) to kill in the middle, checkpoints every 50 steps.
LONG = [
    "train.max_steps=400",
    "train.eval_interval=100",
    "train.checkpoint_interval=50",
    "train.log_interval=10",
    "sample.max_new_tokens=20",
]


@dataclass
class Stack:
    home: Path
    env: dict[str, str]  # what a process needs to use the stack and the bucket
    s3: S3Server

    def keys(self, prefix: str) -> list[str]:
        pages = self.s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def cli(self, *args: str, cwd: Path, **env: str) -> subprocess.Popen:
        return prewarmed.start(
            "flows.cli", list(args), {**os.environ, **self.env, "MLLM_LOST_AFTER_S": "8", **env}, cwd
        )


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with run_s3_server(tmp_path_factory.mktemp("s3")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        server.client().put_object(Bucket=BUCKET, Key="corpus.txt", Body=make_text(6000).encode())
        # Another text for another test: the same one would find its model trained already.
        server.client().put_object(Bucket=BUCKET, Key="corpus2.txt", Body=make_text(6000, seed=3).encode())
        yield server


@pytest.fixture(scope="module")
def stack_env(s3, open_dir: Path):
    # On PostgreSQL where its server is installed (CI), as `stack up` is for a user who has it. Under
    # pytest's private folders the stack fell back to SQLite, where this module's load (a training,
    # the worker polling every second, the tests' own polling) held the one writer's lock up to
    # Prefect's 60-s busy timeout: a `schedule list` got no answer in 120 s (CI of 33b1a79).
    # SQLite's stack stays tested where it fits, one user's load (tests/stack/test_stack_auth.py).
    home = open_dir / "stack"
    mp = pytest.MonkeyPatch()
    mp.setenv("HOME", str(home / "home"))  # the servers write nothing under the real ~
    for k, v in s3.env.items():
        mp.setenv(k, v)
    # A deployment's run that finds its one slot taken tries again after this (Prefect's default: 30 s,
    # paid by each queued run of the schedule and of the UI's form below). Not 1 s: each try is the
    # worker proposing Pending again, a hundred of them while a training runs on a loaded machine.
    mp.setenv("PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS", "5")
    try:
        state = stack.up(
            home,
            f"s3://{BUCKET}/mlflow",
            pool="local",
            prefect_port=0,
            mlflow_port=0,
            worker_env={"OMP_NUM_THREADS": "1", "MLLM_LOG_EVERY_S": "1", "PREFECT_WORKER_QUERY_SECONDS": "1"},
        )
        for k, v in state["env"].items():
            mp.setenv(k, v)
        with temporary_settings({PREFECT_API_URL: state["env"]["PREFECT_API_URL"]}):
            yield Stack(home, {**s3.env, **state["env"], "OMP_NUM_THREADS": "1"}, s3)
    finally:
        stack.down(home, force=True)
        mp.undo()


@pytest.fixture(autouse=True)
def _stack_mlflow(request, monkeypatch) -> None:
    """This module's tests log to the stack's MLflow server, not to a store of their own."""
    if "stack_env" in request.fixturenames:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", request.getfixturevalue("stack_env").env["MLFLOW_TRACKING_URI"])


@pytest.fixture(autouse=True)
def _no_run_left_in_flight(request):
    """After each test on the stack, its flow runs still in flight are ended, so that the module's
    next tests find the pool's slots free; a test that passed and left any fails, naming them."""
    yield
    if "stack_env" not in request.fixturenames:
        return
    services = stack.load(request.getfixturevalue("stack_env").home)["services"]
    if not any(s.name == "prefect-server" and s.alive() for s in services):
        return  # a test that stopped the stack: nothing runs on it
    left = _end_runs_in_flight()
    report = getattr(request.node, "rep_call", None)  # tests/stack/conftest.py
    if left and report is not None and report.passed:
        raise AssertionError(f"the test left flow runs in flight, now cancelled: {', '.join(left)}")


def _wait_for(what: str, condition, timeout: float, proc: subprocess.Popen | None = None, stack_env=None):
    """`condition()` once it is true, within `timeout` s; else an error that says, with `stack_env`,
    each of the stack's flow runs with its states and the worker log's last lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    told = f"\n--- the stack's flow runs\n{_flow_runs(stack_env)}" if stack_env is not None else ""
    raise AssertionError(f"no {what} within {timeout} s{told}")


def _communicate(proc: prewarmed.Command, timeout: float, stack_env: Stack) -> tuple[str, str]:
    """The command's stdout and stderr once it ends; past `timeout` s it is killed, and the error
    says each of the stack's flow runs with its states and the worker log's last lines."""
    try:
        return proc.communicate(timeout=timeout)
    except prewarmed.Timeout as e:
        proc.kill()
        raise AssertionError(f"{e}\n--- the stack's flow runs\n{_flow_runs(stack_env)}") from None


def _checkpoint(stack_env: Stack, prefix: str) -> str | None:
    return next((k for k in stack_env.keys(prefix) if k.endswith("checkpoints/last.pt")), None)


def _uninterrupted(trained: dict, folder: Path) -> mllm.train.TrainResult:
    """The same training, start to end in this process, into a local folder."""
    job = RunConfig.model_validate(yaml.safe_load(storage.read_text(trained["config"])))
    job.paths.checkpoint_dir = str(folder)
    return mllm.train.train(job)


def test_training_on_the_pool_with_s3_resumes_after_its_worker_is_killed(stack_env: Stack, tmp_path: Path) -> None:
    proc = stack_env.cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus.txt",
        "--storage",
        f"s3://{BUCKET}/pool",
        "--train-on",
        "local",
        *[a for s in LONG for a in ("--set", s)],
        cwd=tmp_path,
    )
    try:
        _wait_for("checkpoint", lambda: _checkpoint(stack_env, "pool/runs/"), 240, proc)
        worker = next(s for s in stack.load(stack_env.home)["services"] if s.name == "worker")
        # The machine goes away: the worker and the training process it started, at once.
        for pid in [worker.pid, *stack.descendants(worker.pid)]:
            os.kill(pid, signal.SIGKILL)
        stack.start_worker(stack_env.home)
    except BaseException:
        proc.kill()
        raise
    out, err = _communicate(proc, 300, stack_env)
    assert proc.returncode == 0, err[-3000:]
    assert "crashed" in err and "resumes from its last checkpoint" in err

    # Data, checkpoints, samples and evaluation in the bucket.
    run = _checkpoint(stack_env, "pool/runs/").split("/checkpoints/")[0]
    keys = stack_env.keys("pool/")
    for name in ("checkpoints/best.pt", "trained.json", "samples/top-p.txt", "eval-val.md", "config.yaml"):
        assert f"{run}/{name}" in keys, name
    assert any(k.startswith("pool/raw/") for k in keys) and any(k.endswith(".parquet") for k in keys)
    trained = storage.read_json(f"s3://{BUCKET}/{run}/trained.json")
    assert trained["steps"] == 400 and trained["resumed_from_step"] >= 50
    # It ends exactly where an uninterrupted training of the same job ends.
    reference = _uninterrupted(trained, tmp_path / "uninterrupted")
    assert reference.resumed_from_step == 0
    assert (trained["train_loss"], trained["val_loss"]) == (reference.train_loss, reference.val_loss)

    # MLflow over HTTP: the workers logged the training metrics into the pipeline's run; the
    # server put the artifacts in the bucket.
    client = MlflowClient(stack_env.env["MLFLOW_TRACKING_URI"])
    run_id = next(line.split()[-1] for line in out.splitlines() if line.startswith("mlflow run:"))
    logged = client.get_run(run_id)
    # Its page in the model-training view (MLflow's own "View run" link opens the GenAI view),
    # and none of MLflow's lines about the registration around the run's own.
    ui = f"{stack_env.env['MLFLOW_TRACKING_URI']}/#/experiments/{logged.info.experiment_id}/runs/{run_id}"
    assert f"  in the UI: {ui}?workflowType=machine_learning" in out.splitlines()
    assert "View run" not in out and "Successfully registered" not in out + err and "Created version" not in out + err
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert max(steps) == 400
    # The steps between the last checkpoint and the kill were trained twice, logged once.
    assert len(steps) == len(set(steps))
    assert logged.data.tags["train.pool"] == "local" and "final_val_loss" in logged.data.metrics
    assert {"evaluation.md", "samples"} <= {a.path for a in client.list_artifacts(run_id)}
    assert any(k.endswith(f"{run_id}/artifacts/evaluation.md") for k in stack_env.keys("mlflow/"))

    # Prefect: the pipeline's flow run, and inside it the two training flow runs of the pool.
    with get_client(sync_client=True) as prefect:
        parent = prefect.read_flow_run(logged.data.tags["prefect.flow_run_id"])
        trains = [
            t
            for t in prefect.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])))
            if t.parent_task_run_id and prefect.read_task_run(t.parent_task_run_id).flow_run_id == parent.id
        ]
    assert parent.state.is_completed()
    assert sorted(t.state.type.value for t in trains) == ["COMPLETED", "CRASHED"]
    assert all(t.work_pool_name == "local" and t.deployment_id is not None for t in trains)


def test_storage_outage_retries_then_fails_clearly_and_a_rerun_reuses_what_finished(
    stack_env: Stack, tmp_path: Path
) -> None:
    args = (
        "run",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus2.txt",
        "--storage",
        f"s3://{BUCKET}/outage",
        *[a for s in LONG for a in ("--set", s)],
    )
    # botocore tries each request twice instead of five times (each storage call then gives up
    # in seconds, not tens of seconds); Prefect's retries of the stage come on top, a second after
    # each failure (MLLM_TRAIN_RETRY_DELAY_S; 5 s by default).
    proc = stack_env.cli(*args, cwd=tmp_path, AWS_MAX_ATTEMPTS="2", MLLM_TRAIN_RETRY_DELAY_S="1")
    try:
        _wait_for("checkpoint", lambda: _checkpoint(stack_env, "outage/runs/"), 240, proc)
        stack_env.s3.proxy.stop()  # the endpoint goes away in the middle of training
        out, err = proc.communicate(timeout=300)
    finally:
        stack_env.s3.proxy.start()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "Retry 1/2" in err and "Retry 2/2" in err  # Prefect retried the training task
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: storage unreachable") and stack_env.s3.url in last
    assert "Traceback" not in err

    again = stack_env.cli(*args, cwd=tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    for stage in ("tokenize", "build-vocabulary", "split"):
        assert any(stage in line and "Cached" in line for line in err.splitlines()), stage
    key = _checkpoint(stack_env, "outage/runs/").split("/checkpoints/")[0]
    trained = storage.read_json(f"s3://{BUCKET}/{key}/trained.json")
    assert trained["steps"] == 400 and trained["resumed_from_step"] >= 50


def test_stack_status_reports_each_service(stack_env: Stack, tmp_path: Path) -> None:
    out = prewarmed.run("flows.cli", ["stack", "status", "--home", str(stack_env.home)], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in ("prefect-server", "mlflow-server", "worker"):
        assert any(line.startswith(name) and " running " in line for line in lines), out.stdout
    assert f"PREFECT_API_URL={stack_env.env['PREFECT_API_URL']}" in out.stdout


def test_stack_down_stops_only_what_it_started(tmp_path: Path) -> None:
    """A recorded pid now running something else (the pid was reused) is left alone."""
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ours = stack.Service("worker", ["sleep", "61"], str(tmp_path / "logs" / "worker.log")).start()
    try:
        stack.save(
            tmp_path,
            [ours, stack.Service("mlflow-server", ["mlflow", "server"], str(tmp_path / "m.log"), pid=other.pid)],
            {},
            "local",
            "storage",
            {},
        )
        out = prewarmed.run("flows.cli", ["stack", "status", "--home", str(tmp_path)], timeout=60)
        assert out.returncode == 1 and "mlflow-server   NOT RUNNING" in out.stdout
        assert stack.down(tmp_path) == [("mlflow-server", False), ("worker", True)]
        assert ours._popen.poll() is not None and other.poll() is None
        assert not (tmp_path / "stack.json").exists()
    finally:
        other.kill()
        ours.stop()


def _flow_runs(stack_env: Stack) -> str:
    """Each flow run of the stack with its states, and the worker log's last lines: what a run that
    did not end was waiting for."""
    lines = []
    with get_client(sync_client=True) as prefect:
        for run in prefect.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_ASC):
            states = sorted(prefect.read_flow_run_states(run.id), key=lambda st: st.timestamp)
            told = " -> ".join(f"{st.name} {st.timestamp:%H:%M:%S}" for st in states)
            lines.append(f"{run.name} (worker {run.work_pool_name}): {told}; {(run.state.message or '')[:300]}")
    log = (stack_env.home / "logs" / "worker.log").read_text(errors="replace").splitlines()[-40:]
    return "\n".join([*lines, "--- worker.log", *log])


def _end_runs_in_flight() -> list[str]:
    """Cancel the stack's flow runs in flight (Pending, Running, Cancelling, or Scheduled and due):
    the worker stops their processes; what has not ended within 60 s is marked Cancelled. Their
    names, with the state each was in."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Cancelling

    live = FlowRunFilterStateType(
        any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
    )
    due = time.time() + 5
    with get_client(sync_client=True) as prefect:

        def in_flight() -> list:
            runs = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=live)))
            return [r for r in runs if r.state.type != StateType.SCHEDULED or r.expected_start_time.timestamp() < due]

        left = in_flight()
        for run in left:
            if run.state.type == StateType.RUNNING and run.infrastructure_pid:
                prefect.set_flow_run_state(run.id, Cancelling(message="left by a test"), force=True)
            else:
                prefect.set_flow_run_state(run.id, Cancelled(message="left by a test"), force=True)
        deadline = time.monotonic() + 60
        while (still := in_flight()) and time.monotonic() < deadline:
            time.sleep(1)
        for run in still:
            prefect.set_flow_run_state(run.id, Cancelled(message="left by a test"), force=True)
    return [f"{r.name} ({r.state.name})" for r in left]


def _time_wait(*ports: int) -> bool:
    """Whether a TCP connection on one of `ports` (IPv4 loopback) is in TIME_WAIT."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return any(r[3] == "06" and int(r[1].split(":")[1], 16) in ports for r in rows)


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        return json.loads(r.read())


# -- scheduled retraining -------------------------------------------------------------------


def _deployment_runs(deployment_id) -> list:
    with get_client(sync_client=True) as prefect:
        return prefect.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,
        )


def _decisions(client: MlflowClient) -> list[tuple[str, str]]:
    runs = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id], order_by=["attributes.start_time ASC"]
    )
    return [(r.data.tags.get("decision"), r.data.tags.get("decision.reason", "")) for r in runs]


def test_scheduled_runs_train_then_skip_and_a_ui_run_after_new_data_retrains(stack_env: Stack, tmp_path: Path) -> None:
    # A folder of books on S3 where new ones land: the schedule retrains on an added file only.
    source, root = f"s3://{BUCKET}/weekly/", f"s3://{BUCKET}/scheduled"
    for i in range(3):
        stack_env.s3.client().put_object(
            Bucket=BUCKET, Key=f"weekly/book{i}.txt", Body=make_text(3000, seed=11 + i).encode()
        )
    client = MlflowClient(stack_env.env["MLFLOW_TRACKING_URI"])
    fast = FAST + ["data.split.span_bytes=1024"]  # these books give 45 spans, 4 of them val; with the fourth 60 and 5

    def cli(*args: str) -> subprocess.CompletedProcess:
        return prewarmed.run("flows.cli", list(args), {**os.environ, **stack_env.env}, tmp_path, 120)

    # A model of its own (--model): the stack's "smoke" champion is of other tests' corpora, which
    # share no file with these books, so they would not be judged against it at all.
    out = cli(
        "schedule",
        "--recipe",
        "smoke",
        "--interval",
        "10",
        "--source",
        source,
        "--storage",
        root,
        "--model",
        "weekly-smoke",
        *[a for s in fast for a in ("--set", s)],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pipeline/smoke: every 10 s on pool 'local'")
    with get_client(sync_client=True) as prefect:
        deployment = prefect.read_deployment_by_name("pipeline/smoke")
    # Two runs from the schedule, executed by the worker one after the other. The worker takes a run
    # 10 s ahead of its time (PREFECT_WORKER_PREFETCH_SECONDS): the first at once, the second 10 s
    # later (it waits for the first's slot); paused then, the schedule drops the runs no worker took,
    # and the third, 10 s later still, costs no run of its own.
    _wait_for(
        "two scheduled runs taken by the worker",
        lambda: sum(r.state.name not in ("Scheduled", "Late") for r in _deployment_runs(deployment.id)) >= 2,
        300,
        stack_env=stack_env,
    )
    assert cli("schedule", "--recipe", "smoke", "--pause").returncode == 0
    assert "PAUSED" in cli("schedule", "list").stdout
    _wait_for(
        "the runs to end",
        lambda: all(r.state.is_final() for r in _deployment_runs(deployment.id)),
        300,
        stack_env=stack_env,
    )
    runs = _deployment_runs(deployment.id)
    assert len(runs) >= 2 and all(r.state.is_completed() for r in runs)
    # The first scheduled run trains and is its model's first champion; the next ones find a model
    # trained on the same data, config and code, and skip.
    decisions = _decisions(client)[-len(_deployment_runs(deployment.id)) :]
    assert decisions[0] == ("promoted", "no champion yet")
    assert {d for d, _ in decisions[1:]} == {"skipped"} and "unchanged since" in decisions[1][1]
    first = client.get_model_version_by_alias("weekly-smoke", "champion").version
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["decision-smoke"]))
        )
    assert any("**skipped**" in a.data for a in artifacts) and any(
        f"**{decisions[0][0]}**" in a.data for a in artifacts
    )

    # A new book in the folder; a run started the way the UI's form does: its parameters as JSON.
    stack_env.s3.client().put_object(Bucket=BUCKET, Key="weekly/book3.txt", Body=make_text(3000, seed=20).encode())
    schema = deployment.parameter_openapi_schema["properties"]
    assert "smoke" in schema["recipe"]["enum"] and schema["force"]["type"] == "boolean"
    form = {
        "recipe": "smoke",
        "source": source,
        "storage_url": root,
        "overrides": fast,
        "train_on": None,
        "force": False,
        "model": "weekly-smoke",
    }
    with get_client(sync_client=True) as prefect:
        run = prefect.create_flow_run_from_deployment(deployment.id, parameters=form)
    final = _wait_for(
        "the UI's run", lambda run=run: (r := _flow_run(run.id)).state.is_final() and r, 240, stack_env=stack_env
    )
    assert final.state.is_completed(), final.state.message
    decision, reason = _decisions(client)[-1]
    assert decision in ("promoted", "kept") and "both on this run's validation split" in reason
    champion = client.get_model_version_by_alias("weekly-smoke", "champion")
    assert (champion.version != first) == (decision == "promoted")
    last = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id], order_by=["attributes.start_time DESC"], max_results=1
    )[0]
    p = last.data.params
    assert (p["corpus.files"], p["corpus.new"], p["corpus.reused"], p["corpus.tokenized"]) == ("4", "1", "3", "1")
    # The worker ran the flow in a temporary folder; the commit is still that of the code it ran.
    repo = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    last = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id], order_by=["attributes.start_time DESC"], max_results=1
    )[0]
    assert last.data.tags["git.commit"] == head


def _flow_run(flow_run_id):
    with get_client(sync_client=True) as prefect:
        return prefect.read_flow_run(flow_run_id)


def test_prefect_yaml_deploys_every_recipe_with_a_form(stack_env: Stack, tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    # Prefect's own CLI, as a user runs it (forked from the interpreter that has imported it already).
    out = prewarmed.run(
        "prefect",
        ["--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"],
        {**os.environ, **stack_env.env, "PREFECT_HOME": str(tmp_path / "prefect")},
        repo,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    with get_client(sync_client=True) as prefect:
        for name in ("default", "smoke", "warandpeace-lstm", "warandpeace-gpt", "shakespeare-gpt", "cbow"):
            d = prefect.read_deployment_by_name(f"pipeline/{name}")
            assert d.parameters["recipe"] == name and d.entrypoint == "flows.pipeline:pipeline"
            assert [s.active for s in d.schedules] == [False]  # paused until resumed
            assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": "."}}]
            assert d.global_concurrency_limit.limit == 1
            assert set(d.parameter_openapi_schema["properties"]) >= {
                "recipe",
                "source",
                "overrides",
                "train_on",
                "force",
            }


def test_a_ui_run_with_bad_parameters_fails_naming_the_forms_fields(stack_env: Stack, tmp_path: Path) -> None:
    out = prewarmed.run(
        "flows.cli",
        ["schedule", "--recipe", "default", "--cron", "0 3 1 1 *", "--storage", f"s3://{BUCKET}/form"],
        env={**os.environ, **stack_env.env},
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    with get_client(sync_client=True) as prefect:
        deployment = prefect.read_deployment_by_name("pipeline/default")
        bad = {"overrides": {"overrides": ["train.nope=1"]}, "storage_url": {"storage_url": "s3://no-such-bucket-9/x"}}
        runs = {
            field: prefect.create_flow_run_from_deployment(deployment.id, parameters=params)
            for field, params in bad.items()
        }
    for field, run in runs.items():
        final = _wait_for(
            f"the form's run with a bad {field}",
            lambda run=run: (r := _flow_run(run.id)).state.is_final() and r,
            240,
            stack_env=stack_env,
        )
        message = final.state.message
        assert final.state.is_failed() and field in message and "--" not in message, message
    assert "no-such-bucket-9" not in {b["Name"] for b in stack_env.s3.client().list_buckets()["Buckets"]}


def test_a_search_on_the_pool_trains_its_trials_on_the_worker(stack_env: Stack, tmp_path: Path) -> None:
    # `mllm-pipeline search --train-on POOL`: trials trained side by side on the stack's pool, with an
    # object-store root (the study then lives in optuna.db in the current folder); the median pruner
    # stops a worker's training at an evaluation, asked through storage (tasks/trials.py).
    sets = [
        "train.max_steps=60",
        "train.eval_interval=30",
        "train.checkpoint_interval=30",
        "sample.max_new_tokens=10",
        "sample.methods=[greedy]",
    ]
    # This study's name seeds the random sampler: its trials draw lr 2.1e-3 and 1.1e-3 side by side,
    # then 2.2e-6, hopeless at step 30 against the first two (drawn again the same in every run).
    proc = stack_env.cli(
        "search",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus2.txt",
        "--storage",
        f"s3://{BUCKET}/search",
        "--train-on",
        "local",
        "--pruner",
        "median",
        "--startup-trials",
        "1",
        "--sampler",
        "random",
        "--study",
        "pool-prune-193",
        "--parallel",
        "2",
        "--trials",
        "3",
        "--space",
        "train.lr=log:1e-6..3e-3",
        *[a for s in sets for a in ("--set", s)],
        cwd=tmp_path,
    )
    out, err = _communicate(proc, 500, stack_env)
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "optuna.db").exists()
    parent_id = re.search(r"search mlflow run: (\w+)", out).group(1)
    client = MlflowClient(stack_env.env["MLFLOW_TRACKING_URI"])
    trials = client.search_runs(
        [client.get_run(parent_id).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'"
    )
    assert len(trials) == 3 and all(r.data.tags["train.pool"] == "local" for r in trials)
    state = {r.data.tags["search.trial"]: (r.data.tags["trial_state"], r.data.tags.get("trial.step")) for r in trials}
    failed = [line for line in err.splitlines() if line.startswith("failed:")]
    assert not failed and "failed" not in out, ([line for line in err.splitlines() if "fail" in line][-8:], out[-2000:])
    # (0 and 1 side by side are complete, unless one reached its step 30 after the other ended and lost)
    assert state["2"] == ("pruned", "30") and ("complete", "60") in (state["0"], state["1"]), state
    assert {state["0"], state["1"]} <= {("complete", "60"), ("pruned", "30")}, state
    pruned = next(r for r in trials if r.data.tags["search.trial"] == "2")
    assert float(pruned.data.params["train.lr"]) < 1e-5
    assert [m.step for m in client.get_metric_history(pruned.info.run_id, "val_loss")] == [30]
    # The worker's training asked at each evaluation and read the search's verdicts from storage.
    verdicts = [k for k in stack_env.keys("search/runs/") if "/search/verdict-" in k]
    assert len(verdicts) == 3 and sum(k.endswith("verdict-30.json") for k in verdicts) == 3, verdicts
    assert len({k.split("/")[2] for k in stack_env.keys("search/tokens/")}) == 1  # prepared once, shared


# -- last on the module's stack: it restarts a server, then stops and starts the whole stack ------


def test_stack_up_restarts_a_killed_mlflow_server_reusing_the_rest_and_down_then_up_at_once_works(
    stack_env: Stack, tmp_path: Path
) -> None:
    home = stack_env.home
    state = stack.load(home)
    ports = [
        int(state["env"][k].rstrip("/").removesuffix("/api").rsplit(":", 1)[1])
        for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")
    ]
    env = {**os.environ, **stack_env.env, "MLLM_STACK_HOME": str(home)}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return prewarmed.run("flows.cli", ["stack", *args], env=env, cwd=tmp_path, timeout=300)

    new = ("up", "--prefect-port", str(ports[0]), "--mlflow-port", str(ports[1]), "--storage", state["storage"])
    try:
        before = {s.name: s.pid for s in state["services"]}
        os.kill(before["mlflow-server"], signal.SIGKILL)  # its uvicorn, in the same group, lives on with the port

        status = cli("status")
        assert status.returncode == 1
        lines = status.stdout.splitlines()
        assert any(line.startswith("mlflow-server   NOT RUNNING") for line in lines), status.stdout
        assert any(line.startswith("prefect-server  running") for line in lines), status.stdout

        again = cli("up")
        assert again.returncode == 0, again.stderr[-3000:]
        assert "started again: mlflow-server; running already, reused: " in again.stderr
        after = {s.name: s.pid for s in stack.load(home)["services"]}
        assert after["prefect-server"] == before["prefect-server"] and after["worker"] == before["worker"]
        assert after["mlflow-server"] != before["mlflow-server"]
        tracking = f"http://127.0.0.1:{ports[1]}"  # the same URL as before
        assert tracking == state["env"]["MLFLOW_TRACKING_URI"].rstrip("/")
        assert MlflowClient(tracking).create_experiment("after-the-restart")
        assert cli("status").returncode == 0

        # A flow run in flight on the stack: `down` refuses, naming it; once it ended, `down` stops.
        api = f"http://127.0.0.1:{ports[0]}/api"
        flow = _post(f"{api}/flows/", {"name": "pipeline"})
        run = _post(f"{api}/flow_runs/", {"flow_id": flow["id"], "name": "busy-otter", "state": {"type": "RUNNING"}})
        refused = cli("down")
        assert refused.returncode == 2 and cli("status").returncode == 0
        assert refused.stderr.strip() == (
            "error: flow runs use the stack: pipeline/busy-otter (RUNNING); let them "
            "finish (or cancel them), or stop the stack under them with `mllm-pipeline "
            "stack down --force`"
        )
        _post(f"{api}/flow_runs/{run['id']}/set_state", {"state": {"type": "COMPLETED"}, "force": True})
        assert (down := cli("down")).returncode == 0, down.stderr

        # At once on the same ports: connections the servers closed are still in TIME_WAIT.
        assert _time_wait(*ports)
        assert (up := cli(*new)).returncode == 0, up.stderr[-3000:]
        assert MlflowClient(tracking).get_experiment_by_name("after-the-restart")
    finally:
        services = stack.load(home)["services"]
        cli("down", "--force")
    assert services and not any(s.alive() for s in services)
