"""Faults and bad input a user meets in the first week, each through the real CLI: the one line
it prints, its exit status, and what storage and the tracking store hold afterwards."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import prewarmed
import pytest
from commands import cli, one_line_error, temporary_server_home
from textdata import make_text

from mllm import UserError

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("case", ["a file", "under a file", "under /proc"])
def test_a_storage_root_that_cannot_be_a_writable_folder_fails_before_any_stage(case, corpus, own_stores, tmp_path):
    env, _, mlflow, _ = own_stores
    afile = tmp_path / "notes.txt"
    afile.write_text("not a folder")
    root = {"a file": afile, "under a file": afile / "storage", "under /proc": Path("/proc/mllm-storage")}[case]
    out = cli("run", "--recipe", "smoke", "--source", str(corpus), "--storage", str(root), env=env)
    line = one_line_error(out, f"storage root {root}", "--storage")
    assert ("a file, not a folder" in line) == (case != "under /proc")
    assert afile.read_text() == "not a folder"
    assert not (mlflow / "mlflow.db").exists()  # no run was started


def test_an_mlflow_server_that_is_down_fails_in_seconds_before_any_stage(corpus, own_stores):
    import socket
    import time

    env, _, _, storage = own_stores
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        env={**env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"},
    )
    took = time.monotonic() - started
    one_line_error(out, f"MLflow tracking server http://127.0.0.1:{port} does not answer", "MLFLOW_TRACKING_URI")
    assert "storage unreachable" not in out.stderr  # it blames the right server
    assert not (storage / "raw").exists()  # no stage ran
    assert took < 60, took  # not MLflow's minutes of retries (the figure itself is in README)


def test_a_tracking_uri_that_is_a_folder_is_refused_in_one_line_before_any_stage(corpus, own_stores, tmp_path):
    # MLflow 3's file store is in maintenance mode: MLflow itself refused it after the data stages, in a traceback.
    env, _, _, storage = own_stores
    out = cli("run", "--recipe", "smoke", "--source", str(corpus), env={**env, "MLFLOW_TRACKING_URI": str(tmp_path)})
    one_line_error(out, f"MLFLOW_TRACKING_URI={tmp_path} names a folder", "sqlite:///")
    assert not (storage / "raw").exists()  # no stage ran
    from tasks.tracking.store import check_not_a_folder

    for folder in ("file:///srv/mlruns", "./mlruns", str(tmp_path)):
        with pytest.raises(UserError, match="names a folder"):
            check_not_a_folder(folder)
    for uri in ("sqlite:///srv/mlflow.db", "http://127.0.0.1:5000", "https://mlflow.example", "databricks"):
        check_not_a_folder(uri)


def test_checkpoint_errors_name_the_real_cause(tmp_path, own_stores):
    from textdata import write_char_ids

    from mllm.config import RunConfig
    from mllm.train import train

    write_char_ids(tmp_path, 600)
    cfg = RunConfig.model_validate(
        {
            "model": {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 1, "dropout": 0.0},
            "train": {"max_steps": 2, "batch_size": 4, "window": 8, "eval_interval": 2, "eval_batches": 1},
            "paths": {
                "train_ids": str(tmp_path / "train.npy"),
                "val_ids": str(tmp_path / "val.npy"),
                "vocab": str(tmp_path / "vocab.json"),
                "checkpoint_dir": str(tmp_path / "ckpt"),
            },
        }
    )
    checkpoint = train(cfg).checkpoint
    if not __import__("torch").cuda.is_available():
        out = prewarmed.run(
            "mllm.sample", ["--checkpoint", checkpoint, "--prompt", "the ", "--device", "cuda"], timeout=120
        )
        line = one_line_error(out, "no CUDA GPU is visible", "cpu")
        assert "corrupt" not in line
    env, *_ = own_stores
    line = one_line_error(cli("sample", "--checkpoint", str(tmp_path / "ckpt"), env=env), "is a folder", "best.pt")
    assert "corrupt" not in line
    # A run folder: the hint names the checkpoints one level down, where they are.
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    line = one_line_error(cli("sample", "--checkpoint", str(tmp_path / "run"), env=env), "is a folder")
    assert f"{tmp_path / 'run' / 'checkpoints' / 'best.pt'}" in line


def test_a_failure_past_prefects_start_is_one_line_and_leaves_no_pickled_exception(own_stores, tmp_path):
    import re
    import sqlite3

    env, prefect, _, storage = own_stores
    env["PREFECT_API_URL"] = ""  # a temporary server in `prefect`, whose database is read below
    temporary_server_home(prefect)  # a user's home after their first run: its database exists
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab ab\n")  # tokenizes, but is too short to split: fails in the fourth stage
    out = cli("prepare", "--recipe", "smoke", "--source", str(tiny), env=env)
    line = one_line_error(out, "too few for a 0.1 validation split")
    # Prefect's lines about the failure stay off the terminal ...
    assert out.stderr.count("too few for a 0.1 validation split") == 1, out.stderr
    assert "Stopping temporary server" not in out.stderr
    # ... and in its run record.
    with sqlite3.connect(prefect / "prefect.db") as db:
        logged = db.execute("SELECT count(*) FROM log WHERE message LIKE '%too few for a 0.1%'").fetchone()[0]
    assert logged >= 1, line
    # The finished stages' cache records stay; no exception is left pickled under a random name.
    left = sorted(p.name for p in (storage / "prefect-results").iterdir())
    assert left and all(re.fullmatch(r"[a-z_]+-[0-9a-f]{16}", name) for name in left), left


def test_a_worker_with_other_training_code_refuses_the_job_naming_both_commits():
    from flows.training import train
    from mllm import UserError
    from tasks.model.train import training_code

    caller = {"digest": "0123456789abcdef", "commit": "c0ffee0000000000000000000000000000000000"}
    ours = training_code()
    with pytest.raises(UserError) as e:
        train.fn(cfg=None, data=None, root="unused", code=caller)  # refused before it reads anything
    message = str(e.value)
    assert caller["commit"] in message and ours["commit"] in message and "\n" not in message


def test_runs_from_an_image_record_its_commit_and_reproduce_names_changed_versions(monkeypatch):
    from tasks.tracking import provenance

    monkeypatch.setattr(
        provenance,
        "git_info",
        lambda path=".": {"commit": None, "branch": None, "dirty": None, "diff": None, "remote": None},
    )
    monkeypatch.setenv("MLLM_GIT_COMMIT", "d" * 40)  # infra/Dockerfile's build argument
    assert provenance.code_git_info()["commit"] == "d" * 40
    tags = {**provenance.versions(), "version.torch": "0.0.1", "git.commit": "x"}
    assert provenance.version_changes(tags) == {"torch": ("0.0.1", provenance.version("torch"))}


# --- the third round: Ctrl-C, a tracking server that is down, content checked before Prefect ----


def _first_checkpoint(storage: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not list(storage.glob("runs/*/checkpoints/last.pt")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never wrote its first checkpoint"
        time.sleep(0.2)


def _interruptible(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    # A process group of its own, as a terminal gives a command: the signal goes to the group.
    return prewarmed.start("flows.cli", args, {**os.environ, "COLUMNS": "200", **env}, new_session=True)


def test_ctrl_c_cancels_the_run_in_seconds_and_the_same_command_resumes(own_stores, tmp_path):
    import signal
    import sqlite3
    import time

    from mlflow.tracking import MlflowClient

    env, prefect, _, storage = own_stores
    env["PREFECT_API_URL"] = ""  # a temporary server in `prefect`, whose database is read below
    temporary_server_home(prefect)  # a user's home after their first run: its database exists
    # A corpus with no "T" (the smoke recipe prompts "The "): the run that resumes also shows that
    # such a corpus still trains, samples and registers, without a run of its own.
    corpus = tmp_path / "lower.txt"
    corpus.write_text(make_text().lower())
    # The first checkpoint says training runs; 350 steps after it leave seconds to interrupt it. A
    # checkpoint every 50 steps, not 5: the run that resumes writes 7 rather than 79 (4 s here).
    args = [
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--set",
        "train.max_steps=400",
        "--set",
        "train.checkpoint_interval=50",
        "--set",
        "train.eval_interval=400",
    ]
    proc = _interruptible(args, env)
    _first_checkpoint(storage, proc)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if "error" in line.lower()] == [
        "error: interrupted: finished stages and the last checkpoint are kept; run the same command to continue "
        "from them"
    ], stderr[-3000:]
    assert "storage unreachable" not in stderr and "Crash detected" not in stderr
    assert took < 15, (
        took
    )  # seconds, not the minutes of a client retrying a dead server (docs/cli.md: within 15 s at load 12)
    with sqlite3.connect(prefect / "prefect.db") as db:
        states = dict(
            db.execute(
                "SELECT f.name, r.state_type FROM flow_run r JOIN flow f ON f.id = r.flow_id "
                "WHERE f.name IN ('pipeline', 'train')"
            ).fetchall()
        )
    assert states == {"pipeline": "CANCELLED", "train": "CANCELLED"}
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run.info.status == "KILLED"

    session = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}  # the session's server
    again = cli(*args, env=session)
    assert again.returncode == 0, again.stderr[-3000:]
    trained = json.loads(next(storage.glob("runs/*/trained.json")).read_text())
    assert trained["steps"] == 400 and trained["resumed_from_step"] >= 5

    # The corpus lacks a character of the recipe's prompt: the run left it out of its samples, and
    # registered its model all the same.
    assert "model: smoke v1 (promoted to champion" in again.stdout
    assert "the vocabulary lacks 'T'" in again.stderr
    [samples] = storage.glob("runs/*/samples/greedy.txt")
    assert samples.read_text().startswith("--- prompt 'he '\nhe ")
    # A prompt the user gives keeps its clear error.
    [checkpoint] = storage.glob("runs/*/checkpoints/best.pt")
    line = one_line_error(
        cli("sample", "--checkpoint", str(checkpoint), "--prompt", "The ", env=session),
        "the prompt has characters that are not in the model's vocabulary: 'T' (its "
        "training corpus, normalised as the prompt was, had none of them)",
    )
    assert "leave them out of the prompt" in line


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(corpus, own_stores):
    import signal
    import time

    env, _, _, storage = own_stores
    proc = _interruptible(
        [
            "run",
            "--recipe",
            "smoke",
            "--source",
            str(corpus),
            "--set",
            "train.max_steps=400",
            "--set",
            "train.checkpoint_interval=5",
        ],
        env,
    )
    _first_checkpoint(storage, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    assert time.monotonic() - sent < 10


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_kill_9_to_the_command_ends_its_temporary_prefect_server_too(tmp_path):
    # The temporary server leads a process group of its own (a group SIGTERM must not reach it), so
    # after a SIGKILL of the command nothing stops it: it must notice its parent's end itself. Here
    # it is started as flows/cli/temporary_start.py starts Prefect's (`python -m uvicorn ...`), serving a
    # tiny app: seconds, where a real command's temporary server costs 30 s more of the suite.
    import signal
    import sys
    import time
    import urllib.request

    from flows.stack.processes import free_port

    (tmp_path / "tiny.py").write_text(
        "async def app(scope, receive, send):\n"
        "    if scope['type'] == 'http':\n"
        "        await send({'type': 'http.response.start', 'status': 200, 'headers': []})\n"
        "        await send({'type': 'http.response.body', 'body': b'ok'})\n"
    )
    port = free_port()
    command = (
        "import sys, time\nfrom flows.cli.temporary_start import _InItsOwnGroup\n"
        "server = _InItsOwnGroup.Popen(args=[sys.executable, '-m', 'uvicorn', '--app-dir', sys.argv[1], "
        "'tiny:app', '--port', sys.argv[2], '--log-level', 'error'])\n"
        "print(server.pid, flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", command, str(tmp_path), str(port)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server = int(proc.stdout.readline())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                opener.open(f"http://127.0.0.1:{port}/", timeout=1).close()
                break
            except OSError:
                assert _alive(server) and time.monotonic() < deadline, "the server never answered"
                time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # the command's whole group: the server is not in it
        proc.wait(timeout=10)
        assert _alive(server)
        killed = time.monotonic()
        while _alive(server) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not _alive(server), "the server outlived the command that started it"
    finally:
        for pid in (proc.pid, server):
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_every_command_that_reads_runs_says_when_nothing_is_tracked_there_and_creates_no_store(tmp_path):
    # No MLFLOW_TRACKING_URI: the store would be mlflow.db beside the storage root, which no run made.
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    root = tmp_path / "elsewhere" / "storage"
    for args in (
        ["runs"],
        ["lineage", "smoke@champion"],
        ["sample", "--model", "smoke@champion"],
        ["reproduce", "0" * 32],
    ):
        out = prewarmed.run("flows.cli", [*args, "--storage", str(root)], env=env, cwd=tmp_path, timeout=120)
        one_line_error(
            out, f"the MLflow store {tmp_path / 'elsewhere' / 'mlflow.db'} (beside the storage root) does not exist"
        )
        assert "INFO" not in out.stderr, out.stderr  # no MLflow lines about creating tables
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "mlflow.db").exists()


def test_every_command_that_reads_the_tracking_server_fails_in_seconds_when_it_is_down(own_stores):
    import socket
    import time

    env, *_ = own_stores
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = {**env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
    for args in (
        ["runs"],
        ["runs", "--json"],
        ["sample", "--model", "smoke@champion"],
        ["sample", "--run", "0" * 32],
        ["reproduce", "0" * 32],
    ):
        started = time.monotonic()
        out = cli(*args, env=down)
        one_line_error(out, f"MLflow tracking server http://127.0.0.1:{port} does not answer")
        assert "storage unreachable" not in out.stderr and time.monotonic() - started < 60, args


@pytest.mark.parametrize("what", ["text", "config.yaml", "random bytes", "truncated"])
def test_sampling_a_file_that_is_no_checkpoint_is_one_line(what, tmp_path, own_stores):
    import yaml

    env, *_ = own_stores
    path = tmp_path / "file"
    if what == "text":
        path.write_text("hello world, this is no checkpoint\n")
    elif what == "config.yaml":
        path.write_text(yaml.safe_dump({"model": {"arch": "lstm"}, "train": {"max_steps": 3}}))
    elif what == "random bytes":
        path.write_bytes(os.urandom(4096))
    else:
        import torch

        buf = __import__("io").BytesIO()
        torch.save({"model": {}, "step": 1}, buf)
        path.write_bytes(buf.getvalue()[:200])
    needle = "truncated or corrupt" if what == "truncated" else "is not a checkpoint"
    one_line_error(cli("sample", "--checkpoint", str(path), "--prompt", "the", env=env), needle)
    out = prewarmed.run("mllm.sample", ["--checkpoint", str(path), "--prompt", "the"], timeout=120)
    one_line_error(out, needle)


CONTENT_CASES = [
    "empty",
    "white space",
    "binary",
    "latin-1",
    "utf-16 without bom",
    "sha256",
    "damaged gzip",
    "tsv without a pair",
    "cuda device",
]


@pytest.mark.parametrize("case", CONTENT_CASES)
def test_a_bad_file_is_one_line_before_prefect_starts(case, own_stores, tmp_path):
    import gzip

    env, prefect, _, storage = own_stores
    # One case with no server named: no temporary one may start, `prefect` stays empty (a command
    # in a new interpreter, tests/prewarmed.py). The rest name a port nothing listens on: a check
    # made after Prefect's start would end on "does not answer" instead of the file's fault.
    env["PREFECT_API_URL"] = "" if case == "empty" else "http://127.0.0.1:9/api"
    src, recipe, extra = tmp_path / "corpus.txt", "smoke", []
    text = make_text(300).encode()
    if case == "empty":
        src.write_bytes(b"")
    elif case == "white space":
        src.write_bytes(b"  \r\n\r\n\t \n")
    elif case == "binary":
        src.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 50)
    elif case == "latin-1":
        src.write_bytes("Un café à Moscou.\n".encode("latin-1") * 10)
    elif case == "utf-16 without bom":
        src.write_bytes(make_text(300).encode("utf-16-le"))
    elif case == "sha256":
        src.write_bytes(text)
        extra = ["--set", "data.sha256=" + "0" * 64]
    elif case == "damaged gzip":
        src = tmp_path / "corpus.txt.gz"
        src.write_bytes(gzip.compress(text)[:100])
    elif case == "tsv without a pair":
        src, recipe = tmp_path / "pairs.tsv", "seq2seq-smoke"
        src.write_text("one column only\nanother\n")
    elif case == "cuda device":
        if __import__("torch").cuda.is_available():
            pytest.skip("this machine has a CUDA GPU")
        src.write_bytes(text)
        extra = ["--set", "train.device=cuda"]
    needle = {
        "empty": "is empty",
        "white space": "only white space",
        "binary": "binary",
        "latin-1": "not UTF-8",
        "utf-16 without bom": "UTF-16",
        "sha256": "0" * 64,
        "damaged gzip": "gzip-compressed",
        "tsv without a pair": "no valid pair",
        "cuda device": "no CUDA GPU",
    }[case]
    out = cli("run", "--recipe", recipe, "--source", str(src), *extra, env=env)
    one_line_error(out, needle)
    # Found before Prefect started: not one of its lines, no database, no stage output.
    assert "Flow run" not in out.stderr and "temporary server" not in out.stderr, out.stderr
    assert "does not answer" not in out.stderr, out.stderr
    assert not (prefect / "prefect.db").exists()
    assert not any((storage / stage).exists() for stage in ("raw", "tokens", "pairs"))


def test_a_compressed_source_is_decompressed(own_stores, tmp_path):
    # Each compression through the download stage's own function; one through the CLI, which
    # stores the text under the digest of the file as given and records its compression.
    import hashlib

    import pyarrow as pa

    from mllm.data.corpus import download

    env, _, _, storage = own_stores
    text = make_text(400).encode()
    packers = {
        "gzip": __import__("gzip").compress,
        "bzip2": __import__("bz2").compress,
        "xz": __import__("lzma").compress,
        "zstd": lambda b: pa.compress(b, codec="zstd", asbytes=True),
    }
    for name, pack in packers.items():
        packed = pack(text)
        src = tmp_path / f"corpus.txt.{name}"
        src.write_bytes(packed)
        got = download(str(src), lambda sha: str(tmp_path / "direct" / f"{sha}.txt"))
        sha = hashlib.sha256(packed).hexdigest()  # what sha256sum prints for the file as given
        assert (got.compression, got.sha256) == (name, sha)
        assert (tmp_path / "direct" / f"{sha}.txt").read_bytes() == text
    out = cli("prepare", "--recipe", "smoke", "--source", str(src), env=env)  # the last one: zstd
    assert out.returncode == 0, out.stderr[-3000:]
    assert (storage / "raw" / f"{sha}.txt").read_bytes() == text
    assert json.loads((storage / "raw" / f"{sha}.json").read_text())["compression"] == "zstd"


def test_two_runs_of_one_training_at_once_on_a_new_tracking_store_train_it_once(corpus, own_stores, tmp_path):
    # Both commands also meet a tracking store that does not exist yet: each creates its tables
    # and the `smoke` experiment, or finds the other's, and neither fails of that race.
    from mlflow.tracking import MlflowClient

    env, _, _, storage = own_stores
    args = ["run", "--recipe", "smoke", "--source", str(corpus), "--set", "train.max_steps=60", "--force"]
    procs = [
        prewarmed.start("flows.cli", args, {**os.environ, **env, "PREFECT_HOME": str(tmp_path / f"prefect-{i}")})
        for i in range(2)
    ]
    for p, (stdout, stderr) in zip(procs, [p.communicate(timeout=600) for p in procs]):
        assert p.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr and "val loss" in stdout
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    # One trained from scratch; the other waited, then found that training finished.
    assert sorted(int(r.data.tags["train.resumed_from_step"]) for r in runs) == [0, 60]
    assert len(list(storage.glob("runs/*/checkpoints/last.pt"))) == 1


def test_flags_show_as_flags_and_sample_takes_a_device(own_stores):
    env, *_ = own_stores
    for command in ("runs", "run", "sample", "schedule"):
        out = cli(command, "--help", env=env)
        assert out.returncode == 0 and "<bool>" not in out.stdout, out.stdout
    assert "--device" in cli("sample", "--help", env=env).stdout
    out = cli("recipes", env=env)
    # A seq2seq RNN's size is its layers x hidden size, as the language models' read.
    [smoke] = [line.split() for line in out.stdout.splitlines() if line.startswith("seq2seq-smoke ")]
    assert smoke[1:6] == ["seq2seq-rnn", "word", "->", "char", "1x32"], out.stdout


def test_a_prefect_server_that_does_not_answer_is_named_not_blamed_on_storage(corpus, own_stores):
    # Prefect's client (httpx) meeting no server once read "storage unreachable": the one line names
    # the Prefect server instead, and what to do.
    import socket

    env, _, _, storage = own_stores
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--set",
        "train.max_steps=5",
        env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
        timeout=300,
    )
    one_line_error(out, f"the Prefect server http://127.0.0.1:{port}/api does not answer", "stack up")
    assert "storage unreachable" not in out.stderr
    assert not (storage / "runs").exists()  # nothing trained
