"""The CLI's typer app and the options its commands share; commands register on it by importing it
(flows/cli/main.py imports them all)."""

from __future__ import annotations

import difflib
from typing import Annotated, Optional

import typer
from typer._click.exceptions import NoSuchOption

from mllm.resolve import Overrides, absolute_source
from mllm.storage import hide_credentials


class _Option(typer.core.TyperOption):
    def display_type_rich(self, ctx):
        # typer 0.29 shows a flag's type as if the flag took a value (`--json <bool>`), and
        # `--json true` is then refused: a flag shows no type.
        return None if self.is_flag else super().display_type_rich(ctx)


class _Argument(typer.core.TyperArgument):
    def display_type_rich(self, ctx):
        # ... and an argument's Python type (`RUN_ID <str>`) beside its name, which says what it is.
        return None

    def _usage_display_name(self) -> str:
        # ... and a required argument in braces (`reproduce {run_id}`), which reads as a literal or
        # a template: the usage line names it as click does, `RUN_ID`, an optional one `[RUN_ID]`.
        name = super()._usage_display_name()
        return name.replace("{", "", 1).replace("}", "", 1) if self.required else name


def _close_options(option_name: str, ctx) -> list[str]:
    """An unknown option's suggestions: click's parser compares the whole `--name` with difflib's
    cutoff of 0.6, so the `--` every option shares lifts a stranger over it (`--nosuch` suggested
    `--source`, 0.625; the names alone score 0.5). The names are compared without it, and a
    hidden option is never suggested."""
    names = [
        o[2:]
        for p in ctx.command.params
        if not getattr(p, "hidden", False)
        for o in [*p.opts, *p.secondary_opts]
        if o.startswith("--")
    ]
    return ["--" + n for n in difflib.get_close_matches(option_name[2:], names)]


def _suggesting(parse_args, ctx, args):
    """`parse_args` of a command, an unknown `--option` met with `_close_options`."""
    try:
        return parse_args(ctx, args)
    except NoSuchOption as e:
        if not (e.possibilities and e.option_name.startswith("--")):
            raise
        raise NoSuchOption(e.option_name, e.message, _close_options(e.option_name, ctx), ctx) from None


class _Command(typer.core.TyperCommand):
    def parse_args(self, ctx, args):
        return _suggesting(super().parse_args, ctx, args)

    def get_help_option(self, ctx):
        return _own_option(super().get_help_option(ctx))


class _Group(typer.core.TyperGroup):
    """The app's command tree, each command, group and parameter typer made taking this module's
    classes above (typer has no hook for its parameters' classes; its own are left as they are)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _own(self)

    def parse_args(self, ctx, args):
        return _suggesting(super().parse_args, ctx, args)

    def get_help_option(self, ctx):
        return _own_option(super().get_help_option(ctx))


def _own_option(p):
    """`p` with this module's class for it, when it is one of typer's own."""
    if type(p) is typer.core.TyperOption:
        p.__class__ = _Option
    elif type(p) is typer.core.TyperArgument:
        p.__class__ = _Argument
    return p


def _own(command) -> None:
    for p in command.params:
        _own_option(p)
    for sub in getattr(command, "commands", {}).values():
        if type(sub) is typer.core.TyperGroup:
            sub.__class__ = _Group
        elif type(sub) is typer.core.TyperCommand:
            sub.__class__ = _Command
        _own(sub)


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="A reproducible training pipeline for small language models.",
)


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"mllm-pipeline {version('mllm-pipeline')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("mllm-pipeline (not installed: run `make install`)")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """A reproducible training pipeline for small language models."""


Recipe = Annotated[
    str, typer.Option("--recipe", "-r", metavar="NAME|FILE", help="Recipe name (see `mllm-pipeline recipes`).")
]
Source = Annotated[
    Optional[list[str]],
    typer.Option(
        "--source",
        "-s",
        metavar="URL",
        help="Corpus: a file, a folder or s3:// prefix (every file below it), or a glob (`**` included); "
        "a path, file://, s3:// or https:// URL; text, JSONL or Parquet. Repeatable.",
    ),
]
TaskRunner = Annotated[
    Optional[str],
    typer.Option(
        "--task-runner",
        metavar="RUNNER",
        help="Where the per-file work of a many-file source runs: processes (default, one per core), threads, or "
        "dask://HOST:PORT (a running Dask scheduler). The same as --set data.task_runner=RUNNER.",
    ),
]
Storage = Annotated[
    Optional[str],
    typer.Option("--storage", metavar="URL", help="Storage root URL (default: $MLLM_STORAGE or ./storage)."),
]
# The commands that train: what a root means for skipping a training.
TrainingStorage = Annotated[
    Optional[str],
    typer.Option(
        "--storage",
        metavar="URL",
        help="Storage root URL (default: $MLLM_STORAGE or ./storage). Roots may share a tracking store (mlflow.db beside them, or MLFLOW_TRACKING_URI): a run skips training only when this root holds the finished training of the same key; a new root trains.",
    ),
]
Sets = Annotated[
    Optional[list[str]],
    typer.Option("--set", metavar="FIELD=VALUE", help="Override a config field: --set train.lr=3e-4 (repeatable)."),
]


def without_credentials(
    source: list[str] | None, sets: list[str] | None, task_runner: str | None = None
) -> tuple[str | list[str] | None, Overrides]:
    """The source (one, several, or none) and the --set overrides, parsed (a malformed one is the
    command's error line), with any user:password taken out of URLs (kept in memory for the
    download): the flow's parameters, which Prefect stores, never hold one. A local path is made
    absolute. --task-runner joins the overrides."""
    overrides = Overrides.parse(sets).without_credentials()
    if task_runner:
        overrides = overrides.with_values({"data.task_runner": task_runner})
    # A relative path means the caller's folder: absolute in the flow's parameters, which a
    # deployment's worker reads from another, and in the run's record (`reproduce`).
    sources = [absolute_source(hide_credentials(x)) for x in source or []]
    return (sources[0] if len(sources) == 1 else sources or None), overrides


Tags = Annotated[
    Optional[list[str]],
    typer.Option("--tag", metavar="KEY=VALUE", help="An extra MLflow run tag: --tag key=value (repeatable)."),
]
TrainOn = Annotated[
    Optional[str],
    typer.Option(
        "--train-on",
        metavar="POOL",
        help="Train on a worker of this Prefect work pool (default: the recipe's pipeline.pool, else this process).",
    ),
]


# Set by `reproduce` (hidden: a reproduction is asked for with that command).
ModelName = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        metavar="NAME",
        help="The registered model that the trained model joins, and whose champion it is "
        "judged against (default: the recipe's name).",
    ),
]
Reproduces = Annotated[Optional[str], typer.Option("--reproduces", hidden=True, metavar="RUN_ID")]
Force = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Do not skip when the champion was trained on the same data, config and code: evaluate, register and judge again (a finished training of the same key in storage is reused, not repeated).",
    ),
]
