"""Checkpoints as MLflow 3 LoggedModels, read back from a real MLflow server over HTTP."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from servers import run_mlflow_server

from flows.pipeline import pipeline

pytestmark = pytest.mark.integration

# An lr too small to move a float32 weight: every validation scores the same, so the best
# checkpoint stays the first validation's (step 6) and the last one (step 12) is another.
STILL = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "train.lr=1e-12",
    "train.min_lr=0",
    "sample.max_new_tokens=10",
]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An MLflow server of this module's own: on the session's, the `smoke` experiment may be
    another test's, its artifact root that test's S3 bucket."""
    with run_mlflow_server(tmp_path_factory.mktemp("logged-models")) as server:
        yield server


def test_best_and_last_checkpoints_are_logged_models_with_their_steps_and_metrics(
    mlflow_server, corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    # A file:// URL, as a user gives one: the download stage hands it back unchanged, the same
    # string object as the config's (a path is turned into a new URL string).
    r = pipeline(recipe="smoke", source=corpus.as_uri(), storage_url=str(tmp_path / "storage"), overrides=STILL)
    client = MlflowClient(mlflow_server.url)
    run = client.get_run(r.mlflow_run_id)
    mlflow.set_tracking_uri(mlflow_server.url)
    found = mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        output_format="list",
        filter_string=f"source_run_id = '{r.mlflow_run_id}'",
    )
    by_kind = {m.tags["checkpoint.kind"]: m for m in found}
    assert set(by_kind) == {"best", "last"}, [m.tags for m in found]
    best, last = by_kind["best"], by_kind["last"]
    assert best.tags["checkpoint"].endswith("best.pt") and last.tags["checkpoint"].endswith("last.pt")
    assert Path(best.tags["checkpoint"]).is_file() and Path(last.tags["checkpoint"]).is_file()

    steps = {kind: {m.step for m in model.metrics} for kind, model in by_kind.items()}
    assert steps == {"best": {6}, "last": {12}}
    best_metrics = {m.key: m.value for m in best.metrics}
    last_metrics = {m.key: m.value for m in last.metrics}
    assert best_metrics["final_val_loss"] == pytest.approx(r.evaluation.loss)
    assert best_metrics[f"final_{r.evaluation.headline}"] == pytest.approx(r.evaluation.score)
    assert last_metrics["val_loss"] == pytest.approx(r.trained.val_loss)
    # The registered version is the best one's, and the run names both.
    version = client.get_model_version("smoke", r.champion.version)
    assert version.source == f"models:/{best.model_id}"
    assert run.data.tags["model_id"] == best.model_id and run.data.tags["model_id.last"] == last.model_id

    # System metrics beside the training curve (one sample at least: this training is short).
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)

    # What Prefect's UI reads of this run: a name after the recipe, and task runs whose inputs are
    # all of the kinds its Task Runs tab can show (a "flow_run" input made it list none).
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterSubFlowRuns

    flow_run_id = run.data.tags["prefect.flow_run_id"]
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(flow_run_id)
        # As the tab asks: the flow run's own task runs, not the stand-ins of its subflows.
        task_runs = prefect.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(subflow_runs=TaskRunFilterSubFlowRuns(exists_=False)),
        )
    assert flow_run.name.startswith("smoke-"), flow_run.name
    assert {t.task_key.split("-")[0] for t in task_runs} >= {"log_data", "log_outcome"}, [t.task_key for t in task_runs]
    kinds = {i.input_type for t in task_runs for inputs in t.task_inputs.values() for i in inputs}
    assert kinds <= {"task_run", "parameter", "constant"}, kinds

    # Ranked as MLflow ranks them: by the final validation loss, best first (this run's: the
    # session's server holds other tests' runs of the same recipe).
    ranked = mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        output_format="list",
        filter_string=f"source_run_id = '{r.mlflow_run_id}'",
        order_by=[{"field_name": "metrics.final_val_loss", "ascending": True}],
    )
    assert ranked[0].model_id == best.model_id
