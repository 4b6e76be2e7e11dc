"""The CLI as a user meets it: help, recipes, and one-line errors for bad input."""

from __future__ import annotations

import functools
import http.server
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from commands import cli
from textdata import make_text

pytestmark = pytest.mark.integration


@pytest.fixture
def http_root(tmp_path: Path):
    """A real HTTP server on loopback serving a folder."""
    folder = tmp_path / "www"
    folder.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def _no_outputs(root: Path) -> None:
    """Nothing half-written: no stage folder, and no temporary leftovers."""
    if not root.exists():
        return
    for stage in ("raw", "tokens", "vocab", "splits", "runs"):
        d = root / stage
        assert not d.exists() or not any(d.iterdir()), list(d.iterdir())


def test_help_lists_every_command() -> None:
    out = cli("--help")
    assert out.returncode == 0
    for command in ("run", "prepare", "train", "evaluate", "sample", "recipes"):
        assert command in out.stdout
    out = cli("run", "--help")
    assert "--recipe" in out.stdout and "--set" in out.stdout and "--storage" in out.stdout


def test_help_names_values_plainly_and_says_what_storage_means_where_it_means_something() -> None:
    import re

    from typer.testing import CliRunner

    from flows.cli.main import app

    def helps(*command: str) -> str:
        out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "1000"}, catch_exceptions=False)
        assert out.exit_code == 0, out.output
        return re.sub(r"[\s│]+", " ", out.output)  # rich's boxes and wrapping

    skips = "a run skips training only when this root holds the finished training"
    commands = {
        ("run",): True,
        ("train",): True,
        ("evaluate",): True,
        ("sweep",): True,
        ("search",): True,
        ("schedule",): True,
        ("prepare",): False,
        ("sample",): False,
        ("runs",): False,
        ("lineage",): False,
        ("reproduce",): False,
        ("export",): False,
        ("stack", "up"): False,
    }
    for command, trains in commands.items():
        text = helps(*command)
        assert "--storage URL" in text and (skips in text) == trains, (command, text)
        assert "list[str]" not in text and "{" not in text, (command, text)
    assert "reproduce [OPTIONS] RUN_ID " in helps("reproduce")
    assert "export [OPTIONS] MODEL " in helps("export") and "--format FORMAT" in helps("export")
    assert "add [OPTIONS] NAME " in helps("stack", "user", "add") and "{" not in helps("stack", "user", "add")
    assert "--set FIELD=VALUE" in helps("run") and "--tag KEY=VALUE" in helps("run")
    # `runs`: every column has its header, the model's LoggedModel id too.
    from mlflow.tracking import MlflowClient

    from tasks.tracking.provenance import process_tag

    tracking = MlflowClient()
    experiment = tracking.create_experiment("smoke")
    run = tracking.create_run(experiment, tags={"model_id": "m-0123abcd"})
    tracking.set_terminated(run.info.run_id, "KILLED")
    # A run whose process was killed with no word (kill -9) is RUNNING in MLflow: listed KILLED.
    sleeper = subprocess.Popen(["sleep", "60"])
    tag = process_tag(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    tracking.create_run(experiment, tags={"process": tag, "reproduces": "0123456789" * 3 + "ab"})
    tracking.create_run(experiment, tags={"process": process_tag()})  # this process: running indeed
    out = CliRunner().invoke(app, ["runs"], catch_exceptions=False)
    header, *rows = out.output.splitlines()
    assert header.split()[-3:] == ["started", "model", "reproduces"], out.output
    status = header.index("status")
    assert [r[status:].split()[0] for r in rows] == ["RUNNING", "KILLED", "KILLED"], out.output
    assert rows[1].endswith("  01234567") and rows[2].split()[-2:] == ["m-0123abcd", "-"], out.output
    assert rows[1].index("01234567") == header.index("reproduces"), out.output
    assert rows[2].index("m-0123abcd") == header.index("model"), out.output
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and re.fullmatch(r"mllm-pipeline \d+\.\d+\.\d+\S*\n", out.output), out.output
    # Every code block of the docs is closed: a stray fence turns the rest of a page into code.
    docs = Path(__file__).resolve().parents[2]
    for page in [docs / "README.md", *(docs / "docs").glob("*.md")]:
        fences = [line for line in page.read_text().splitlines() if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, page


def test_the_terminals_quiet_after_a_mistake_leaves_other_logging_handlers_alone(caplog) -> None:
    """After a user's mistake the terminal drops Prefect's lines from its console, and only there:
    a handler someone else put on the root logger (here pytest's, which lives for the session)
    still gets every line. It used to get the filter too, and a test after any in-process mistake
    saw no log line at all."""
    import logging

    from flows.cli import terminal
    from mllm import UserError

    terminal.flows_module()  # imports Prefect, whose logging set-up replaces the root's handlers
    if caplog.handler not in logging.root.handlers:  # where pytest puts it in every later test
        logging.root.addHandler(caplog.handler)
    terminal.flows_module()  # what a command run in this process does: the filter goes on
    log = logging.getLogger("prefect.mllm-test")  # to the terminal through the root's handlers, as Prefect's lines go
    with caplog.at_level(logging.INFO, logger=log.name):
        log.error("Finished in state Failed('UserError: bad input')", exc_info=(UserError, UserError("bad"), None))
        log.info("a line after the mistake")
    assert terminal._quiet.failed  # the console is quiet from now on
    assert "a line after the mistake" in caplog.text


def test_recipes_lists_the_shipped_recipes() -> None:
    out = cli("recipes")
    assert out.returncode == 0
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    for name in (
        "warandpeace-lstm",
        "warandpeace-gpt",
        "shakespeare-gpt",
        "smoke",
        "default",
        "cbow",
        "seq2seq-numbers-rnn",
        "seq2seq-numbers-transformer",
        "seq2seq-smoke",
    ):
        assert name in lines
    assert lines["shakespeare-gpt"][1:] == ["gpt", "char", "6x6x384", "5000", "steps"]
    assert lines["default"][1:] == ["gpt", "char", "4x4x128", "10", "min"]  # a time budget (docs/speed.md)
    assert lines["seq2seq-numbers-transformer"][1:6] == ["seq2seq-transformer", "word", "->", "bpe", "2+2x4x128"]
    assert lines["seq2seq-numbers-rnn"][5] == "2x256"  # its encoder's hidden size, as README says


def test_unknown_recipe_and_malformed_set(tmp_path: Path) -> None:
    _assert_one_line_error(cli("run", "--recipe", "nope", "--storage", str(tmp_path)), "nope", "smoke")
    _assert_one_line_error(cli("run", "--recipe", "smoke", "--set", "train.lr"), "train.lr", "section.field=value")
    _assert_one_line_error(cli("run", "--recipe", "smoke", "--set", "train.lrr=1"), "train.lrr", "unknown field")
    _assert_one_line_error(cli("run", "--recipe", "smoke", "--set", "train.lr=-1"), "train.lr")
    _assert_one_line_error(
        cli("run", "--recipe", "smoke", "--model", "a/b"),
        "--model 'a/b' is not a model name",
        "e.g. --model stdlib-smoke",
    )


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "latin1", "sha256"])
def test_bad_sources_fail_with_one_line_and_leave_nothing(case: str, tmp_path: Path) -> None:
    src = tmp_path / "corpus.txt"
    extra: list[str] = []
    if case == "empty":
        src.write_bytes(b"")
    elif case == "binary":
        src.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 50)
    elif case == "latin1":
        src.write_bytes("Un café à Moscou, déjà vu.\n".encode("latin-1") * 10)
    elif case == "sha256":
        src.write_text(make_text(200), encoding="utf-8")
        extra = ["--set", "data.sha256=" + "0" * 64]
    root = tmp_path / "storage"
    out = cli("run", "--recipe", "smoke", "--source", str(src), "--storage", str(root), *extra)
    needles = {
        "missing": ["not found", "corpus.txt"],
        "empty": ["empty"],
        "binary": ["binary"],
        "latin1": ["UTF-8", "offset"],
        "sha256": ["sha256", "0" * 64],
    }[case]
    _assert_one_line_error(out, *needles)
    assert not root.exists()  # the source is checked before the storage folder is made


