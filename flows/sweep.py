"""`mllm-pipeline sweep`: the pipeline at every point of a grid of config fields.

Every point is resolved before anything runs, so a bad field or value stops the sweep with one
line. Each point is a normal pipeline run (forced: a sweep measures every point, even one the
champion already has), nested in MLflow under one parent run that holds the table and the plot
of each point's headline metric. In this process the points run one after another; with a work
pool their trainings run side by side on its workers, the data stages prepared first so that
no two points ever write the same stage at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import itertools
import json
import threading
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import allow_failure
from pydantic import BaseModel

import tasks
from flows import dispatch
from flows.stack import database, orphans
from flows.launch import check_model_name, preflight, storage_root, training_pool, with_results
from flows.pipeline import RecipeName, pipeline, prepare
from flows.sweep_table import (  # noqa: F401 (the table's functions are the sweep's API)
    PointOutcome, csv_text, direction, figure, headline_of, label, markdown_table, table_rows, text_table)
from flows.training import train
from mllm import UserError, failures, storage
from mllm.config import RunConfig
from mllm.redact import scrub
from mllm.resolve import resolve
from tasks import model as model_tasks
from tasks.tracking import outage
from tasks.caching import forget_exception
from tasks.tracking.provenance import code_git_info, run_tags
from tasks.tracking.tracker import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE,
    MAX_TAG_VALUE,
    RunTracker,
    deleted_run,
    log_records,
)
from tasks.tracking.tracker import client as tracking_client

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a run under its parent
POINT_TAG = "sweep.point"


# --- the grid ------------------------------------------------------------------------------

def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`--grid FIELD=v1,v2,...` options -> {field: [raw value, ...]}, in the order given. The
    values stay as written: each becomes a `--set FIELD=value`, which parses it as YAML."""
    if not items:
        raise UserError("give at least one --grid FIELD=v1,v2,... (e.g. --grid train.lr=1e-3,3e-3)")
    grid: dict[str, list[str]] = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field or any(not part for part in field.split(".")):
            raise UserError(f"malformed --grid {item!r}: write it as FIELD=v1,v2,... (e.g. train.lr=1e-3,3e-3)")
        if field in grid:
            raise UserError(f"--grid {field} is given twice: give each field once, with all its values")
        values = split_values(text)
        if not text.strip() or any(not v for v in values):
            raise UserError(f"--grid {item!r} has an empty value: give values separated by commas, "
                            f"e.g. {field}=1,2")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise UserError(f"--grid {field} lists {repeated[0]!r} twice: give each value once")
        grid[field] = values
    return grid


def split_values(text: str) -> list[str]:
    """Split on the commas outside brackets and quotes, so a value may be a YAML list
    (`sample.methods=[greedy],[top-p, greedy]`)."""
    values, depth, quote, current = [], 0, "", []
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(c)
    values.append("".join(current).strip())
    return values


