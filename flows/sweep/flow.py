"""`mllm-pipeline sweep`: the pipeline at every point of a grid of config fields, nested under one
MLflow parent run (docs/sweeps.md)."""

from __future__ import annotations

import concurrent.futures
import functools
import io
import json
import threading

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
from flows.launch import check_model_name, preflight, storage_root, training_pool, with_results
from flows.pipeline import RecipeName, pipeline, prepare
from flows.stack import database, orphans
from flows.sweep.parent import PARENT_TAG, POINT_TAG, DatabaseDown, ParentRun, passing, retry_delay_s, supersede
from flows.sweep.points import NO_GRID, Grid, expand, resolve_points
from flows.sweep.table import PointOutcome, csv_text, figure, label, markdown_table, table_rows
from flows.training import train
from mllm import UserError, storage
from mllm.redact import scrub
from mllm.resolve import NO_OVERRIDES, Overrides
from tasks.caching import forget_exception
from tasks.model.train import train_key
from tasks.tracking import servers as tracking_servers

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
        super().__init__(
            f"{len(result.failed)} of {len(result.outcomes)} points failed: {failed}; their logs: "
            "the sweep's flow run in Prefect, each point's pipeline flow run under it"
        )


def passing_failure(task: object, task_run: object, state: object) -> bool:
    """Prefect's retry condition of a point (`passing`)."""
    return passing(getattr(state, "data", None))


# No cache: a sweep measures every point each time; the pipeline's own stages are what is reused.
# A point that fails of a server's passing failure runs once more, on its own: its finished data
# stages are found cached and its training in storage, so only what had not finished runs again.
@task(
    name="sweep-point",
    cache_policy=NO_CACHE,
    persist_result=False,
    on_failure=[forget_exception],
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=passing_failure,
)  # delay: MLLM_SWEEP_RETRY_DELAY_S
def run_point(
    recipe: str,
    source: str | list[str] | None,
    root: str,
    overrides: Overrides,
    tags: dict[str, str],
    pool: str | None,
    model: str | None = None,
) -> PointOutcome:
    from prefect.runtime import task_run

    again = task_run.run_count > 1
    if again:
        tracking_servers.wait_for_servers()  # bounded: a server still away fails the point, as it would
    try:
        r = pipeline(
            recipe=recipe,
            source=source,
            storage_url=root,
            overrides=overrides,
            tags=tags,
            train_on=pool,
            force=True,
            model=model,
        )
    except Exception as e:
        if line := database.down_line(e):
            raise DatabaseDown(line) from None  # (not Prefect's traceback of the 503 its client retried)
        raise
    if again:
        supersede(root, tags, r.mlflow_run_id)
    e = r.evaluation
    return PointOutcome(
        point={},
        ok=True,
        headline=e.headline,
        score=e.score,
        higher_is_better=e.higher_is_better,
        val_loss=e.loss,
        decision=r.decision,
        mlflow_run_id=r.mlflow_run_id,
    )


# --- the flow ------------------------------------------------------------------------------


# Threads, not processes: a point's thread mostly waits on its training, here or on a pool; in
# this process the points are run one at a time anyway.
@flow(
    name="sweep",
    persist_result=False,
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=32),
    on_failure=[forget_exception],
    on_crashed=[forget_exception],
)
def sweep(
    recipe: RecipeName = "default",
    grid: Grid = {},
    source: str | list[str] | None = None,
    storage_url: str | None = None,
    overrides: Overrides = NO_OVERRIDES,
    train_on: str | None = None,
    parallel: int | None = None,
    model: str | None = None,
) -> SweepResult:
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
    if not grid:
        raise UserError(NO_GRID)
    fields = grid
    points = expand(fields)
    cfgs = resolve_points(recipe, fields, overrides, source)
    root = storage_root(storage_url)
    preflight(root)
    pool = training_pool(recipe, train_on)
    keys: list[str | None] = [None] * len(points)
    if pool:
        dispatch.ensure_deployment(train, pool)
        # Prepared one by one before any point starts: points then find their data stages done.
        keys = [train_key(cfg, with_results(prepare, root)(cfg, root)) for cfg in cfgs]
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
    result = SweepResult(
        recipe=recipe,
        grid=fields,
        mlflow_run_id=parent.run_id,
        outcomes=outcomes,
        outputs=outputs,
        artifact_uri=parent.artifact_uri,
    )
    if result.failed:
        raise PointsFailed(result)  # the flow run fails, after every point ran and was recorded
    return result


def submit_points(
    recipe: str,
    source: str | list[str] | None,
    root: str,
    overrides: Overrides,
    points: list[dict[str, str]],
    keys: list[str | None],
    parent_id: str,
    pool: str | None,
    parallel: int | None = None,
    model: str | None = None,
) -> list[PrefectFuture]:
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
        future = run_point.with_options(
            task_run_name=f"point {label(point)}"[:100], retry_delay_seconds=retry_delay
        ).submit(
            recipe,
            source,
            root,
            overrides.with_values(point),
            {PARENT_TAG: parent_id, POINT_TAG: label(point)},
            pool,
            model,
            wait_for=after,
        )
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
            tasks.report_progress(
                "points", self.ended, self.total, failed=self.failed, last=f"{name} {'FAILED' if failed else 'done'}"
            )


def outcome(point: dict[str, str], future: PrefectFuture) -> PointOutcome:
    try:
        return future.result().model_copy(update={"point": point})
    except Exception as e:  # noqa: BLE001 (a failed point is reported with the others, not raised)
        message = scrub(str(e).splitlines()[0]) if str(e) else ""
        if not isinstance(e, UserError):
            message = database.down_line(e) or f"{type(e).__name__}: {message}"
        return PointOutcome(point=point, ok=False, error=message)


# --- tracking ------------------------------------------------------------------------------


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
