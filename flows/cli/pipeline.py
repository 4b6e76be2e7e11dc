"""`mllm-pipeline run`, `prepare`, `train`, `evaluate`, `sample`, `recipes` and `sweep`: the commands
that run the pipeline, or one part of it."""

from __future__ import annotations

from typing import Annotated, Any, Callable, Optional

import typer

from flows.cli.app import (
    Force,
    ModelName,
    Recipe,
    Reproduces,
    Sets,
    Source,
    Storage,
    Tags,
    TaskRunner,
    TrainingStorage,
    TrainOn,
    app,
    without_credentials,
)
from flows.cli.terminal import console, escape, flow_session, flows_module, progress, user_errors
from flows.launch import check_model_name, checked_config
from mllm import UserError
from mllm.config import METHODS
from mllm.redact import scrub
from mllm.resolve import recipe_file_overrides, recipe_names, resolve
from mllm.storage import hide_credentials


@app.command()
def run(
    recipe: Recipe = "default",
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    tag: Tags = None,
    train_on: TrainOn = None,
    force: Force = False,
    task_runner: TaskRunner = None,
    model: ModelName = None,
    reproduces: Reproduces = None,
) -> None:
    """Run the whole pipeline: download, tokenize, vocabulary, split, train, evaluate, sample.

    --recipe takes a recipe file too (a search's best.yaml): the recipe it names, with its fields."""
    with user_errors():
        from flows.launch import training_pool

        source, set_ = without_credentials(source, set_, task_runner)
        recipe, set_ = recipe_file_overrides(recipe, set_)
        if model:
            check_model_name(model)
        cfg = checked_config(recipe, set_, source, storage, train_here=not training_pool(recipe, train_on))
        # Scrubbed here, before Prefect stores the flow run's parameters.
        tags = scrub(dict(_key_value(t, "--tag") for t in tag or []))
        with flow_session() as fl, progress():
            result = fl.pipeline(
                recipe=recipe,
                source=source,
                storage_url=fl.storage_root(storage),
                overrides=set_ or [],
                tags=tags,
                train_on=train_on,
                force=force,
                reproduces=reproduces,
                model=model,
            )
        c = result.champion
        if result.decision == "skipped":
            typer.echo(f"skipped: {result.reason}")
            typer.echo(f"champion: {c.name} v{c.version} (mlflow run {c.run_id})")
            _echo_mlflow_run(fl, result)
            return
        t, e = result.trained, result.evaluation
        typer.echo(f"{fl.describe(e, cfg)} after {t.steps} steps")
        method, texts = next(iter(result.samples.items()))
        shown = "; ".join(x.strip().replace("\n", "; ") for x in texts) or "none (no sample prompt fits the vocabulary)"
        typer.echo(f"sample ({method}): {shown[:200]}")
        if result.decision == "reproduction":
            typer.echo(f"model: not registered ({c.reason})")
        else:
            typer.echo(
                f"model: {c.name} v{c.version} ({'promoted to champion' if c.promoted else 'champion kept'}: "
                f"{c.reason})"
            )
        _echo_mlflow_run(fl, result)
        typer.echo(f"outputs: {t.run_dir}")
        typer.echo(f"  checkpoint: {t.best_checkpoint or t.checkpoint}")
        typer.echo(f"  samples:    {t.run_dir}/samples/")
        typer.echo(f"  report:     {e.report}")


def _echo_mlflow_run(fl: Any, result: Any) -> None:
    typer.echo(f"mlflow run: {result.mlflow_run_id}")
    try:
        url = fl.run_url(result.storage, result.mlflow_run_id)
    except Exception:  # noqa: BLE001 - the run has ended; a link is no reason to fail the command
        url = None
    if url:
        typer.echo(f"  in the UI: {url}")


def _key_value(item: str, option: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"malformed {option} {item!r}: write it as key=value")
    return key.strip(), value


def _run_stages(cfg, storage: str | None, last: str, pool: str | None = None) -> Any:
    """Run the flows up to `last` (prepare, train or evaluate), each reusing what is done, and
    return the last one's result."""
    from mllm.storage import room_on

    with flow_session() as fl, progress(), room_on(fl.storage_root(storage)):
        root = fl.storage_root(storage)
        data = fl.with_results(fl.prepare, root, fl.data_runner(cfg.data.task_runner))(cfg, root)
        if last == "prepare":
            return data
        trained = fl.run_training(cfg, data, root, None, pool)
        if last == "train":
            return trained
        return fl.with_results(fl.evaluate, root)(cfg, trained, data)


@app.command()
def prepare(
    recipe: Recipe = "default",
    source: Source = None,
    storage: Storage = None,
    set_: Sets = None,
    task_runner: TaskRunner = None,
) -> None:
    """Run the data stages only: download, tokenize, vocabulary, split."""
    with user_errors():
        from mllm.families.base import family_of

        source, set_ = without_credentials(source, set_, task_runner)
        cfg = checked_config(recipe, set_, source, storage, trains=False)
        data = _run_stages(cfg, storage, "prepare")
        typer.echo(family_of(cfg).describe_data(data))
        typer.echo(f"tokens: {data.tokens.url}\nvocab:  {data.vocab.url}\nsplits: {data.splits.url}")


