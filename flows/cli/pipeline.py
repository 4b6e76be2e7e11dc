"""`mllm-pipeline run`, `prepare`, `train`, `evaluate`, `sample` and `recipes`: the commands that run
the pipeline, or one part of it, and sample what it trained."""

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
from flows.cli.terminal import console, escape, flow_session, progress, user_errors
from flows.launch import check_model_name, checked_config, data_runner, storage_root, with_results
from mllm import UserError
from mllm.config import METHODS
from mllm.redact import scrub
from mllm.resolve import field_value, recipe_file_overrides, recipe_names, resolve


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

        source, sets = without_credentials(source, set_, task_runner)
        recipe, sets = recipe_file_overrides(recipe, sets)
        if model:
            check_model_name(model)
        cfg = checked_config(recipe, sets, source, storage, train_here=not training_pool(recipe, train_on))
        # Scrubbed here, before Prefect stores the flow run's parameters.
        tags = scrub(dict(field_value(t, "--tag", "key=value", dotted=False) for t in tag or []))
        with flow_session(), progress():
            from flows.pipeline import pipeline

            result = pipeline(
                recipe=recipe,
                source=source,
                storage_url=storage_root(storage),
                overrides=sets,
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
            _echo_mlflow_run(result)
            return
        from tasks.model.evaluate import describe

        t, e = result.trained, result.evaluation
        typer.echo(f"{describe(e, cfg)} after {t.steps} steps")
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
        _echo_mlflow_run(result)
        typer.echo(f"outputs: {t.run_dir}")
        typer.echo(f"  checkpoint: {t.best_checkpoint or t.checkpoint}")
        typer.echo(f"  samples:    {t.run_dir}/samples/")
        typer.echo(f"  report:     {e.report}")


def _echo_mlflow_run(result: Any) -> None:
    from tasks.tracking.store import run_url

    typer.echo(f"mlflow run: {result.mlflow_run_id}")
    try:
        url = run_url(result.storage, result.mlflow_run_id)
    except Exception:  # noqa: BLE001 - the run has ended; a link is no reason to fail the command
        url = None
    if url:
        typer.echo(f"  in the UI: {url}")


def _run_stages(cfg, storage: str | None, last: str, pool: str | None = None) -> Any:
    """Run the flows up to `last` (prepare, train or evaluate), each reusing what is done, and
    return the last one's result."""
    from mllm.storage import room_on

    root = storage_root(storage)
    with flow_session(), progress(), room_on(root):
        from flows.pipeline import evaluate, prepare
        from flows.training import run_training

        data = with_results(prepare, root, data_runner(cfg.data.task_runner))(cfg, root)
        if last == "prepare":
            return data
        trained = run_training(cfg, data, root, None, pool)
        if last == "train":
            return trained
        return with_results(evaluate, root)(cfg, trained, data)


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

        source, sets = without_credentials(source, set_, task_runner)
        cfg = checked_config(recipe, sets, source, storage, trains=False)
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

        source, sets = without_credentials(source, set_, task_runner)
        pool = training_pool(recipe, train_on)
        trained = _run_stages(
            checked_config(recipe, sets, source, storage, train_here=not pool), storage, "train", pool
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
        source, sets = without_credentials(source, set_, task_runner)
        cfg = checked_config(recipe, sets, source, storage)
        evaluation, _ = _run_stages(cfg, storage, "evaluate")
        from tasks.model.evaluate import describe

        typer.echo(f"{describe(evaluation, cfg)}; report {evaluation.report}")


def _runs_own(kind: type, metavar: str, help: str = "Default: the run's own.") -> Any:
    """A `sample` option that, left out, takes the run's own `sample` section."""
    return Annotated[Optional[kind], typer.Option(metavar=metavar, help=help)]


Checkpoint = Annotated[
    Optional[str], typer.Option(metavar="URL", help="A checkpoint URL (a run's checkpoints/best.pt).")
]
RunId = Annotated[Optional[str], typer.Option("--run", metavar="RUN_ID", help="An MLflow run id: its logged model.")]
RegisteredModel = Annotated[
    Optional[str], typer.Option("--model", metavar="MODEL", help="A registered model: NAME@champion or NAME/VERSION.")
]
Prompt = Annotated[
    Optional[str],
    typer.Option(
        metavar="TEXT",
        help="Text to continue; the words whose neighbours to list (word embeddings); the sentence to "
        "translate (seq2seq); the numbers to go on from (sequence experiments). Default: the run's "
        "own prompts.",
    ),
]
PromptFile = Annotated[
    Optional[str], typer.Option(metavar="FILE", help="A text file of prompts, one a line: an answer a line.")
]
Method = _runs_own(
    str,
    "METHOD",
    f"{', '.join(METHODS)} (a seq2seq model: greedy, beam, temperature). Default: the run's first sample method.",
)
MaxNewTokens = _runs_own(int, "N")
Temperature = _runs_own(float, "T")
TopK = _runs_own(int, "K")
TopP = _runs_own(float, "P")
BeamWidth = _runs_own(int, "N")
Seed = _runs_own(int, "SEED")
Neighbours = _runs_own(int, "N", "Word embeddings: neighbours per word. Default: the run's own.")
Device = Annotated[
    Optional[str],
    typer.Option(
        metavar="DEVICE",
        help="cpu, cuda, cuda:N, mps or auto (a GPU when there is one). Default: cpu for --checkpoint; "
        "for --run/--model a GPU when there is one.",
    ),
]


@app.command()
def sample(
    checkpoint: Checkpoint = None,
    run: RunId = None,
    model: RegisteredModel = None,
    prompt: Prompt = None,
    prompt_file: PromptFile = None,
    method: Method = None,
    max_new_tokens: MaxNewTokens = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    beam_width: BeamWidth = None,
    seed: Seed = None,
    neighbours: Neighbours = None,
    device: Device = None,
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
        _check_sampling(options, device)
        if checkpoint:
            answer = _checkpoint_answers(checkpoint, device, prompts, options)
        else:
            answer = _served_answers(storage_root(storage), run, model, device, options)
        _print_answers(answer, prompts, prompt_file)


def _check_sampling(options: dict[str, Any], device: str | None) -> None:
    """The sampling options and the device, each a line of its own before anything loads."""
    from mllm.sample import check_method_options

    check_method_options(options)
    if device is not None:
        from mllm.runtime.devices import resolve_device

        resolve_device(device)  # a device this machine lacks: one line, before anything loads


def _checkpoint_answers(
    checkpoint: str, device: str | None, prompts: list[str] | None, options: dict[str, Any]
) -> Callable[[list[str] | None], list[str]]:
    """The answers of a checkpoint loaded here; a prompt's lost characters warned about once the
    model took it (a refused prompt gets its error line alone)."""
    from mllm.runtime.checkpoint import load_checkpoint
    from mllm.sample import answer, prompt_losses

    loaded = load_checkpoint(checkpoint, device=device or "cpu")
    losses = prompt_losses(loaded, prompts)  # the model samples from what is left

    def answered(p: list[str] | None) -> list[str]:
        out = answer(loaded, p, **options)
        for line in losses:
            console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
        losses.clear()
        return out

    return answered


def _served_answers(
    root: str, run: str | None, model: str | None, device: str | None, options: dict[str, Any]
) -> Callable[[list[str] | None], list[str]]:
    """The answers of an MLflow run's model or a registered model."""
    from flows.history import runs
    from flows.launch import check_tracked

    check_tracked(root)  # seconds, not MLflow's minutes of retries
    served = runs.served(root, runs.model_uri(root, run, model), device)
    return lambda p: runs.generate(served, p, options)


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
