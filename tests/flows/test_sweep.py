"""`mllm-pipeline sweep`: the grid, bad input, and a real sweep of the smoke recipe with its
parent and nested MLflow runs, table, plot and shared data stages."""

from __future__ import annotations

import csv
import functools
import json
import os
import subprocess
from pathlib import Path

import prewarmed
import pytest

from flows.sweep.points import expand, parse_grid, resolve_points, split_values
from mllm import UserError
from mllm.resolve import Overrides

pytestmark = pytest.mark.integration

FAST = [
    "train.max_steps=6",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=10",
    "sample.methods=[greedy]",
]


def cli(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return prewarmed.run("flows.cli", list(args), dict(os.environ, COLUMNS="200", **(env or {})), timeout=timeout)


def _sets(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def test_grid_values_are_split_outside_brackets_and_expanded_first_field_slowest() -> None:
    grid = parse_grid(["train.lr=1e-3, 3e-3", "sample.methods=[greedy],[top-p, greedy]", "model.n_layer=1"])
    assert grid == {
        "train.lr": ["1e-3", "3e-3"],
        "sample.methods": ["[greedy]", "[top-p, greedy]"],
        "model.n_layer": ["1"],
    }
    assert [list(p.values()) for p in expand(grid)] == [
        ["1e-3", "[greedy]", "1"],
        ["1e-3", "[top-p, greedy]", "1"],
        ["3e-3", "[greedy]", "1"],
        ["3e-3", "[top-p, greedy]", "1"],
    ]
    assert split_values("'a,b',c") == ["'a,b'", "c"]
    # Each value is a --set of its own, parsed as YAML into the point's config.
    cfgs = resolve_points("smoke", grid)
    assert [(c.train.lr, c.sample.methods, c.model.n_layer) for c in cfgs][1] == (1e-3, ["top-p", "greedy"], 1)


@pytest.mark.parametrize(
    "items, needle",
    [
        ([], "give at least one --grid"),
        (["train.lr"], "malformed --grid"),
        (["train.lr=1e-3", "train.lr=3e-3"], "given twice"),
        (["train.lr="], "empty value"),
        (["train.lr=1e-3,,3e-3"], "empty value"),
        (["train.lr=1e-3,1e-3"], "twice"),
    ],
)
def test_malformed_grids_are_refused(items: list[str], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        parse_grid(items)


@pytest.mark.parametrize(
    "grid, sets, needle",
    [
        (["train.bogus=1,2"], [], "train.bogus: unknown field"),
        (["train.lr=1e-3,fast"], [], "point train.lr=fast: recipe smoke with --set: train.lr"),
        (["model.block_size=8,16"], [], "model.block_size: a field of the gpt family"),
        (["train.lr=1e-3,0.001"], [], "same config"),
        (["train.lr=1e-3,3e-3"], ["train.lr=1e-2"], "in both --set and --grid"),
    ],
)
def test_points_that_do_not_resolve_are_refused(grid: list[str], sets: list[str], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        resolve_points("smoke", parse_grid(grid), Overrides.parse(sets))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--grid", "train.lr=1e-3,3e-3", "--grid", "train.nonsense=1"], "train.nonsense: unknown field"),
        ([], "give at least one --grid"),
        (["--grid", "train.lr=1e-3", "--model", "two words"], "--model 'two words' is not a model name"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(
    args: list[str], needle: str, corpus: Path, tmp_path: Path, empty_mlflow_store: bytes
) -> None:
    root = tmp_path / "storage"
    out = cli("sweep", "--recipe", "smoke", "--source", str(corpus), "--storage", str(root), *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and needle in errors[0], out.stderr
    assert not root.exists()
    assert (tmp_path / "mlflow-store" / "mlflow.db").read_bytes() == empty_mlflow_store  # no MLflow run either


def test_sweep_of_smoke_nests_every_point_under_one_parent_and_shares_data(corpus: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.sweep.flow import sweep

    root = tmp_path / "storage"
    result = sweep(
        recipe="smoke",
        grid=["train.lr=1e-3,1e-2", "data.split.val_fraction=0.1,0.2"],
        source=str(corpus),
        storage_url=str(root),
        overrides=FAST,
    )
    assert [o.label for o in result.outcomes] == [
        "train.lr=1e-3 data.split.val_fraction=0.1",
        "train.lr=1e-3 data.split.val_fraction=0.2",
        "train.lr=1e-2 data.split.val_fraction=0.1",
        "train.lr=1e-2 data.split.val_fraction=0.2",
    ]
    assert all(o.ok and o.headline == "val_bits_per_byte" and o.higher_is_better is False for o in result.outcomes)

    # The data stages ran once per distinct data config: one text, two splits; four trainings.
    for stage, n in (("raw", 2), ("tokens", 1), ("vocab", 1), ("splits", 2), ("runs", 4)):
        assert len(list((root / stage).iterdir())) == n, stage

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # this test's store, whatever ran before
    parent = client.get_run(result.mlflow_run_id)
    assert parent.info.run_name.startswith("sweep-smoke-") and parent.info.status == "FINISHED"
    assert parent.data.params["grid.train.lr"] == "1e-3,1e-2"
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{result.mlflow_run_id}'")
    assert {r.info.run_id for r in children} == {o.mlflow_run_id for o in result.outcomes}
    assert len(children) == 4
    for o in result.outcomes:
        run = client.get_run(o.mlflow_run_id)
        assert run.data.metrics["final_val_bits_per_byte"] == pytest.approx(o.score)
        assert run.data.metrics["final_val_loss"] == pytest.approx(o.val_loss)
        assert run.data.tags["sweep.point"] == o.label
        assert run.data.params["train.lr"] == str(float(o.point["train.lr"]))

    assert sorted(a.path for a in client.list_artifacts(result.mlflow_run_id)) == [
        "sweep.csv",
        "sweep.json",
        "sweep.md",
        "sweep.png",
    ]
    rows = list(csv.DictReader((Path(result.outputs) / "sweep.csv").read_text().splitlines()))
    assert [(r["train.lr"], r["data.split.val_fraction"], r["mlflow_run_id"]) for r in rows] == [
        (o.point["train.lr"], o.point["data.split.val_fraction"], o.mlflow_run_id) for o in result.outcomes
    ]
    assert [float(r["score"]) for r in rows] == [o.score for o in result.outcomes]
    assert json.loads((Path(result.outputs) / "sweep.json").read_text())[0]["status"] == "ok"
    assert (Path(result.outputs) / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (Path(result.outputs) / "sweep.md").read_text()
    assert "bits_per_byte (lower is better)" in md and all(o.mlflow_run_id in md for o in result.outcomes)

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-smoke"])))
    # The key is the recipe's, so the session's server may hold another test's sweep of smoke beside it.
    assert md in [a.data for a in artifacts]


def test_a_failing_point_is_marked_and_the_sweep_exits_1_after_the_others(corpus: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    # A window longer than the validation split resolves, then fails in training. As at a terminal
    # (MLLM_PROGRESS): the bar of points, a line for the failed point, the table; none of Prefect's
    # lines, nor those of the temporary server it starts (no PREFECT_API_URL, as for a new user).
    out = cli(
        "sweep",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        str(tmp_path / "storage"),
        "--grid",
        "train.window=5000,16",
        *_sets(FAST),
        "--model",
        "sweep-of-windows",
        env={"MLLM_PROGRESS": "1", "PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path / "prefect")},
    )
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stdout + out.stderr
    assert not [
        line
        for line in out.stderr.splitlines()
        if " | INFO " in line or " | ERROR " in line or "docs.prefect.io" in line
    ], out.stderr
    assert "points" in out.stderr and "2/2 ended, 1 failed" in out.stderr, out.stderr
    failures = [line for line in out.stderr.splitlines() if line.startswith("failed:")]
    assert len(failures) == 1 and failures[0].startswith("failed: train.window=5000: the validation split has"), (
        out.stderr
    )
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["point", "val_bits_per_byte", "val", "loss", "mlflow", "run"]
    failed, done = lines[1].split(), lines[2].split()
    assert failed[:3] == ["train.window=5000", "FAILED", "-"] and done[0] == "train.window=16"
    parent_id = lines[3].removeprefix("sweep mlflow run: ")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "1 of 2 points failed: train.window=5000 (the validation split has" in errors[0]

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # this test's store, whatever ran before
    parent = client.get_run(parent_id)
    assert parent.info.status == "FAILED" and parent.data.tags["sweep.failed"] == "train.window=5000"
    assert client.get_run(failed[3]).info.status == "FAILED"  # the failed point's own run, found by its tags
    assert client.get_run(done[3]).data.tags["mlflow.parentRunId"] == parent_id
    # The point that trained registered under the model named (--model), not the recipe's.
    assert [v.run_id for v in client.search_model_versions("name = 'sweep-of-windows'")] == [done[3]]


def test_plot_and_table_name_the_fields_and_the_headline_and_mark_a_failed_point() -> None:
    from flows.sweep.table import PointOutcome, figure, markdown_table, text_table

    grid = {"model.arch": ["rnn", "lstm"], "data.window": ["4", "8"]}
    ok = dict(ok=True, headline="accuracy", higher_is_better=True, val_loss=0.5)
    outcomes = [
        PointOutcome(point=p, score=0.9 - i / 10, mlflow_run_id=f"run{i}", **ok) for i, p in enumerate(expand(grid)[:3])
    ]
    outcomes.append(PointOutcome(point=expand(grid)[3], ok=False, error="out of memory"))
    ax = figure("r", grid, outcomes).axes[0]
    # Names against numbers: the numbers go along the axis and the names are the lines (the seed's figure).
    assert ax.get_xlabel() == "data.window" and ax.get_ylabel() == "accuracy (higher is better)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8"]
    assert [line.get_label() for line in ax.get_lines()] == ["rnn", "lstm"]
    assert ax.get_legend().get_title().get_text() == "model.arch"
    names = {"model.arch": ["rnn", "lstm"], "model.cell": ["gru", "lstm"]}
    ax = figure("r", names, [PointOutcome(point=p, score=0.5, mlflow_run_id="r", **ok) for p in expand(names)]).axes[0]
    assert ax.get_xlabel() == "model.arch" and [t.get_text() for t in ax.get_xticklabels()] == ["rnn", "lstm"]
    md = markdown_table("r", grid, outcomes, "parent")
    assert "| model.arch | data.window | accuracy | val loss | MLflow run |" in md
    assert "| lstm | 8 | **failed**: out of memory | - | - |" in md
    lines = text_table(outcomes).splitlines()
    assert lines[0].split() == ["point", "accuracy", "val", "loss", "mlflow", "run"]
    assert lines[1].split() == ["model.arch=rnn", "data.window=4", "0.9000", "0.5000", "run0"]
    assert lines[4].split() == ["model.arch=lstm", "data.window=8", "FAILED", "-", "-"]


def test_a_point_is_run_once_more_after_a_passing_failure_and_never_after_its_own() -> None:
    # A tracking server still away when a point's training ended (killed, restarted by `stack up`,
    # back a minute later) is a passing failure: the point runs again once the server answers
    # (its training found in storage). A point's own error is not run again.
    from prefect import flow, task

    from flows.sweep.flow import passing_failure
    from flows.sweep.parent import DatabaseDown
    from tasks.tracking.outage import TrackingAway

    attempts: list[str] = []

    @task(retries=1, retry_delay_seconds=0, retry_condition_fn=passing_failure, persist_result=False)
    def point(name: str, error: Exception) -> str:
        attempts.append(name)
        if attempts.count(name) == 1:
            raise error
        return name

    @flow(persist_result=False)
    def points() -> list[str]:
        away = point.submit("away", TrackingAway("the MLflow tracking server http://127.0.0.1:1 stopped answering"))
        own = point.submit("own", UserError("train.lr: must be positive"))
        # The servers' database down past the clients' retries: run again once it is back.
        db = point.submit("db", DatabaseDown("the database of the Prefect and MLflow servers is down (...)"))
        return [away.result(), own.result(raise_on_failure=False).__class__.__name__, db.result()]

    assert points() == ["away", "UserError", "db"]
    assert sorted(attempts) == ["away", "away", "db", "db", "own"]


def test_the_stacks_prefect_server_answers_503_only_for_a_database_it_cannot_reach() -> None:
    # What asyncpg raises under SQLAlchemy when nothing listens on the database's port (seen in the
    # server's log with PostgreSQL stopped); Prefect's own answer to it is a 500 no client retries.
    import sqlalchemy.exc

    from flows.stack.prefect_server import retryable

    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
    assert retryable(refused)
    try:
        try:
            raise refused
        except OSError as e:
            raise RuntimeError("while checking out a connection") from e
    except RuntimeError as wrapped:
        assert retryable(wrapped)
    assert retryable(sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection")))
    assert not retryable(ValueError("a bug in a route")) and not retryable(KeyError("flow_run_id"))
    assert not retryable(FileNotFoundError("ui/index.html"))


def test_the_run_that_stands_for_a_retried_point_gets_the_steps_its_failed_attempt_logged(
    tmp_path: Path, monkeypatch
) -> None:
    # The retry reuses or resumes the failed attempt's training, which logged the curve (sent late
    # when the tracking server came back): the attempt goes to the trash, its curve stays.
    from mlflow.entities import Metric
    from mlflow.entities.lifecycle_stage import LifecycleStage
    from mlflow.tracking import MlflowClient

    from flows.sweep.parent import PARENT_TAG, POINT_TAG, supersede
    from tasks.tracking import outage
    from tasks.tracking.tracker import deleted_run, log_records

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient()
    experiment = client.create_experiment("retried")
    parent = client.create_run(experiment).info.run_id
    tags = {PARENT_TAG: parent, POINT_TAG: "train.lr=0.003"}
    failed, retry = (client.create_run(experiment, tags=tags).info.run_id for _ in range(2))
    client.log_batch(
        failed,
        metrics=[Metric("train_loss", 3.0 - s / 100, 0, s) for s in range(10, 60, 10)]
        + [Metric("system/cpu_utilization_percentage", 50.0, 0, 0)],
    )
    client.log_batch(retry, metrics=[Metric("train_loss", 2.5, 0, 50), Metric("val_loss", 2.6, 0, 50)])
    client.set_terminated(failed, "FAILED")
    root = str(tmp_path / "storage")
    # Steps 60 and 70 the attempt could not send (kept in storage) and the retry's start did not
    # either: sent into the attempt, so into the standing run's curve, before the attempt goes.
    outage.keep_unsent(root, failed, [{"step": 60, "train_loss": 2.4}, {"step": 70, "train_loss": 2.3}])
    supersede(root, tags, retry)
    assert sorted(m.step for m in client.get_metric_history(retry, "train_loss")) == [10, 20, 30, 40, 50, 60, 70]
    assert "system/cpu_utilization_percentage" not in client.get_run(retry).data.metrics
    gone = client.get_run(failed)
    assert gone.info.lifecycle_stage == LifecycleStage.DELETED and gone.data.tags["sweep.superseded_by"] == retry
    assert not list((tmp_path / "storage" / "tracking" / "unsent").glob("*.json"))

    # What is kept for a run deleted since (here the attempt; as well by the MLflow UI or `mlflow
    # gc`) is dropped by the next run's send, and no longer holds back the files after it.
    outage.keep_unsent(root, failed, [{"step": 80, "train_loss": 2.2}])
    outage.note_unfinished(root, failed, "FAILED", "away")
    outage.keep_unsent(root, retry, [{"step": 90, "train_loss": 2.1}])
    outage.settle_unfinished(
        client, root, functools.partial(log_records, client), functools.partial(deleted_run, client)
    )
    assert max(m.step for m in client.get_metric_history(retry, "train_loss")) == 90
    assert not list((tmp_path / "storage" / "tracking").glob("*/*.json"))