@app.command()
def train(
    recipe: Recipe = "default",
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    train_on: TrainOn = None,
    task_runner: TaskRunner = None,
) -> None:
    """Prepare the data (reused when unchanged) and train; resumes an interrupted training."""
    with user_errors():
        from flows.launch import training_pool

        source, set_ = without_credentials(source, set_, task_runner)
        pool = training_pool(recipe, train_on)
        trained = _run_stages(
            checked_config(recipe, set_, source, storage, train_here=not pool), storage, "train", pool
        )
        typer.echo(
            f"{trained.steps} steps ({trained.stop_reason}), val loss "
            f"{'n/a' if trained.val_loss is None else f'{trained.val_loss:.4f}'}"
        )
        mfu = "" if trained.mfu is None else f", MFU {trained.mfu:.1%}"
        typer.echo(f"precision: {trained.precision()}{mfu}")
        typer.echo(f"checkpoint: {trained.checkpoint}")


@app.command()
def evaluate(
    recipe: Recipe = "default",
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    task_runner: TaskRunner = None,
) -> None:
    """Evaluate and sample the trained checkpoint of a recipe; with none in storage it trains first, in
    this process (to train on a pool, run `train --train-on POOL` first)."""
    with user_errors():
        source, set_ = without_credentials(source, set_, task_runner)
        cfg = checked_config(recipe, set_, source, storage)
        evaluation, _ = _run_stages(cfg, storage, "evaluate")
        typer.echo(f"{flows_module().describe(evaluation, cfg)}; report {evaluation.report}")


@app.command()
def sample(
    checkpoint: Annotated[
        Optional[str], typer.Option(metavar="URL", help="A checkpoint URL (a run's checkpoints/best.pt).")
    ] = None,
    run: Annotated[
        Optional[str], typer.Option("--run", metavar="RUN_ID", help="An MLflow run id: its logged model.")
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", metavar="MODEL", help="A registered model: NAME@champion or NAME/VERSION."),
    ] = None,
    prompt: Annotated[
        Optional[str],
        typer.Option(
            metavar="TEXT",
            help="Text to continue; the words whose neighbours to list (word embeddings); the sentence to "
            "translate (seq2seq); the numbers to go on from (sequence experiments). Default: the run's "
            "own prompts.",
        ),
    ] = None,
    prompt_file: Annotated[
        Optional[str], typer.Option(metavar="FILE", help="A text file of prompts, one a line: an answer a line.")
    ] = None,
    method: Annotated[
        Optional[str],
        typer.Option(
            metavar="METHOD",
            help=f"{', '.join(METHODS)} (a seq2seq model: greedy, beam, temperature). Default: the run's "
            "first sample method.",
        ),
    ] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(metavar="N", help="Default: the run's own.")] = None,
    temperature: Annotated[Optional[float], typer.Option(metavar="T", help="Default: the run's own.")] = None,
    top_k: Annotated[Optional[int], typer.Option(metavar="K", help="Default: the run's own.")] = None,
    top_p: Annotated[Optional[float], typer.Option(metavar="P", help="Default: the run's own.")] = None,
    beam_width: Annotated[Optional[int], typer.Option(metavar="N", help="Default: the run's own.")] = None,
    seed: Annotated[Optional[int], typer.Option(metavar="SEED", help="Default: the run's own.")] = None,
    neighbours: Annotated[
        Optional[int], typer.Option(metavar="N", help="Word embeddings: neighbours per word. Default: the run's own.")
    ] = None,
    device: Annotated[
        Optional[str],
        typer.Option(
            metavar="DEVICE",
            help="cpu, cuda, cuda:N, mps or auto (a GPU when there is one). Default: cpu for --checkpoint; "
            "for --run/--model a GPU when there is one.",
        ),
    ] = None,
    storage: Storage = None,
) -> None:
    """Sample from a checkpoint, an MLflow run's model or a registered model.

    As its family samples: continue a prompt, list neighbours, translate, or predict the next
    element. Options left out take the run's own `sample` section, as `python -m mllm.sample` does."""
    with user_errors():
        if sum(x is not None for x in (checkpoint, run, model)) != 1:
            raise UserError("give exactly one of --checkpoint URL, --run RUN_ID or --model NAME@champion")
        if method is not None and method not in METHODS:
            raise UserError(f"unknown method {method!r}: choose {', '.join(METHODS)}")
        if prompt is not None and prompt_file is not None:
            raise UserError("give --prompt or --prompt-file, not both")
        prompts = _prompt_lines(prompt_file) if prompt_file else None if prompt is None else [prompt]
        options = dict(
            method=method,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            beam_width=beam_width,
            seed=seed,
            neighbours=neighbours,
        )
        from mllm.sample import check_method_options

        check_method_options(options)
        if device is not None:
            from mllm.runtime.devices import resolve_device

            resolve_device(device)  # a device this machine lacks: one line, before anything loads
        if checkpoint:
            from mllm.runtime.checkpoint import load_checkpoint
            from mllm.sample import answer

            loaded = load_checkpoint(checkpoint, device=device or "cpu")
            from mllm.sample import prompt_losses

            losses = prompt_losses(loaded, prompts)  # the model samples from what is left

            def answered(p: list[str] | None) -> list[str]:
                out = answer(loaded, p, **options)
                for line in losses:  # said once the model took the prompt: a refused one gets its error alone
                    console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
                losses.clear()
                return out

            _print_answers(answered, prompts, prompt_file)
            return
        from flows.launch import check_tracked

        root = flows_module().storage_root(storage)
        check_tracked(root)  # seconds, not MLflow's minutes of retries
        from flows.history import runs

        served = runs.served(root, runs.model_uri(root, run, model), device)
        _print_answers(lambda p: runs.generate(served, p, options), prompts, prompt_file)