def expand(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every point of the grid, the first field varying slowest."""
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def point_overrides(overrides: list[str], point: dict[str, str]) -> list[str]:
    return [*overrides, *(f"{field}={value}" for field, value in point.items())]


def resolve_points(recipe: str, grid: dict[str, list[str]], overrides: list[str] = (),
                   source: str | list[str] | None = None) -> list[RunConfig]:
    """The config of every point, or a UserError naming the first point that does not validate,
    a field that is in both --set and --grid, or two points that are the same config."""
    fixed = {item.partition("=")[0].strip() for item in overrides}
    for field in grid:
        if field in fixed:
            raise UserError(f"{field} is in both --set and --grid: give it in one of them")
    cfgs, seen = [], {}
    for point in expand(grid):
        try:
            cfg = resolve(recipe, overrides=point_overrides(list(overrides), point), source=source)
        except UserError as e:
            raise UserError(f"--grid point {label(point)}: {e}") from None
        same = seen.setdefault(cfg.to_yaml(paths=False), label(point))
        if same != label(point):
            raise UserError(f"--grid points {same} and {label(point)} are the same config: "
                            "give values that differ")
        cfgs.append(cfg)
    return cfgs


# --- one point -----------------------------------------------------------------------------


class SweepResult(BaseModel):
    recipe: str
    grid: dict[str, list[str]]
    mlflow_run_id: str  # the parent run
    outcomes: list[PointOutcome]
    outputs: str  # storage folder with the table and the plot
    artifact_uri: str  # the parent run's artifacts

    @property
    def failed(self) -> list[PointOutcome]:
        return [o for o in self.outcomes if not o.ok]


class PointsFailed(UserError):
    """Some points failed; the others ran, and the table and plot are recorded. A UserError so
    that the terminal shows its one line and not Prefect's traceback."""

    def __init__(self, result: SweepResult):
        self.result = result
        failed = "; ".join(f"{o.label} ({o.error})" for o in result.failed)
        super().__init__(f"{len(result.failed)} of {len(result.outcomes)} points failed: {failed}")


def passing(exc: BaseException | None) -> bool:
    """A server's passing failure (a 503 that outlasted the clients' own retries, a refused
    connection, a tracking server still away when its training ended, a database down), not the
    point's (or a search trial's) own error: what runs once more."""
    return failures.transient(exc) or any(isinstance(e, (outage.TrackingAway, DatabaseDown))
                                          for e in failures.exception_chain(exc))


def retry_delay_s() -> float:
    """Seconds before a point (or a search trial) that failed of a passing failure runs once more:
    MLLM_SWEEP_RETRY_DELAY_S, 10 by default."""
    return outage.seconds_setting("MLLM_SWEEP_RETRY_DELAY_S", "10", True,
                                  "give the seconds before a failed point runs again, 0 or more")


def passing_failure(task: object, task_run: object, state: object) -> bool:
    """Prefect's retry condition of a point (`passing`)."""
    return passing(getattr(state, "data", None))


class DatabaseDown(UserError):
    """A point failed as the servers' database was down: its one line (flows/stack/database.py),
    found when it failed, while the database is still down (the sweep reads its points' outcomes
    only once all ended, by when `stack up` may have started it again)."""


# No cache: a sweep measures every point each time; the pipeline's own stages are what is reused.
# A point that fails of a server's passing failure runs once more, on its own: its finished data
# stages are found cached and its training in storage, so only what had not finished runs again.
@task(name="sweep-point", cache_policy=NO_CACHE, persist_result=False, on_failure=[forget_exception],
      retries=1, retry_delay_seconds=10, retry_condition_fn=passing_failure)  # delay: MLLM_SWEEP_RETRY_DELAY_S
def run_point(recipe: str, source: str | list[str] | None, root: str, overrides: list[str], tags: dict[str, str],
              pool: str | None, model: str | None = None) -> PointOutcome:
    from prefect.runtime import task_run

    again = task_run.run_count > 1
    if again:
        outage.wait_for_servers()  # bounded: a server still away fails the point, as it would
    try:
        r = pipeline(recipe=recipe, source=source, storage_url=root, overrides=overrides, tags=tags,
                     train_on=pool, force=True, model=model)
    except Exception as e:
        if line := database.down_line(e):
            raise DatabaseDown(line) from None  # (not Prefect's traceback of the 503 its client retried)
        raise
    if again:
        supersede(root, tags, r.mlflow_run_id)
    e = r.evaluation
    return PointOutcome(point={}, ok=True, headline=e.headline, score=e.score,
                        higher_is_better=e.higher_is_better, val_loss=e.loss, decision=r.decision,
                        mlflow_run_id=r.mlflow_run_id)


def supersede(root: str, tags: dict[str, str], run_id: str, same: str = POINT_TAG,
              mark: str = "sweep.superseded_by") -> None:
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
            client.log_batch(target, metrics=missing[i:i + MAX_METRICS_PER_BATCH])


# --- the flow ------------------------------------------------------------------------------

# Threads, not processes: a point's thread mostly waits on its training, here or on a pool; in
# this process the points are run one at a time anyway.
@flow(name="sweep", persist_result=False, log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=32),
      on_failure=[forget_exception], on_crashed=[forget_exception])
