"""Every command's --help, and a mistyped option, as a user meets them: each value named by what
it is (`--top-p P`, `--home DIR`), never by its Python type, and a suggestion only where one is near.
Parsed in this process (typer's CliRunner): no server, no flow."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from flows.cli.main import app

RUNNER = CliRunner()


def _commands(command=None, path=()):
    """Every command and subcommand as its words: ('run',), ('stack', 'user', 'add'), ..."""
    command = command or typer.main.get_command(app)
    subcommands = getattr(command, "commands", None) or {}
    if path and not subcommands:
        yield path
    for name, sub in subcommands.items():
        yield from _commands(sub, (*path, name))


def test_every_help_names_each_value_by_what_it_is_not_by_its_type() -> None:
    seen = list(_commands())
    assert {("run",), ("sample",), ("stack", "user", "add"), ("schedule", "list"), ("stack", "worker-env")} <= set(seen)
    for words in seen:
        out = RUNNER.invoke(app, [*words, "--help"], env={"COLUMNS": "300"}, catch_exceptions=False)
        assert out.exit_code == 0, (words, out.output)
        types = re.findall(r"<(?:str|int|float|bool|path|list\[\w+\])>", out.output)
        assert not types, (words, types, out.output)
    sample = re.sub(r"[\s│]+", " ", RUNNER.invoke(app, ["sample", "--help"], env={"COLUMNS": "300"}).output)
    for shown in (
        "--checkpoint URL",
        "--run RUN_ID",
        "--prompt TEXT",
        "--prompt-file FILE",
        "--top-p P",
        "--max-new-tokens N",
        "--device DEVICE",
    ):
        assert shown in sample, (shown, sample)
    reproduce = re.sub(r"[\s│]+", " ", RUNNER.invoke(app, ["reproduce", "--help"], env={"COLUMNS": "300"}).output)
    assert "* RUN_ID The MLflow run to reproduce." in reproduce, reproduce


@pytest.mark.parametrize(
    "typed, suggested",
    [
        (["run", "--nosuch"], None),  # `--source` shares only the `--` and two letters with it
        (["run", "--sorce", "x"], "(Possible options: --force, --source, --storage)"),
        (["sample", "--promt", "x"], "(Possible options: --prompt, --prompt-file)"),
        (["run", "--reproduce", "x"], None),  # a hidden option is never suggested
    ],
)
def test_an_unknown_option_suggests_only_options_near_it(typed: list[str], suggested: str | None) -> None:
    out = RUNNER.invoke(app, typed, env={"COLUMNS": "300"})
    assert out.exit_code == 2
    text = re.sub(r"[\s│]+", " ", out.output)
    assert f"No such option: {typed[1]}" in text, text
    if suggested is None:
        assert "Possible options" not in text, text
    else:
        assert suggested in text, text