def test_unreachable_url_names_it_and_the_fix(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/warandpeace.txt"
    root = tmp_path / "storage"
    out = cli("run", "--recipe", "smoke", "--source", url, "--storage", str(root))
    _assert_one_line_error(out, url, "SOURCE=")
    assert not root.exists()


def test_http_source_downloads_and_missing_url_fails(http_root, tmp_path: Path) -> None:
    folder, base = http_root
    (folder / "corpus.txt").write_text(make_text(), encoding="utf-8")
    root = tmp_path / "storage"
    # An empty PREFECT_API_URL (as `export PREFECT_API_URL=` leaves it) names no server: the
    # temporary one runs the flows, and no line of the run is an error.
    out = cli(
        "prepare", "--recipe", "smoke", "--source", f"{base}/corpus.txt", "--storage", str(root), PREFECT_API_URL=""
    )
    assert out.returncode == 0, out.stderr
    assert "vocabulary" in out.stdout
    assert [line for line in out.stderr.splitlines() if "| ERROR" in line] == []
    assert len(list((root / "raw").glob("*.txt"))) == 1

    out = cli("prepare", "--recipe", "smoke", "--source", f"{base}/nothing.txt", "--storage", str(tmp_path / "s2"))
    _assert_one_line_error(out, f"{base}/nothing.txt", "not found")


def test_unknown_work_pool_and_schedule_without_a_server(corpus: Path, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    out = cli("run", "--recipe", "smoke", "--source", str(corpus), "--storage", str(root), "--train-on", "no-such-pool")
    _assert_one_line_error(out, "work pool 'no-such-pool' not found", "prefect work-pool create")
    _no_outputs(root)  # refused before any stage ran

    out = cli("schedule", "--recipe", "smoke", "--cron", "0 3 * * 0", PREFECT_API_URL="")  # no server named
    _assert_one_line_error(out, "set PREFECT_API_URL", "stack up")

    # A scheduled source would keep its password in the deployment, in Prefect's database: refused.
    out = cli(
        "schedule",
        "--recipe",
        "smoke",
        "--cron",
        "0 3 * * 0",
        "--source",
        "https://reader:s3cr3t-Pw@127.0.0.1:9/corpus.txt",
    )
    _assert_one_line_error(out, "cannot carry a user:password", "~/.netrc")
    assert "s3cr3t-Pw" not in out.stdout + out.stderr
    # Likewise a URL with a password given as an override or as the storage root.
    for option, value in (
        ("--set", "data.source=https://reader:s3cr3t-Pw@127.0.0.1:9/corpus.txt"),
        ("--storage", "https://reader:s3cr3t-Pw@127.0.0.1:9/storage"),
    ):
        out = cli("schedule", "--recipe", "smoke", "--cron", "0 3 * * 0", option, value)
        _assert_one_line_error(out, f"scheduled {option} cannot carry a user:password", "~/.netrc")
        assert "s3cr3t-Pw" not in out.stdout + out.stderr


def test_a_field_of_another_model_family_is_refused_in_one_line(tmp_path: Path) -> None:
    out = cli("run", "--recipe", "smoke", "--set", "model.n_head=8", "--storage", str(tmp_path / "s"))
    _assert_one_line_error(out, "model.n_head: a field of the gpt and sequence-to-sequence families, not of arch lstm")
    _no_outputs(tmp_path / "s")


def test_the_training_key_digests_the_chosen_family_only(tmp_path: Path) -> None:
    """An LSTM recipe's model section holds recurrent fields only: a GPT field in its file is
    refused, so nothing of another family can change its training key."""
    import yaml

    from mllm import UserError
    from mllm.config import RecurrentConfig
    from mllm.resolve import recipe_dict, resolve

    recipe = recipe_dict("smoke")
    key_fields = resolve("smoke").model.model_dump()
    assert set(key_fields) == set(RecurrentConfig.model_fields) and "n_head" not in key_fields
    recipe["model"]["block_size"] = 128
    path = tmp_path / "lstm-with-gpt-field.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(UserError, match=r"model\.block_size: a field of the gpt family, not of arch lstm"):
        resolve(config_file=str(path))
    # The same file as a GPT keeps its GPT fields and drops the recurrent ones from the key.
    recipe["model"] = {"arch": "gpt", "n_embd": 32, "n_head": 4, "block_size": 64}
    path.write_text(yaml.safe_dump(recipe))
    assert "hidden_size" not in resolve(config_file=str(path)).model.model_dump()


@pytest.mark.parametrize("case", ["empty folder", "utf16-without-bom"])
def test_empty_folder_and_utf16_without_bom_fail_with_one_line_and_leave_nothing(case: str, tmp_path: Path) -> None:
    if case == "empty folder":
        src = tmp_path / "books"
        src.mkdir()
        (src / ".hidden.txt").write_text(make_text(200), encoding="utf-8")
        needles = ["only hidden or marker files", str(src)]
    else:
        src = tmp_path / "corpus.txt"
        src.write_bytes(make_text(200).encode("utf-16-le"))
        needles = ["UTF-16", "iconv -f utf-16le -t utf-8"]
    root = tmp_path / "storage"
    out = cli("prepare", "--recipe", "smoke", "--source", str(src), "--storage", str(root))
    _assert_one_line_error(out, *needles)
    assert "binary" not in out.stderr and "not found" not in out.stderr
    _no_outputs(root)


def test_utf16_file_of_three_gutenberg_books_is_converted_and_keeps_every_book(tmp_path: Path) -> None:
    import codecs
    import hashlib
    import json

    import pyarrow.parquet as pq

    bodies = [
        f"\r\nCHAPTER I\r\n\r\n{w} was here. " * 40 + f"\r\nThe end of {w}.\r\n"
        for w in ("Natasha", "Hamlet", "Ishmael")
    ]
    text = "".join(
        f"The Project Gutenberg eBook of {t}\r\n*** START OF THE PROJECT GUTENBERG EBOOK {t} ***\r\n{b}"
        f"*** END OF THE PROJECT GUTENBERG EBOOK {t} ***\r\nSection 1. Licence terms.\r\n"
        for t, b in zip(("WAR", "HAMLET", "MOBY"), bodies)
    )
    src = tmp_path / "books.txt"
    src.write_bytes(codecs.BOM_UTF16_LE + text.encode("utf-16-le"))
    sha = hashlib.sha256(src.read_bytes()).hexdigest()  # a pinned data.sha256 is the file's, as sha256sum says
    root = tmp_path / "storage"
    out = cli(
        "prepare", "--recipe", "smoke", "--source", str(src), "--storage", str(root), "--set", f"data.sha256={sha}"
    )
    assert out.returncode == 0, out.stderr
    assert "UTF-16-LE: stored converted to UTF-8" in out.stdout + out.stderr
    assert (root / "raw" / f"{sha}.txt").read_bytes() == text.encode("utf-8")
    assert json.loads((root / "raw" / f"{sha}.json").read_text())["encoding"] == "utf-16-le"
    (tokens,) = (root / "tokens").iterdir()
    kept = "".join(t for row in pq.read_table(tokens / "part-0.parquet").column("tokens").to_pylist() for t in row)
    for w in ("Natasha", "Hamlet", "Ishmael"):
        assert kept.count(f"{w} was here.") == 40 and f"The end of {w}." in kept
    assert "Gutenberg" not in kept and "Licence" not in kept and "CHAPTER I" in kept


def test_a_recipe_names_its_default_work_pool_outside_the_run_config(tmp_path: Path, monkeypatch) -> None:
    """`pipeline: {pool: NAME}` in a recipe is where it trains by default, not what the run is."""
    import yaml

    from flows import launch
    from mllm.resolve import recipe_dict, resolve

    recipe = {**recipe_dict("smoke"), "pipeline": {"pool": "gpu"}}
    path = tmp_path / "pooled.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert "pipeline" not in resolve(config_file=str(path)).to_dict()
    monkeypatch.setattr(launch, "recipe_dict", lambda name: recipe)
    assert launch.training_pool("smoke", None) == "gpu"
    assert launch.training_pool("smoke", "local") == "local"  # --train-on wins
    monkeypatch.setattr(launch, "recipe_dict", recipe_dict)
    assert launch.training_pool("smoke", None) is None


def test_a_storage_root_through_a_symlink_is_named_by_its_real_folder(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    printed = []
    for root in ("link", "real"):  # the second finds every stage cached by the first
        out = cli(
            "prepare",
            "--recipe",
            "smoke",
            "--source",
            str(corpus),
            "--storage",
            str(tmp_path / root),
            MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
        )
        assert out.returncode == 0, out.stderr[-3000:]
        printed.append([line.split()[-1] for line in out.stdout.splitlines()[1:]])
    assert printed[0] == printed[1]
    assert all(path.startswith(str(tmp_path / "real") + "/") for path in printed[0]), printed


def test_sample_normalises_the_prompt_as_the_corpus_was_and_names_what_it_never_had(
    corpus: Path, tmp_path: Path
) -> None:
    """The smoke recipe's char tokenizer normalised ':', quotes, newlines and accents out of the
    corpus: a prompt holding them is sampled as the corpus would have read it, and what the corpus
    never had (here 'j', 'z' and digits) is named in one line."""
    root = tmp_path / "storage"
    out = cli(
        "train", "--recipe", "smoke", "--source", str(corpus), "--storage", str(root), "--set", "train.max_steps=4"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [checkpoint] = root.glob("runs/*/checkpoints/best.pt")
    out = cli(
        "sample",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "Pierre:\n  'war' café",
        "--max-new-tokens",
        "5",
        "--method",
        "greedy",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Pierre war caf") and len(out.stdout.rstrip("\n")) == len("Pierre war caf") + 5
    out = cli("sample", "--checkpoint", str(checkpoint), "--prompt", "Jazz: 42 'x'", "--method", "greedy")
    _assert_one_line_error(
        out,
        "characters that are not in the model's vocabulary: 'J' 'z' '4' '2' 'x'",
        "training corpus, normalised as the prompt was, had none of them",
        "leave them out of the prompt",
    )
    assert "':'" not in out.stderr and '"\'"' not in out.stderr


def test_a_first_run_at_a_terminal_prints_the_progress_and_the_outcome_and_nothing_else(
    corpus: Path, tmp_path: Path
) -> None:
    """A fresh Prefect home and MLflow store, a storage path with a space, progress bars drawn as
    at a terminal: no MLflow table creation lines, no asset-key warnings, no Prefect line through
    the bars; stderr is the bars, stdout the outcome."""
    root = tmp_path / "my storage"
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        str(root),
        "--model",
        "terminal-smoke",
        "--set",
        "train.max_steps=4",
        MLLM_PROGRESS="1",
        PREFECT_HOME=str(tmp_path / "prefect"),
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}",
        PREFECT_API_URL="",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "fresh" / "mlflow.db").exists() and list(root.glob("runs/*/checkpoints/best.pt"))
    # On a loaded machine (the suite's own workers) the training says so, and when it changes its
    # threads: notices the terminal keeps (issue 64), not noise.
    notice = ("the machine was busy", " - threads: ")
    stderr = "\n".join(line for line in out.stderr.splitlines() if not any(n in line for n in notice))
    printed = out.stdout + stderr
    for noise in (
        "MLflow database tables",
        "Updating database tables",
        "alembic",
        "asset key",
        "| INFO",
        "| WARNING",
        "Stopping temporary server",
        "Traceback",
    ):
        assert noise not in printed, (noise, printed)
    bars = [line.split()[0] for line in stderr.splitlines() if line.strip()]
    assert set(bars) == {"download", "tokenize", "train"}, out.stderr
    assert "model: terminal-smoke v1 (promoted to champion" in out.stdout, out.stdout
    assert f"checkpoint: {root}/runs/" in out.stdout

    # Run again: the stages reused say nothing (no Prefect "Finished in state Cached" line), the
    # model named as before is found, and the outcome says why nothing trained. (On the session's
    # Prefect server: the stages' cache is in PREFECT_HOME, and a second temporary server would
    # show nothing the first did not.)
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        str(root),
        "--model",
        "terminal-smoke",
        "--set",
        "train.max_steps=4",
        MLLM_PROGRESS="1",
        PREFECT_HOME=str(tmp_path / "prefect"),
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert {line.split()[0] for line in lines} <= {"download", "tokenize", "train"}, out.stderr
    assert out.stdout.startswith("skipped: data, config and code unchanged")
    assert "champion: terminal-smoke v1" in out.stdout


def test_a_mistake_found_inside_the_flows_at_a_terminal_is_the_one_error_line(tmp_path: Path) -> None:
    """Found by a stage (too little text to split), after the bars were set up: stderr is the
    `error:` line alone, with no Prefect line and no blank line left by bars never drawn."""
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"b{i}.txt").write_text(make_text(1500, seed=i), encoding="utf-8")
    out = cli("run", "--recipe", "smoke", "--source", str(books), "--storage", str(tmp_path / "s"), MLLM_PROGRESS="1")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith("error: the corpus has 3 spans")