def _prompt_lines(path: str) -> list[str]:
    from mllm import storage as store

    store.require(path, "prompt file")
    try:
        lines = store.read_text(path).splitlines()
    except UnicodeDecodeError:
        raise UserError(f"prompt file {path} is not UTF-8 text: convert it, one prompt a line") from None
    if not any(line.strip() for line in lines):
        raise UserError(f"prompt file {path} has no line of text: give one prompt a line")
    return lines


def _print_answers(
    answer: Callable[[list[str] | None], list[str]], prompts: list[str] | None, path: str | None
) -> None:
    """The answers, a line each. From a prompt file, a blank line stays blank, and a line the
    model cannot take is named (with why) while every other line is answered; then the command
    fails."""
    if path is None:
        typer.echo("\n".join(answer(prompts)))
        return
    wanted = [i for i, p in enumerate(prompts) if p.strip()]
    out = [""] * len(prompts)
    failed: list[str] = []
    try:
        for i, text in zip(wanted, answer([prompts[i] for i in wanted])):
            out[i] = text
    except UserError:  # one line spoils the batch: answer the lines one by one
        for i in wanted:
            try:
                out[i] = answer([prompts[i]])[0]
            except UserError as e:
                failed.append(f"line {i + 1}: {e}")
    typer.echo("\n".join(out))
    if failed:
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        raise UserError(
            f"{len(failed)} of {len(wanted)} lines of {path} were not answered (left blank): "
            + "; ".join(failed[:3])
            + more
        )


@app.command()
def recipes() -> None:
    """List the shipped recipes: model, tokens, size, training length and the extra a recipe needs."""
    from mllm.families.base import family_of

    rows = [("recipe", "arch", "tokens", "size", "length", "needs")]
    for name in recipe_names():
        cfg = resolve(name)
        m, t, family = cfg.model, cfg.train, family_of(cfg)
        size, tokens = family.size(m), family.tokens(cfg.data)
        length = (
            f"{t.epochs:g} epochs" if t.epochs else f"{t.max_steps} steps" if t.max_steps else f"{t.max_minutes:g} min"
        )
        needs = f"pip install 'mllm-pipeline[{family.extra}]'" if family.extra else ""
        rows.append((name, m.arch, tokens, size, length, needs))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@app.command()
def sweep(
    recipe: Recipe = "default",
    grid: Annotated[
        Optional[list[str]],
        typer.Option(
            "--grid",
            metavar="FIELD=V1,V2,...",
            help="A config field and its values: --grid train.lr=1e-3,3e-3 (repeatable: every combination runs).",
        ),
    ] = None,
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    train_on: TrainOn = None,
    parallel: Annotated[
        Optional[int],
        typer.Option(metavar="N", help="With --train-on: at most N points at once [as many as the pool's slots take]."),
    ] = None,
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
        from flows.launch import training_pool
        from flows.sweep.flow import PointsFailed
        from flows.sweep.points import parse_grid, resolve_points, split_values
        from flows.sweep.table import text_table

        source, set_ = without_credentials(source, set_)
        # A URL among the values (several sources, say) keeps its password in memory only, as --source's.
        grid = [
            f"{k}={','.join(hide_credentials(v) for v in split_values(values))}" if sep else k
            for k, sep, values in (g.partition("=") for g in grid or [])
        ]
        resolve_points(recipe, parse_grid(grid), set_, source)  # every point, before anything runs
        checked_config(recipe, set_, source, storage, train_here=not training_pool(recipe, train_on))
        # At a terminal: a bar of the points, then a line for each that failed, then the table;
        # Prefect's lines (hundreds for a sweep of many points) stay in the run record.
        with flow_session() as fl, progress(stages=("points",), silent=True):
            from flows.sweep.flow import sweep as sweep_flow

            failure = ""
            try:
                result = sweep_flow(
                    recipe=recipe,
                    grid=grid,
                    source=source,
                    storage_url=fl.storage_root(storage),
                    overrides=set_,
                    train_on=train_on,
                    parallel=parallel,
                    model=model,
                )
            except PointsFailed as e:  # the others ran: their table first, then the one line
                result, failure = e.result, str(e)
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
