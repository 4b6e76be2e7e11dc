"""`mllm-pipeline search`: Optuna trials over a space of config fields (flows/search/flow.py).
Registered on the CLI's app."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from flows.cli.app import ModelName, Recipe, Sets, Source, TrainingStorage, TrainOn, app, without_credentials
from flows.cli.terminal import console, escape, flow_session, progress, user_errors
from flows.launch import check_model_name, checked_config, storage_root, training_pool
from mllm.redact import scrub
from mllm.storage import hide_credentials


@app.command()
def search(
    recipe: Recipe = "default",
    space: Annotated[
        Optional[list[str]],
        typer.Option(
            "--space",
            metavar="FIELD=SPEC",
            help="A config field and its values: a list (model.n_layer=1,2,3) or a range: train.lr=1e-4..1e-2 "
            "(uniform), log:1e-4..1e-2 (uniform in the logarithm), int:64..512 (integers). Repeatable.",
        ),
    ] = None,
    trials: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Trials the study finishes (complete, pruned or failed), earlier runs of the same command included.",
        ),
    ] = 20,
    sampler: Annotated[
        str,
        typer.Option(
            metavar="tpe|random",
            help="tpe: Optuna's tree-structured Parzen estimator, which learns from the "
            "trials so far; random: independent draws.",
        ),
    ] = "tpe",
    pruner: Annotated[
        str,
        typer.Option(
            metavar="median|halving|hyperband|none",
            help="Stops a trial at an evaluation: median (default, Optuna's own: worse than the median of "
            "earlier trials at the same step, once --startup-trials finished), halving (successive "
            "halving), hyperband, or none.",
        ),
    ] = "median",
    startup_trials: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Trials TPE draws at random before it models the results, and that the median "
            "pruner waits for before it prunes.",
        ),
    ] = 5,
    study: Annotated[
        Optional[str],
        typer.Option(
            metavar="NAME",
            help="The study's name (default: from the recipe, the space, --set and the data, "
            "so the same command continues the same study).",
        ),
    ] = None,
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    train_on: TrainOn = None,
    parallel: Annotated[
        Optional[int],
        typer.Option(metavar="N", help="With --train-on: at most N trials at once [as many as the pool's slots take]."),
    ] = None,
    model: ModelName = None,
) -> None:
    """Search a space of config fields with Optuna: each trial a pipeline run, a losing one stopped at an
    evaluation. The study is kept in optuna.db beside the storage root, or in PostgreSQL (the stack's own
    cluster, or $MLLM_STUDY_DATABASE) where searches on several machines share it: the same command again
    continues it, and resumes a trial whose process died from its checkpoint. Exit status 1 when a trial of the
    study failed (or none completed), after the table, with a line saying how many and where their logs are;
    as `sweep` exits 1 when a point failed."""
    with user_errors():
        from flows.search.report import text_table
        from flows.search.space import check_space, parse_space, study_name
        from flows.search.study import check_options, check_study, study_store

        source, set_ = without_credentials(source, set_)
        space = [f"{k}={hide_credentials(v)}" if sep else k for k, sep, v in (s.partition("=") for s in space or [])]
        dims = parse_space(space)
        if model:
            check_model_name(model)
        pool = training_pool(recipe, train_on)
        check_options(trials, sampler, pruner, parallel, startup_trials)
        base = check_space(recipe, dims, set_, source)  # every choice and both ends of each range
        name = study or study_name(recipe, dims, set_, base)
        check_study(study_store(storage_root(storage)), name, dims, recipe)
        checked_config(recipe, set_, source, storage, train_here=not pool)
        with flow_session() as fl, progress(stages=("trials",), silent=True):
            from flows.search.flow import search as search_flow
            from flows.search.record import TrialsFailed

            failure = ""
            try:
                result = search_flow(
                    recipe=recipe,
                    space=space,
                    trials_n=trials,
                    sampler=sampler,
                    pruner=pruner,
                    study=study,
                    source=source,
                    storage_url=fl.storage_root(storage),
                    overrides=set_,
                    train_on=train_on,
                    parallel=parallel,
                    startup_trials=startup_trials,
                    model=model,
                )
            except TrialsFailed as e:  # the others ran: their table first, then the one line
                result, failure = e.result, str(e)
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
