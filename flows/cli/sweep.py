"""`mllm-pipeline sweep`: the pipeline at every point of a grid (flows/sweep/flow.py). Registered on
the CLI's app."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from flows.cli.app import ModelName, Recipe, Sets, Source, TrainingStorage, TrainOn, app, without_credentials
from flows.cli.terminal import console, escape, flow_session, progress, user_errors
from flows.launch import check_model_name, checked_config, storage_root, training_pool
from flows.sweep import points
from flows.sweep.table import text_table
from mllm import UserError
from mllm.redact import scrub
from mllm.resolve import Overrides

Grid = Annotated[
    Optional[list[str]],
    typer.Option(
        "--grid",
        metavar="FIELD=V1,V2,...",
        help="A config field and its values: --grid train.lr=1e-3,3e-3 (repeatable: every combination runs).",
    ),
]
Parallel = Annotated[
    Optional[int],
    typer.Option(metavar="N", help="With --train-on: at most N points at once [as many as the pool's slots take]."),
]


@app.command()
def sweep(
    recipe: Recipe = "default",
    grid: Grid = None,
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    train_on: TrainOn = None,
    parallel: Parallel = None,
    model: ModelName = None,
) -> None:
    """Run the pipeline at every point of a grid and compare the points' headline metrics. Exit status 1 when
    a point failed, after the table, with a line saying how many and where their logs are; as `search` exits 1
    when a trial failed."""
    with user_errors():
        if parallel is not None and parallel < 1:
            raise UserError(f"--parallel {parallel}: give at least 1 (the points that run at once)")
        if model:
            check_model_name(model)
        source, sets = without_credentials(source, set_)
        fields = points.without_credentials(points.parse_grid(grid or []))
        points.resolve_points(recipe, fields, sets, source)  # every point, before anything runs
        checked_config(recipe, sets, source, storage, train_here=not training_pool(recipe, train_on))
        result, failure = _swept(recipe, fields, source, storage, sets, train_on, parallel, model)
        _report(result, failure)


def _swept(
    recipe: str,
    grid: dict[str, list[str]],
    source: str | list[str] | None,
    storage: str | None,
    sets: Overrides,
    train_on: str | None,
    parallel: int | None,
    model: str | None,
) -> tuple[Any, str]:
    """The sweep flow's result, and the line that says which points failed (empty when none did)."""
    # At a terminal: a bar of the points, then a line for each that failed, then the table;
    # Prefect's lines (hundreds for a sweep of many points) stay in the run record.
    with flow_session(), progress(stages=("points",), silent=True):
        from flows.sweep.flow import PointsFailed, sweep

        try:
            result = sweep(
                recipe=recipe,
                grid=grid,
                source=source,
                storage_url=storage_root(storage),
                overrides=sets,
                train_on=train_on,
                parallel=parallel,
                model=model,
            )
        except PointsFailed as e:  # the others ran: their table first, then the one line
            return e.result, str(e)
    return result, ""


def _report(result: Any, failure: str) -> None:
    """The failed points a line each, the table, where the runs and the plot are; exit 1 when a point failed."""
    for o in result.failed:
        console.print(
            f"[bold red]failed:[/] {escape(scrub(o.label))}: {escape(scrub(o.error or ''))}",
            highlight=False,
            soft_wrap=True,
        )
    typer.echo(text_table(result.outcomes))
    typer.echo(f"sweep mlflow run: {result.mlflow_run_id}")
    typer.echo(f"plot: {result.outputs}/sweep.png (artifact {result.artifact_uri}/sweep.png)")
    if result.failed:
        console.print(f"[bold red]error:[/] {escape(scrub(failure))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
