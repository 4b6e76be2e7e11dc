"""Every `mllm-pipeline ...` and `make ...` line in the code blocks of README.md and docs/*.md runs
as written from a folder prepared as the docs say (the book fetched by the block's `curl -o`, here
linked in from ../shared/data; the folders that corpora.md says stand for a user's own):

- each line parses: its command and options exist and take those values (typer's parser, nothing
  run), a recipe is a shipped one or a file there, its --set/--grid fields resolve, and every local
  file it names (--source, --recipe FILE) exists in the prepared folder; a make line names a target
  of the Makefile with variables it reads;
- a few run for real with tiny overrides (--set train.max_steps=...) on the session's Prefect server.

Lines of a synopsis (`[--storage URL]`, `A | B`, `...`, `<key>`) say what to put where and are
only counted, not run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from commands import cli
from textdata import make_text

from flows.cli.main import app

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# What `curl -o NAME URL` in a block fetches, in ../shared/data (no network here).
FETCHED = {"https://www.gutenberg.org/cache/epub/2600/pg2600.txt": "warandpeace.txt"}
# docs/corpora.md's examples stand for a user's own files and folders (it says so): made here.
OWN = {"books/a.txt", "more/b.txt", "dump/c.txt", "a.txt", "shards/x/d.jsonl.gz"}
SYNOPSIS = re.compile(r"\[|\s\|\s|\.\.\.|<\w+>|\b(?:URL|NAME|RUN_ID|FILE|POOL|SPEC|FIELD=)\b")
MAKE_VARS = {"RECIPE", "SOURCE", "STORAGE", "SET", "TORCH", "TORCH_WHEEL", "REGISTRY", "BASE_IMAGE", "PYTHON"}


def _lines() -> list[tuple[str, str, list[str]]]:
    """(doc, line, the block's curl lines) for every command line of a fenced block; a line of a
    block fenced without a shell's name (```, a synopsis) has no curl lines: None."""
    found = []
    for doc in DOCS:
        for lang, block in re.findall(r"```([a-z]*)\n(.*?)```", doc.read_text(), re.S):
            lines = [re.sub(r"^\$ ", "", line.strip()) for line in block.replace("\\\n", " ").splitlines()]
            curls = [line for line in lines if line.startswith("curl ")] if lang in ("bash", "sh", "console") else None
            found += [
                (doc.name, line, curls)
                for line in lines
                if re.match(r"^(\S+=\S+ )*(\.venv/bin/)?(mllm-pipeline|make) ", line)
            ]
    return found


def _words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while "=" in words[0] and not words[0].startswith(("mllm-pipeline", "make")):
        words.pop(0)  # VAR=value before the command
    return words


def _parse(args: list[str]) -> tuple[list[str], dict]:
    """The command's words and its parameters as typer's parser reads them; nothing is invoked."""
    command = typer.main.get_command(app)
    ctx = command.make_context("mllm-pipeline", list(args))
    names = []
    while hasattr(command, "resolve_command"):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            break
        name, command, rest = command.resolve_command(ctx, rest)
        names.append(name)
        ctx = command.make_context(name, rest, parent=ctx)
    return names, ctx.params


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A user's folder as the docs prepare it."""
    if not (SHARED / "warandpeace.txt").is_file():
        pytest.skip(f"no {SHARED}/warandpeace.txt to stand for the book the docs fetch")
    here = tmp_path_factory.mktemp("user")
    for name in FETCHED.values():
        (here / name).symlink_to(SHARED / name)
    for name in OWN:
        (here / name).parent.mkdir(parents=True, exist_ok=True)
        (here / name).write_text(make_text(3000, seed=len(name)))
    return here


def _check_files(words: list[str], params: dict, curls: list[str], here: Path) -> None:
    for url, name in FETCHED.items():
        if f"--source {name}" in " ".join(words):
            assert any(url in c and name in c for c in curls), f"{' '.join(words)}: no curl fetches {name} beside it"
    for source in params.get("source") or []:
        if "://" not in source:
            assert list(here.glob(source.rstrip("/"))), f"{' '.join(words)}: {source} not in the prepared folder"
    recipe = params.get("recipe")
    if recipe:
        from mllm.resolve import recipe_names

        assert recipe in recipe_names() or (here / recipe).is_file(), f"{' '.join(words)}: no recipe {recipe}"


def _check_fields(names: list[str], params: dict) -> None:
    """Overrides and grid fields resolve against the recipe (the checks the command makes first)."""
    if names[:1] not in (["run"], ["sweep"], ["search"], ["schedule"]) or not params.get("recipe"):
        return
    from mllm.resolve import Overrides, resolve

    sets = Overrides.parse(params.get("set_"))
    resolve(params["recipe"], overrides=sets)
    if params.get("grid"):
        from flows.sweep.points import parse_grid, resolve_points

        resolve_points(params["recipe"], parse_grid(params["grid"]), sets, None)


def test_every_command_in_the_docs_parses_and_names_files_that_are_there(folder: Path, monkeypatch) -> None:
    monkeypatch.chdir(folder)
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    ran = synopses = 0
    for doc, line, curls in _lines():
        if curls is None or SYNOPSIS.search(line):
            synopses += 1
            continue
        words = _words(line)
        if words[0] == "make":
            target = next((w for w in words[1:] if "=" not in w), "run")
            assert target in targets, f"{doc}: {line}: no make target {target}"
            assert {w.split("=")[0] for w in words[1:] if "=" in w} <= MAKE_VARS, f"{doc}: {line}"
            ran += 1
            continue
        try:
            names, params = _parse(words[1:])
        except Exception as e:  # noqa: BLE001 - typer's own parse error, named with the line
            pytest.fail(f"{doc}: {line}: {e}")
        _check_files(words, params, curls, folder)
        _check_fields(names, params)
        ran += 1
    assert ran >= 30 and synopses >= 15, (ran, synopses)  # the docs' commands were found at all


def test_a_few_commands_of_the_docs_run_as_written(folder: Path, tmp_path: Path) -> None:
    tiny = [
        "--set",
        "train.max_steps=2",
        "--set",
        "train.eval_interval=2",
        "--set",
        "sample.max_new_tokens=5",
        "--storage",
        str(tmp_path / "storage"),
    ]
    run = "mllm-pipeline run --recipe smoke --source a.txt --source more/"
    others = ["mllm-pipeline runs --recipe warandpeace-lstm", "mllm-pipeline schedule list"]
    lines = {re.sub(r"\s+#.*", "", line).strip() for _, line, _ in _lines()}
    assert {run, *others} <= lines, {run, *others} - lines  # the docs still show them
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}  # its champion, no other test's
    out = cli(*_words(run)[1:], *tiny, cwd=folder, **store)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model: smoke v1 (promoted to champion" in out.stdout, out.stdout
    for line in others:
        out = cli(*_words(line)[1:], cwd=folder, **store)
        assert out.returncode == 0, (line, out.stderr[-3000:])