def sweep(recipe: RecipeName = "default", grid: list[str] = [], source: str | list[str] | None = None,  # noqa: B006
          storage_url: str | None = None, overrides: list[str] = [],  # noqa: B006
          train_on: str | None = None, parallel: int | None = None, model: str | None = None) -> SweepResult:
    """Run the pipeline at every point of a grid of config fields and compare their headlines.

    Args:
        recipe: A shipped recipe (see `mllm-pipeline recipes`).
        grid: A field and its values each, as section.field=v1,v2,... (e.g. train.lr=1e-3,3e-3).
        source: The corpus to train on when not the recipe's own.
        storage_url: The storage root [$MLLM_STORAGE or ./storage].
        overrides: Config fields fixed for every point, as section.field=value.
        train_on: A work pool whose workers train the points side by side [this process, one at a time].
        parallel: At most this many points at once on the pool [as many as the pool's slots take].
        model: The registered model the points' models join [the recipe's name].
    """
    orphans.running_here(flow_run.get_id())  # for `stack up`, should the stack's database go down under it
    if model:
        check_model_name(model)
    fields = parse_grid(grid)
    points = expand(fields)
    cfgs = resolve_points(recipe, fields, overrides, source)
    root = storage_root(storage_url)
    preflight(root)
    pool = training_pool(recipe, train_on)
    keys: list[str | None] = [None] * len(points)
    if pool:
        dispatch.ensure_deployment(train, pool)
        # Prepared one by one before any point starts: points then find their data stages done.
        keys = [model_tasks.train_key(cfg, with_results(prepare, root)(cfg, root)) for cfg in cfgs]
    parent = ParentRun(cfgs[0], root, fields, overrides)
    with parent:
        futures = submit_points(recipe, source, root, overrides, points, keys, parent.run_id, pool, parallel, model)
        outcomes = [outcome(point, future) for point, future in zip(points, futures)]
        if down := next((o.error for o in outcomes if not o.ok and o.error.startswith(database.DOWN)), None):
            orphans.stop_reporting()  # its state cannot be written: no minutes of retries
            raise UserError(down)  # nothing can be recorded either: the points in flight end with this line
        outcomes = parent.with_run_ids(outcomes)
        parent.failed = [o.label for o in outcomes if not o.ok]
        outputs = record(parent, recipe, fields, outcomes)
    result = SweepResult(recipe=recipe, grid=fields, mlflow_run_id=parent.run_id, outcomes=outcomes,
                         outputs=outputs, artifact_uri=parent.artifact_uri)
    if result.failed:
        raise PointsFailed(result)  # the flow run fails, after every point ran and was recorded
    return result


def submit_points(recipe: str, source: str | list[str] | None, root: str, overrides: list[str], points: list[dict[str, str]],
                  keys: list[str | None], parent_id: str, pool: str | None,
                  parallel: int | None = None, model: str | None = None) -> list[PrefectFuture]:
    """Start every point: all at once on a pool (as many train as its slots take), or `parallel`
    at a time, else one after another. Points with the same training key (a sweep of a sample
    setting) wait for each other: they would train into the same folder."""
    futures: list[PrefectFuture] = []
    last_of_key: dict[str, PrefectFuture] = {}
    ended = PointsEnded(len(points))
    retry_delay = retry_delay_s()
    for point, key in zip(points, keys):
        running = [f.wrapped_future for f in futures if not f.wrapped_future.done()]
        if parallel and len(running) >= parallel:  # the next point starts when one ends
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        after = [allow_failure(last_of_key[key])] if key in last_of_key else []
        future = run_point.with_options(task_run_name=f"point {label(point)}"[:100],
                                        retry_delay_seconds=retry_delay).submit(
            recipe, source, root, point_overrides(overrides, point),
            {PARENT_TAG: parent_id, POINT_TAG: label(point)}, pool, model, wait_for=after)
        future.add_done_callback(functools.partial(ended, label(point)))
        if pool is None:
            future.wait()
        if key is not None:
            last_of_key[key] = future
        futures.append(future)
    return futures


class PointsEnded:
    """The terminal's bar of points (`tasks.report_progress("points", ...)`): how many ended and
    how many of those failed, as each ends."""

    def __init__(self, total: int):
        self.total, self.ended, self.failed = total, 0, 0
        self.lock = threading.Lock()
        tasks.report_progress("points", 0, total)

    def __call__(self, name: str, future: PrefectFuture) -> None:
        try:
            failed = not future.wrapped_future.result().is_completed()
        except BaseException:  # noqa: BLE001 (a point that crashed its thread ended too)
            failed = True
        with self.lock:
            self.ended += 1
            self.failed += failed
            tasks.report_progress("points", self.ended, self.total, failed=self.failed,
                                  last=f"{name} {'FAILED' if failed else 'done'}")


