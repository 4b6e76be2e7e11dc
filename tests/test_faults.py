"""Faults and bad input a user meets in the first week, each through the real CLI: the one line
it prints, its exit status, and what storage and the tracking store hold afterwards."""

from __future__ import annotations

import base64
import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import make_text

PASSWORD = "s3cr3t-Passw0rd-xyzzy"
TOKEN = "tok-9f8e7d6c5b4a-secret"


def cli(*args: str, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200", **env})


@pytest.fixture
def own_stores(tmp_path: Path) -> tuple[dict[str, str], Path, Path, Path]:
    """A Prefect home, an MLflow store and a storage root of this test's own."""
    prefect, mlflow, storage = tmp_path / "prefect", tmp_path / "mlflow", tmp_path / "storage"
    mlflow.mkdir()
    env = {"PREFECT_HOME": str(prefect), "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow / 'mlflow.db'}",
           "MLLM_STORAGE": str(storage)}
    return env, prefect, mlflow, storage


class _BasicAuth(http.server.SimpleHTTPRequestHandler):
    expected = ""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.headers.get("Authorization") != self.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="corpus"')
            self.end_headers()
            return
        super().do_GET()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def basic_auth_server(tmp_path: Path):
    """A real HTTP server on loopback that serves a folder only to reader:PASSWORD."""
    folder = tmp_path / "www"
    folder.mkdir()
    handler = type("Handler", (_BasicAuth,), {
        "expected": "Basic " + base64.b64encode(f"reader:{PASSWORD}".encode()).decode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, server.server_address[1]
    server.shutdown()
    server.server_close()


def _files_holding(needle: str, *folders: Path) -> list[str]:
    found = []
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() and needle.encode() in path.read_bytes():
                found.append(str(path))
    return found


def test_a_password_in_the_source_url_and_a_secret_tag_are_found_nowhere(basic_auth_server, own_stores):
    folder, port = basic_auth_server
    (folder / "corpus.txt").write_text(make_text(3000))
    env, prefect, mlflow, storage = own_stores
    source = f"http://reader:{PASSWORD}@127.0.0.1:{port}/corpus.txt"
    out = cli("run", "--recipe", "smoke", "--source", source, "--tag", f"token={TOKEN}",
              "--set", "train.max_steps=20", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "val loss" in out.stdout
    for secret in (PASSWORD, TOKEN):
        assert secret not in out.stdout + out.stderr
        assert _files_holding(secret, storage, mlflow, prefect) == []
    # The download did authenticate: the corpus is in storage, its source recorded without it.
    [meta] = (storage / "raw").glob("*.json")
    assert f"http://127.0.0.1:{port}/corpus.txt" in meta.read_text()

    # A bad URL with credentials: the error line names the URL, not the password.
    out = cli("prepare", "--recipe", "smoke", "--source", f"https://reader:{PASSWORD}@127.0.0.1:{port}/nope.txt",
              env=env)
    assert out.returncode == 2 and "error:" in out.stderr and PASSWORD not in out.stdout + out.stderr


def _one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("case", ["a file", "under a file", "under /proc"])
def test_a_storage_root_that_cannot_be_a_writable_folder_fails_before_any_stage(case, corpus, own_stores, tmp_path):
    env, _, mlflow, _ = own_stores
    afile = tmp_path / "notes.txt"
    afile.write_text("not a folder")
    root = {"a file": afile, "under a file": afile / "storage", "under /proc": Path("/proc/mllm-storage")}[case]
    out = cli("run", "--recipe", "smoke", "--source", str(corpus), "--storage", str(root), env=env)
    line = _one_line_error(out, f"storage root {root}", "--storage")
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
    out = cli("run", "--recipe", "smoke", "--source", str(corpus),
              env={**env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"})
    took = time.monotonic() - started
    _one_line_error(out, f"MLflow tracking server http://127.0.0.1:{port} does not answer", "MLFLOW_TRACKING_URI")
    assert "storage unreachable" not in out.stderr  # it blames the right server
    assert not (storage / "raw").exists()  # no stage ran
    assert took < 60, took  # not MLflow's minutes of retries (the figure itself is in README)


def test_two_runs_started_at_once_on_a_new_tracking_store_both_finish(corpus, own_stores, tmp_path):
    env, _, mlflow, _ = own_stores
    cmd = [sys.executable, "-m", "flows.cli", "run", "--recipe", "smoke", "--source", str(corpus),
           "--set", "train.max_steps=10"]
    procs = [subprocess.Popen([*cmd, "--storage", str(tmp_path / f"storage-{i}")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env, "PREFECT_HOME": str(tmp_path / f"prefect-{i}")})
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr and "val loss" in stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    assert len(client.search_model_versions("name = 'smoke'")) == 2


def test_checkpoint_errors_name_the_real_cause(tmp_path, own_stores):
    from conftest import write_char_ids
    from mllm.config import RunConfig
    from mllm.train import train

    write_char_ids(tmp_path, 600)
    cfg = RunConfig.model_validate({
        "model": {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 1, "dropout": 0.0},
        "train": {"max_steps": 2, "batch_size": 4, "window": 8, "eval_interval": 2, "eval_batches": 1},
        "paths": {"train_ids": str(tmp_path / "train.npy"), "val_ids": str(tmp_path / "val.npy"),
                  "vocab": str(tmp_path / "vocab.json"), "checkpoint_dir": str(tmp_path / "ckpt")}})
    checkpoint = train(cfg).checkpoint
    if not __import__("torch").cuda.is_available():
        out = subprocess.run([sys.executable, "-m", "mllm.sample", "--checkpoint", checkpoint, "--prompt", "the ",
                              "--device", "cuda"], capture_output=True, text=True, timeout=120)
        line = _one_line_error(out, "no CUDA GPU is visible", "cpu")
        assert "corrupt" not in line
    env, *_ = own_stores
    line = _one_line_error(cli("sample", "--checkpoint", str(tmp_path / "ckpt"), env=env), "is a folder", "best.pt")
    assert "corrupt" not in line


def test_a_failure_past_prefects_start_is_one_line_and_leaves_no_pickled_exception(own_stores, tmp_path):
    import re
    import sqlite3

    env, prefect, _, storage = own_stores
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab ab\n")  # tokenizes, but is too short to split: fails in the fourth stage
    out = cli("prepare", "--recipe", "smoke", "--source", str(tiny), env=env)
    line = _one_line_error(out, "too few for a 0.1 validation split")
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
    from tasks.model import training_code

    caller = {"digest": "0123456789abcdef", "commit": "c0ffee0000000000000000000000000000000000"}
    ours = training_code()
    with pytest.raises(UserError) as e:
        train.fn(cfg=None, data=None, root="unused", code=caller)  # refused before it reads anything
    message = str(e.value)
    assert caller["commit"] in message and ours["commit"] in message and "\n" not in message


def test_runs_from_an_image_record_its_commit_and_reproduce_names_changed_versions(monkeypatch):
    from tasks import provenance

    monkeypatch.setattr(provenance, "git_info", lambda path=".": {"commit": None, "branch": None, "dirty": None,
                                                                 "diff": None, "remote": None})
    monkeypatch.setenv("MLLM_GIT_COMMIT", "d" * 40)  # infra/Dockerfile's build argument
    assert provenance.code_git_info()["commit"] == "d" * 40
    tags = {**provenance.versions(), "version.torch": "0.0.1", "git.commit": "x"}
    assert provenance.version_changes(tags) == {"torch": ("0.0.1", provenance.version("torch"))}


def test_a_corpus_without_a_character_of_the_recipes_prompt_still_trains_samples_and_registers(own_stores, tmp_path):
    env, _, _, storage = own_stores
    corpus = tmp_path / "lower.txt"
    corpus.write_text(make_text(3000).lower())  # no "T": the smoke recipe prompts "The "
    out = cli("run", "--recipe", "smoke", "--source", str(corpus), "--set", "train.max_steps=10", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model: smoke v1 (promoted to champion" in out.stdout
    assert "the vocabulary lacks 'T'" in out.stderr
    [samples] = storage.glob("runs/*/samples/greedy.txt")
    assert samples.read_text().startswith("--- prompt 'he '\nhe ")
    # A prompt the user gives keeps its clear error.
    [checkpoint] = storage.glob("runs/*/checkpoints/best.pt")
    line = _one_line_error(cli("sample", "--checkpoint", str(checkpoint), "--prompt", "The ", env=env),
                           "the prompt has characters the vocabulary lacks: 'T'")
    assert "leave them out of the prompt" in line
