"""What a sweep and a search share: the parent MLflow run that nests their runs, and the one more
try of a point or trial that failed of a server's passing failure (its failed attempt's curve
copied into the run that stands for it)."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from flows.settings import settings
from flows.sweep.points import expand
from flows.sweep.table import PointOutcome
from mllm import UserError, failures, storage
from mllm.config import RunConfig
from mllm.redact import scrub
from mllm.resolve import Overrides
from tasks.tracking import outage
from tasks.tracking.provenance import code_git_info, run_tags
from tasks.tracking.store import client as tracking_client
from tasks.tracking.tracker import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE,
    MAX_TAG_VALUE,
    RunTracker,
    deleted_run,
    log_records,
)

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a run under its parent
POINT_TAG = "sweep.point"


def passing(exc: BaseException | None) -> bool:
    """A server's passing failure (a 503 that outlasted the clients' own retries, a refused
    connection, a tracking server still away when its training ended, a database down), not the
    point's (or a search trial's) own error: what runs once more."""
    return failures.transient(exc) or any(
        isinstance(e, (outage.TrackingAway, DatabaseDown)) for e in failures.exception_chain(exc)
    )


def retry_delay_s() -> float:
    """Seconds before a point (or a search trial) that failed of a passing failure runs once more:
    MLLM_SWEEP_RETRY_DELAY_S, 10 by default."""
    return settings().sweep_retry_delay_s


class DatabaseDown(UserError):
    """A point failed as the servers' database was down: its one line (flows/stack/database.py),
    found when it failed, while the database is still down (the sweep reads its points' outcomes
    only once all ended, by when `stack up` may have started it again)."""


def supersede(
    root: str, tags: dict[str, str], run_id: str, same: str = POINT_TAG, mark: str = "sweep.superseded_by"
) -> None:
    """The MLflow runs of a point's failed attempt (those with its `same` tag: a search trial's
    too), once its retry finished as `run_id`: tagged `mark` (`sweep.superseded_by`), and moved to
    MLflow's trash unless they finished (the parent then nests one run for the point, and no
    FAILED run stands for a point that finished). The steps
    they logged that `run_id` does not hold are copied into it first: a retry resumes or reuses
    their training, so the run that stands for the point has the whole curve."""
    client = tracking_client(root)
    # Metrics an attempt kept in storage while the server was away (the retry's start sends them;
    # a failed send leaves them there) go into it before its curve is copied and it is deleted.
    with contextlib.suppress(Exception):
        outage.send_unsent(root, functools.partial(log_records, client), functools.partial(deleted_run, client))
    experiment = client.get_run(run_id).info.experiment_id
    for run in client.search_runs([experiment], f"tags.`{PARENT_TAG}` = '{tags[PARENT_TAG]}'"):
        if run.info.run_id == run_id or run.data.tags.get(same) != tags[same]:
            continue
        copy_history(client, run.info.run_id, run_id)
        client.set_tag(run.info.run_id, mark, run_id)
        if run.info.status != "FINISHED":
            client.delete_run(run.info.run_id)
            outage.forget_run(root, run.info.run_id)  # its kept metrics could never be sent now


def copy_history(client: Any, source: str, target: str) -> None:
    """The training metrics `source` logged at steps `target` has none of, logged into `target`
    (the machine's system metrics stay with the attempt they measured)."""
    held = client.get_run(target).data.metrics
    for key in client.get_run(source).data.metrics:
        if key.startswith("system/"):
            continue
        have = {m.step for m in client.get_metric_history(target, key)} if key in held else set()
        missing = [m for m in client.get_metric_history(source, key) if m.step not in have]
        for i in range(0, len(missing), MAX_METRICS_PER_BATCH):
            client.log_batch(target, metrics=missing[i : i + MAX_METRICS_PER_BATCH])


class ParentRun:
    """The sweep's MLflow run, in the recipe's experiment; each point's run names it in its
    `mlflow.parentRunId` tag. It ends FAILED when a point failed."""

    def __init__(self, cfg: RunConfig, root: str, grid: dict[str, list[str]], overrides: Overrides):
        self.cfg, self.root, self.grid, self.overrides = cfg, root, grid, overrides
        self.client = tracking_client(root)
        self.run_id = self.artifact_uri = self.experiment_id = ""
        self.failed: list[str] = []

    def __enter__(self) -> "ParentRun":
        digest = storage.digest([self.cfg.recipe, self.grid, sorted(self.overrides.items())])[:8]
        tags = scrub(
            {
                **run_tags(self.cfg, self.root, code_git_info()),
                "sweep.grid": json.dumps(self.grid),
                "sweep.points": str(len(expand(self.grid))),
            }
        )
        self.experiment_id = RunTracker(self.cfg, self.root)._experiment(self.cfg.recipe)
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"sweep-{self.cfg.recipe}-{digest}",
            tags={k: v[:MAX_TAG_VALUE] for k, v in tags.items()},
        )
        self.run_id, self.artifact_uri = run.info.run_id, run.info.artifact_uri
        params = {f"grid.{field}": ",".join(values) for field, values in self.grid.items()}
        if self.overrides:
            params["overrides"] = " ".join(self.overrides.items())
        for name, value in scrub(params).items():
            self.client.log_param(self.run_id, name, value[:MAX_PARAM_VALUE])
        return self

    def with_run_ids(self, outcomes: list[PointOutcome]) -> list[PointOutcome]:
        """A failed point's run id, where it got as far as its run: found by its tags."""
        if all(o.mlflow_run_id for o in outcomes):
            return outcomes
        runs = self.client.search_runs([self.experiment_id], f"tags.`{PARENT_TAG}` = '{self.run_id}'")
        ids = {r.data.tags.get(POINT_TAG): r.info.run_id for r in runs}
        return [o if o.mlflow_run_id else o.model_copy(update={"mlflow_run_id": ids.get(o.label)}) for o in outcomes]

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "KILLED" if exc_type is KeyboardInterrupt else "FAILED" if exc_type or self.failed else "FINISHED"
        if exc_type is not None:
            # Without MLflow's minutes of retries (a server whose database is down answers 500 to
            # each): a run that cannot be closed now is closed by the next run on this root.
            try:
                with outage.fail_fast():
                    self.client.set_terminated(self.run_id, status)
            except Exception:  # noqa: BLE001 (the sweep's own error is the one to raise)
                outage.note_unfinished(self.root, self.run_id, status, f"{exc_type.__name__}: {exc}"[:MAX_TAG_VALUE])
            return
        if self.failed:
            self.client.set_tag(self.run_id, "sweep.failed", ", ".join(self.failed)[:MAX_TAG_VALUE])
        self.client.set_terminated(self.run_id, status)