def outcome(point: dict[str, str], future: PrefectFuture) -> PointOutcome:
    try:
        return future.result().model_copy(update={"point": point})
    except Exception as e:  # a failed point is reported with the others, not raised
        message = scrub(str(e).splitlines()[0]) if str(e) else ""
        if not isinstance(e, UserError):
            message = database.down_line(e) or f"{type(e).__name__}: {message}"
        return PointOutcome(point=point, ok=False, error=message)


# --- tracking ------------------------------------------------------------------------------

class ParentRun:
    """The sweep's MLflow run, in the recipe's experiment; each point's run names it in its
    `mlflow.parentRunId` tag. It ends FAILED when a point failed."""

    def __init__(self, cfg: RunConfig, root: str, grid: dict[str, list[str]], overrides: list[str]):
        self.cfg, self.root, self.grid, self.overrides = cfg, root, grid, overrides
        self.client = tracking_client(root)
        self.run_id = self.artifact_uri = self.experiment_id = ""
        self.failed: list[str] = []

    def __enter__(self) -> "ParentRun":
        digest = storage.digest([self.cfg.recipe, self.grid, sorted(self.overrides)])[:8]
        tags = scrub({**run_tags(self.cfg, self.root, code_git_info()), "sweep.grid": json.dumps(self.grid),
                      "sweep.points": str(len(expand(self.grid)))})
        self.experiment_id = RunTracker(self.cfg, self.root)._experiment(self.cfg.recipe)
        run = self.client.create_run(self.experiment_id, run_name=f"sweep-{self.cfg.recipe}-{digest}",
                                     tags={k: v[:MAX_TAG_VALUE] for k, v in tags.items()})
        self.run_id, self.artifact_uri = run.info.run_id, run.info.artifact_uri
        params = {f"grid.{field}": ",".join(values) for field, values in self.grid.items()}
        if self.overrides:
            params["overrides"] = " ".join(self.overrides)
        for name, value in scrub(params).items():
            self.client.log_param(self.run_id, name, value[:MAX_PARAM_VALUE])
        return self

    def with_run_ids(self, outcomes: list[PointOutcome]) -> list[PointOutcome]:
        """A failed point's run id, where it got as far as its run: found by its tags."""
        if all(o.mlflow_run_id for o in outcomes):
            return outcomes
        runs = self.client.search_runs([self.experiment_id], f"tags.`{PARENT_TAG}` = '{self.run_id}'")
        ids = {r.data.tags.get(POINT_TAG): r.info.run_id for r in runs}
        return [o if o.mlflow_run_id else o.model_copy(update={"mlflow_run_id": ids.get(o.label)})
                for o in outcomes]

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


def record(parent: ParentRun, recipe: str, grid: dict[str, list[str]], outcomes: list[PointOutcome]) -> str:
    """The table (markdown, CSV, JSON) and the plot, in storage under `sweeps/<parent run>/`,
    as the parent run's artifacts, and the markdown as a Prefect artifact of this flow run."""
    folder = storage.join(parent.root, "sweeps", parent.run_id)
    md, rows = markdown_table(recipe, grid, outcomes, parent.run_id), table_rows(grid, outcomes)
    texts = {"sweep.md": md, "sweep.csv": csv_text(rows), "sweep.json": json.dumps(rows, indent=2) + "\n"}
    for name, text in texts.items():
        storage.write_text(storage.join(folder, name), text)
        parent.client.log_text(parent.run_id, text, name)
    fig = figure(recipe, grid, outcomes)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    storage.write_bytes(storage.join(folder, "sweep.png"), png.getvalue())
    parent.client.log_figure(parent.run_id, fig, "sweep.png")
    slug = "".join(c if c.isalnum() else "-" for c in recipe.lower())
    create_markdown_artifact(md, key=f"sweep-{slug}", description=f"{recipe}: sweep of {', '.join(grid)}")
    return folder
