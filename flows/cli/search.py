"""`mllm-pipeline search`: Optuna trials over a space of config fields (flows/search/flow.py).
Registered on the CLI's app."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from flows.cli.app import ModelName, Recipe, Sets, Source, TrainingStorage, TrainOn, app, without_credentials
from flows.cli.terminal import console, escape, flow_session, progress, user_errors
from flows.launch import check_model_name, checked_config, storage_root, training_pool
from mllm.redact import scrub

Space = Annotated[
    Optional[list[str]],
    typer.Option(
        "--space",
        metavar="FIELD=SPEC",
        help="A config field and its values: a list (model.n_layer=1,2,3) or a range: train.lr=1e-4..1e-2 "
        "(uniform), log:1e-4..1e-2 (uniform in the logarithm), int:64..512 (integers). Repeatable.",
    ),
]
Trials = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="Trials the study finishes (complete, pruned or failed), earlier runs of the same command included.",
    ),
]
Sampler = Annotated[
    str,
    typer.Option(
        metavar="tpe|random",
        help="tpe: Optuna's tree-structured Parzen estimator, which learns from the "
        "trials so far; random: independent draws.",
    ),
]
Pruner = Annotated[
    str,
    typer.Option(
        metavar="median|halving|hyperband|none",
        help="Stops a trial at an evaluation: median (default, Optuna's own: worse than the median of "
        "earlier trials at the same step, once --startup-trials finished), halving (successive "
        "halving), hyperband, or none.",
    ),
]
StartupTrials = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="Trials TPE draws at random before it models the results, and that the median "
        "pruner waits for before it prunes.",
    ),
]
Study = Annotated[
    Optional[str],
    typer.Option(
        metavar="NAME",
        help="The study's name (default: from the recipe, the space, --set and the data, "
        "so the same command continues the same study).",
    ),
]
Parallel = Annotated[
    Optional[int],
    typer.Option(metavar="N", help="With --train-on: at most N trials at once [as many as the pool's slots take]."),
]


@app.command()
def search(
    recipe: Recipe = "default",
    space: Space = None,
    trials: Trials = 20,
    sampler: Sampler = "tpe",
    pruner: Pruner = "median",
    startup_trials: StartupTrials = 5,
    study: Study = None,
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    train_on: TrainOn = None,
    parallel: Parallel = None,
    model: ModelName = None,
) -> None:
    """Search a space of config fields with Optuna: each trial a pipeline run, a losing one stopped at an
    evaluation. The study is kept in optuna.db beside the storage root, or in PostgreSQL (the stack's own
    cluster, or $MLLM_STUDY_DATABASE) where searches on several machines share it: the same command again
    continues it, and resumes a trial whose process died from its checkpoint. Exit status 1 when a trial of the
    study failed (or none completed), after the table, with a line saying how many and where their logs are;
    as `sweep` exits 1 when a point failed."""
    with user_errors():
        from flows.search import space as spaces
        from flows.search.study import check_options, check_study, study_store

        source, sets = without_credentials(source, set_)
        dims = spaces.without_credentials(spaces.parse_space(space or []))
        if model:
            check_model_name(model)
        pool = training_pool(recipe, train_on)
        check_options(trials, sampler, pruner, parallel, startup_trials)
        base = spaces.check_space(recipe, dims, sets, source)  # every choice and both ends of each range
        name = study or spaces.study_name(recipe, dims, sets, base)
        check_study(study_store(storage_root(storage)), name, dims, recipe)
        checked_config(recipe, sets, source, storage, train_here=not pool)
        asked = dict(recipe=recipe, space=dims, trials_n=trials, sampler=sampler, pruner=pruner, study=study)
        more = dict(source=source, overrides=sets, train_on=train_on, parallel=parallel, model=model)
        result, failure = _searched(storage, **asked, **more, startup_trials=startup_trials)
        _report(result, failure)


def _searched(storage: str | None, **parameters: Any) -> tuple[Any, str]:
    """The search flow's result, and the line that says which trials failed (empty when none did)."""
    with flow_session(), progress(stages=("trials",), silent=True):
        from flows.search.flow import search
        from flows.search.record import TrialsFailed

        try:
            return search(storage_url=storage_root(storage), **parameters), ""
        except TrialsFailed as e:  # the others ran: their table first, then the one line
            return e.result, str(e)


def _report(result: Any, failure: str) -> None:
    """The failed trials a line each, the table, the best trial and where everything is; exit 1
    when a trial failed or none completed."""
    from flows.search.report import text_table

    for o in result.failed:
        values = " ".join(f"{f}={v}" for f, v in o.params.items())
        console.print(
            f"[bold red]failed:[/] trial {o.number} {escape(scrub(values))}: {escape(scrub(o.error or ''))}",
            highlight=False,
            soft_wrap=True,
        )
    typer.echo(text_table(result.headline, result.outcomes))
    if result.revived:
        typer.echo(
            f"resumed from their checkpoints: trials {', '.join(map(str, result.revived))} (their process had died)"
        )
    if result.best is not None:
        b = result.best
        typer.echo(
            f"best: trial {b.number}, {result.headline} {b.value:.4f}: "
            + " ".join(f"{f}={v}" for f, v in b.params.items())
        )
        typer.echo(f"best recipe: {result.best_recipe} (mllm-pipeline run --recipe {result.best_recipe})")
    typer.echo(f"study: {result.study} in {result.study_file}")
    typer.echo(f"search mlflow run: {result.mlflow_run_id}")
    typer.echo(f"table and plots: {result.outputs}/ (search.md, history.png, params.png)")
    if failure or result.best is None:
        line = failure or f"no trial of study {result.study} completed"
        console.print(f"[bold red]error:[/] {escape(scrub(line))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
