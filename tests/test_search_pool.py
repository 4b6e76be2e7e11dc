"""`mllm-pipeline search --train-on POOL`: trials trained side by side on the local stack's pool,
with an object-store root (the study then lives in optuna.db in the current folder)."""

from __future__ import annotations

import re
from pathlib import Path

from mlflow.tracking import MlflowClient

from flows.search import check_options
from mllm import UserError
from test_stack import BUCKET, Stack, _stack_mlflow, s3, stack_env  # noqa: F401 (the stack's fixtures)


def test_a_pool_takes_no_pruner_yet() -> None:
    import pytest

    with pytest.raises(UserError, match="--pruner median with a work pool"):
        check_options(4, "tpe", "median", None, "local", 5)


def test_a_search_on_the_pool_trains_its_trials_on_the_worker(stack_env: Stack, tmp_path: Path) -> None:
    sets = ["train.max_steps=60", "train.eval_interval=30", "train.checkpoint_interval=30",
            "sample.max_new_tokens=10", "sample.methods=[greedy]"]
    proc = stack_env.cli("search", "--recipe", "smoke", "--source", f"s3://{BUCKET}/corpus2.txt",
                         "--storage", f"s3://{BUCKET}/search", "--train-on", "local", "--pruner", "none",
                         "--parallel", "2", "--trials", "2", "--space", "train.lr=1e-3..3e-3",
                         *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "optuna.db").exists()
    parent_id = re.search(r"search mlflow run: (\w+)", out).group(1)
    client = MlflowClient(stack_env.env["MLFLOW_TRACKING_URI"])
    trials = client.search_runs([client.get_run(parent_id).info.experiment_id],
                                f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert len(trials) == 2
    assert all(r.data.tags["train.pool"] == "local" and r.data.tags["trial_state"] == "complete" for r in trials)
    assert {r.data.tags["search.trial"] for r in trials} == {"0", "1"}
    assert len({k.split("/")[2] for k in stack_env.keys("search/tokens/")}) == 1  # prepared once, shared
