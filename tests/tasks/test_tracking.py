"""MLflow tracking, against an SQLite store and against a real `mlflow server` on loopback.

Each test runs in a scratch git repository in tmp_path with HOME in tmp_path too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient
from textdata import write_char_ids

from flows.stack.servers import free_port
from mllm import UserError
from mllm.config import RunConfig
from mllm.lm.generate import sample_text
from mllm.redact import scrub
from mllm.runtime.checkpoint import load_checkpoint
from tasks.tracking import registry
from tasks.tracking import tracker as tracking
from tasks.tracking.provenance import git_info
from tasks.tracking.store import tracking_uri
from tasks.tracking.tracker import RunTracker, flatten

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
TINY = {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 1, "dropout": 0.0}


@dataclass
class Store:
    uri: str
    server_log: Path | None = None  # the server's access log: one line per HTTP request

    def requests(self, endpoint: str) -> int:
        return Path(self.server_log).read_text().count(endpoint)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("server", marks=pytest.mark.integration)])
def store(request, tmp_path_factory) -> Store:
    """An SQLite file, or a real server that proxies artifacts over HTTP."""
    if request.param == "server":
        server = request.getfixturevalue("mlflow_server")
        return Store(server.url, server.process.log)
    if any("[server]" in item.nodeid for item in request.session.items):
        request.getfixturevalue("mlflow_server_starting")  # it starts while SQLite tests run
    return Store(f"sqlite:///{tmp_path_factory.mktemp('mlflow-sqlite') / 'mlflow.db'}")


@pytest.fixture(autouse=True)
def forget_tracking_uri(monkeypatch):
    """mlflow.set_tracking_uri is process-wide: later test modules get conftest's store back."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))
    yield
    mlflow.set_tracking_uri(None)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    for var, sub in (("HOME", ""), ("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache")):
        monkeypatch.setenv(var, str(h / sub))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return h


@pytest.fixture
def repo(tmp_path, home, monkeypatch) -> Path:
    """A scratch git checkout with one commit, as the working folder."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "train.py").write_text("lr = 1e-3\n")
    git(r, "add", "train.py")
    git(
        r,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.com",
        "-c",
        "commit.gpgsign=false",
        "commit",
        "-q",
        "-m",
        "first",
    )
    monkeypatch.chdir(r)
    return r


@pytest.fixture
def uri(store, repo, monkeypatch) -> str:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    return store.uri


def git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout.strip()


def config(**over) -> RunConfig:
    """A unique recipe name per test: each gets its own experiment and registered model."""
    data = {
        "recipe": f"t-{uuid.uuid4().hex[:8]}",
        "model": TINY,
        "train": {"max_steps": 4, "batch_size": 4, "window": 8},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value}
    return RunConfig.model_validate(data)


def artifact_texts(run_id: str, dst: Path) -> dict[str, str]:
    folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(dst)))
    return {str(p.relative_to(folder)): p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- pure helpers


def test_tracking_uri_env_first_else_sqlite_beside_the_storage_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri(str(tmp_path / "store" / "root")) == f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    assert tracking_uri(f"file://{tmp_path}/root") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    assert tracking_uri("s3://bucket/runs") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert not (tmp_path / "mlflow.db").exists()  # choosing a store creates nothing yet

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:pa55word@mlflow.example.com/")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    # Credentials move to MLflow's own variables, so they never show in a URL it prints.
    assert tracking_uri("s3://bucket/runs") == "https://mlflow.example.com/"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pa55word"


def test_flatten_gives_one_string_param_per_leaf():
    flat = flatten(
        {
            "model": {"arch": "gpt", "n_layer": 2, "bias": True},
            "train": {"epochs": None, "lr": 1e-3},
            "sample": {"methods": ["greedy"]},
            "vocab": {"specials": []},
            "recipe": "smoke",
        }
    )
    assert flat == {
        "model.arch": "gpt",
        "model.n_layer": "2",
        "model.bias": "true",
        "train.epochs": "null",
        "train.lr": "0.001",
        "sample.methods": '["greedy"]',
        "vocab.specials": "[]",
        "recipe": "smoke",
    }
    cfg = config()
    assert len(flatten(cfg.to_dict())) > 50 and flatten(cfg.to_dict())["model.arch"] == "lstm"
    assert "model.n_head" not in flatten(cfg.to_dict())  # the chosen family's fields only


def test_scrub_hides_env_secrets_url_userinfo_and_secret_named_options(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a secret-named variable, no secret
    got = scrub(
        {
            "note": f"key is {SECRET}!",
            "source": "s3://AKIAEXAMPLE:other-secret@bucket/raw.txt",
            "endpoint": "https://user:pass@minio.local:9000/x",
            "storage_options": {
                "key": "AKIAEXAMPLE",
                "secret": "s3cr3t",
                "sessionToken": "tok-123",
                "client_kwargs": {"endpoint_url": "http://minio:9000"},
            },
            "tokenizer": {"kind": "char"},
            "max_new_tokens": 200,
            "parallel": "false",
            "yaml": "password: hunter22\nsorted(x, key=len)\n",
        }
    )
    assert got == {
        "note": "key is ***!",
        "source": "s3://***@bucket/raw.txt",
        "endpoint": "https://***@minio.local:9000/x",
        "storage_options": {
            "key": "***",
            "secret": "***",
            "sessionToken": "***",
            "client_kwargs": {"endpoint_url": "http://minio:9000"},
        },
        "tokenizer": {"kind": "char"},
        "max_new_tokens": 200,
        "parallel": "false",
        "yaml": "password: ***\nsorted(x, key=len)\n",
    }


def test_git_info_reports_commit_branch_and_the_diff_when_dirty(repo, tmp_path):
    info = git_info(str(repo))
    assert info["commit"] == git(repo, "rev-parse", "HEAD") and info["branch"] == "main"
    assert info["dirty"] is False and info["diff"] is None
    (repo / "train.py").write_text("lr = 3e-4\n")
    (repo / "notes.txt").write_text("new\n")
    info = git_info(str(repo))
    assert info["dirty"] is True
    assert "-lr = 1e-3" in info["diff"] and "+lr = 3e-4" in info["diff"] and "notes.txt" in info["diff"]
    outside = tmp_path / "plain"
    outside.mkdir()
    assert git_info(str(outside)) == {"commit": None, "branch": None, "dirty": None, "diff": None, "remote": None}


# ----------------------------------------------------------------------------- runs


def test_run_logs_the_whole_config_git_state_and_versions(uri, repo, tmp_path):
    cfg = config()
    root = str(tmp_path / "storage")
    with RunTracker(cfg, root, tags={"trigger": "test"}, run_name="first") as run:
        pass
    client = MlflowClient(uri)
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED" and r.info.run_name == "first"
    assert client.get_experiment(r.info.experiment_id).name == cfg.recipe
    assert r.data.params == flatten(cfg.to_dict())
    texts = artifact_texts(run.run_id, tmp_path / "art")
    assert RunConfig.model_validate(yaml.safe_load(texts["config.yaml"])) == cfg
    assert "git.diff" not in texts  # clean checkout
    tags = r.data.tags
    head = git(repo, "rev-parse", "HEAD")
    assert tags["git.commit"] == tags["mlflow.source.git.commit"] == head
    assert tags["git.branch"] == "main" and tags["git.dirty"] == "false"
    assert tags["storage.root"] == root and tags["trigger"] == "test" and tags["device"] == "cpu"
    assert tags["version.mlflow"] == mlflow.__version__ and tags["version.mllm"] == "0.1.0"
    assert tags["version.torch"] and tags["version.prefect"]
    assert "prefect.flow_run_id" not in tags  # not inside a flow run


def test_a_run_with_the_default_stores_in_a_clean_checkout_stays_clean(repo, monkeypatch):
    # As `make run` in a fresh clone: ./storage and ./mlflow.db (and its lock) inside the checkout,
    # which the project's .gitignore must cover, or every first run would be tagged dirty.
    (repo / ".gitignore").write_text((Path(__file__).resolve().parents[2] / ".gitignore").read_text())
    git(repo, "add", ".gitignore")
    git(
        repo,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.com",
        "-c",
        "commit.gpgsign=false",
        "commit",
        "-q",
        "-m",
        "ignore",
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = str(repo / "storage")
    for _ in range(2):  # the second run finds the store and its lock file made by the first
        with RunTracker(config(), root) as run:
            Path(root).mkdir(exist_ok=True)
    assert (repo / "mlflow.db").exists()
    tags = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").get_run(run.run_id).data.tags
    assert tags["git.dirty"] == "false", git(repo, "status", "--short")


def test_dirty_checkout_is_tagged_and_its_diff_logged(uri, repo, tmp_path):
    (repo / "train.py").write_text("lr = 3e-4\n")
    with RunTracker(config(), str(tmp_path / "storage")) as run:
        pass
    assert MlflowClient(uri).get_run(run.run_id).data.tags["git.dirty"] == "true"
    diff = artifact_texts(run.run_id, tmp_path / "art")["git.diff"]
    assert "+lr = 3e-4" in diff


def test_a_failing_training_ends_the_run_failed(uri, tmp_path):
    with pytest.raises(RuntimeError, match="out of memory"):
        with RunTracker(config(), str(tmp_path / "storage")) as run:
            raise RuntimeError("CUDA out of memory")
    r = MlflowClient(uri).get_run(run.run_id)
    assert r.info.status == "FAILED" and r.data.tags["error"] == "RuntimeError: CUDA out of memory"


def test_flow_run_id_and_url_are_tagged_under_a_prefect_worker(uri, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_UI_URL, temporary_settings

    flow_run_id = str(uuid.uuid4())
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", flow_run_id)  # how a worker starts a flow run
    with temporary_settings({PREFECT_UI_URL: "http://127.0.0.1:4200"}):
        with RunTracker(config(), str(tmp_path / "storage")) as run:
            pass
    tags = MlflowClient(uri).get_run(run.run_id).data.tags
    assert tags["prefect.flow_run_id"] == flow_run_id
    assert tags["prefect.flow_run_url"] == f"http://127.0.0.1:4200/flow-runs/flow-run/{flow_run_id}"


def test_metrics_go_in_one_request_per_call_with_their_steps(store, uri, tmp_path, monkeypatch):
    with RunTracker(config(), str(tmp_path / "storage")) as run:
        calls = []
        real = run.client.log_batch
        monkeypatch.setattr(run.client, "log_batch", lambda *a, **kw: (calls.append(kw), real(*a, **kw)))
        before = store.requests("/runs/log-batch") if store.server_log else 0
        for step in (0, 10, 20):
            run.log_metrics(
                [
                    {
                        "step": step,
                        "train_loss": 3.0 - step / 10,
                        "lr": 1e-3,
                        "grad_norm": 1.5,
                        "tokens_per_s": 1000.0 + step,
                    }
                ]
            )
        run.log_metrics([{"step": 20, "val_loss": 2.5, "val_perplexity": 12.2, "val_bits_per_token": 3.6}])
        assert len(calls) == 4
        # 2,400 numbers in one call: as few requests as MLflow's 1,000-metric limit allows.
        run.log_metrics([{"step": 100 + i, "train_loss": 1.0, "lr": 1e-4, "grad_norm": 0.5} for i in range(800)])
        assert len(calls) == 7 and [len(c["metrics"]) for c in calls[4:]] == [1000, 1000, 400]
        if store.server_log:  # what reached the server: one HTTP request per batch
            time.sleep(0.5)  # the access log line follows the response
            assert store.requests("/runs/log-batch") - before == 7
        assert run.log_loss_curve() == "loss_curve.png"
    client = MlflowClient(uri)
    history = {m.step: m.value for m in client.get_metric_history(run.run_id, "train_loss")}
    assert len(history) == 803 and history[10] == 2.0 and history[20] == 1.0 and history[899] == 1.0
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "val_loss")] == [(20, 2.5)]
    assert [m.step for m in client.get_metric_history(run.run_id, "tokens_per_s")] == [0, 10, 20]
    png = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run.run_id, artifact_path="loss_curve.png", dst_path=str(tmp_path / "art")
        )
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_trainings_metrics_are_paced_but_an_eval_or_a_checkpoint_step_goes_at_once(store, uri, tmp_path, monkeypatch):
    # The train task's on_metrics: at most one request every MLLM_METRICS_EVERY_S seconds while
    # training logs every few steps; an evaluation, a checkpoint's step (checkpoint_interval 30
    # here) and the end of training send what is held at once, each step once.
    monkeypatch.setenv("MLLM_METRICS_EVERY_S", "60")
    cfg = config()
    cfg.train.checkpoint_interval = 30
    with RunTracker(cfg, str(tmp_path / "storage")) as run:
        calls = []
        real = run.client.log_batch
        monkeypatch.setattr(run.client, "log_batch", lambda *a, **kw: (calls.append(kw), real(*a, **kw)))
        on_metrics = run.metrics_after_resume()
        loss = lambda step: [{"step": step, "train_loss": 3.0 - step / 100}]  # noqa: E731 (a one-line helper, named where it is used)
        for step in (10, 20):
            on_metrics(loss(step))
        assert calls == []  # held: the minute is not over
        on_metrics([*loss(25), {"step": 25, "val_loss": 2.9}])
        assert len(calls) == 1 and {m.step for m in calls[0]["metrics"]} == {10, 20, 25}
        on_metrics(loss(27))
        on_metrics(loss(30))  # a checkpoint's step: a resumed training starts after it
        assert len(calls) == 2 and {m.step for m in calls[1]["metrics"]} == {27, 30}
        on_metrics(loss(35))
        assert len(calls) == 2
        on_metrics.flush()  # training ended
        assert len(calls) == 3
        # With 0 seconds, one request per log step, as before the pacing.
        monkeypatch.setenv("MLLM_METRICS_EVERY_S", "0")
        every = run.metrics_after_resume()
        every(loss(40))
        every(loss(50))
        assert len(calls) == 5
    assert [m.step for m in MlflowClient(uri).get_metric_history(run.run_id, "train_loss")] == [
        10,
        20,
        25,
        27,
        30,
        35,
        40,
        50,
    ]
    monkeypatch.setenv("MLLM_METRICS_EVERY_S", "soon")
    with pytest.raises(UserError, match="MLLM_METRICS_EVERY_S='soon': give seconds"):
        run.metrics_after_resume()
    monkeypatch.setenv("MLLM_METRICS_EVERY_S", "2")
    monkeypatch.setenv("MLLM_METRICS_RETRY_S", "0")
    with pytest.raises(UserError, match="MLLM_METRICS_RETRY_S='0': give the seconds between two looks"):
        run.metrics_after_resume()
    monkeypatch.setenv("MLLM_METRICS_RETRY_S", "0.5")
    assert run.metrics_after_resume().every_s == 0.5


def test_the_delays_before_a_training_and_a_point_run_again_are_settings(monkeypatch):
    from flows.sweep.parent import retry_delay_s as point_delay
    from tasks.model.train import retry_delay_s as training_delay

    assert (training_delay(), point_delay()) == (5, 10)
    monkeypatch.setenv("MLLM_TRAIN_RETRY_DELAY_S", "0.5")
    monkeypatch.setenv("MLLM_SWEEP_RETRY_DELAY_S", "0")
    assert (training_delay(), point_delay()) == (0.5, 0)
    monkeypatch.setenv("MLLM_TRAIN_RETRY_DELAY_S", "soon")
    with pytest.raises(
        UserError,
        match=r"^MLLM_TRAIN_RETRY_DELAY_S='soon': give the seconds before a failed "
        r"training runs again, 0 or more$",
    ):
        training_delay()
    monkeypatch.delenv("MLLM_TRAIN_RETRY_DELAY_S")  # the flows' settings read the tasks' too
    monkeypatch.setenv("MLLM_SWEEP_RETRY_DELAY_S", "-1")
    with pytest.raises(UserError, match=r"^MLLM_SWEEP_RETRY_DELAY_S='-1': give the seconds before a failed point"):
        point_delay()


def test_a_failing_run_closed_beside_another_that_finished_first_still_is_not_retried_for_minutes(
    failing_server, monkeypatch
):
    # A sweep's points close their failed MLflow runs in threads side by side, each inside
    # outage.fail_fast. One that finished first must not give the others MLflow's retries back: with
    # a server whose database is down (it answers 500) each would hold the sweep for 4 minutes.
    import threading

    from tasks.tracking import outage

    url, asked = failing_server
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # broken, this fails in a second, not minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # the user's own setting
    first_in, first_out = threading.Event(), threading.Event()
    met: list[BaseException] = []

    def first() -> None:
        with outage.fail_fast():
            first_in.set()
            first_out.wait(10)

    def second() -> None:
        first_in.wait(10)
        with outage.fail_fast():
            first_out.set()
            thread_a.join(10)
            try:
                MlflowClient(url).get_run("0" * 32)
            except Exception as e:  # noqa: BLE001 (whichever MLflow raises for a 500)
                met.append(e)

    thread_a, thread_b = threading.Thread(target=first), threading.Thread(target=second)
    thread_a.start()
    thread_b.start()
    thread_b.join(60)
    assert not thread_a.is_alive() and not thread_b.is_alive()
    assert len(met) == 1 and len(asked) == 1, (met, asked)  # one request, refused, no retries
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # given back when the last block ended
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"


def test_datasets_carry_our_digest_source_and_size(uri, tmp_path):
    sha = "9f" * 32  # a whole sha256: longer than MLflow's 36-character digest column
    with RunTracker(config(), str(tmp_path / "storage")) as run:
        run.log_dataset("raw", "https://example.com/corpus.txt", sha, "raw")
        run.log_dataset(
            "train", str(tmp_path / "storage" / "train.npy"), "0123456789abcdef", "training", n_tokens=90_000
        )
        run.log_dataset("val", "s3://bucket/val.npy", "fedcba9876543210", "validation", n_tokens=10_000)
    inputs = {d.dataset.name: d for d in MlflowClient(uri).get_run(run.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"raw", "train", "val"}
    train = inputs["train"]
    assert train.dataset.digest == "0123456789abcdef"
    assert json.loads(train.dataset.source) == {"uri": str(tmp_path / "storage" / "train.npy")}
    assert json.loads(train.dataset.profile) == {"num_tokens": 90_000}
    tags = {t.key: t.value for t in train.tags}
    assert tags["mlflow.data.context"] == "training" and tags["n_tokens"] == "90000"
    assert json.loads(inputs["val"].dataset.source) == {"uri": "s3://bucket/val.npy"}
    raw = inputs["raw"]
    assert json.loads(raw.dataset.source) == {"url": "https://example.com/corpus.txt"}
    assert raw.dataset.digest == sha[:36] and {t.key: t.value for t in raw.tags}["digest"] == sha


def test_no_secret_reaches_a_param_tag_artifact_dataset_or_log_line(uri, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    source = f"s3://AKIAEXAMPLE:{SECRET}@bucket/corpus.txt"
    root = f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs"
    cfg = config(data={"source": source})
    caplog.set_level(logging.INFO, logger="tasks.tracking")
    with RunTracker(cfg, root, tags={"note": f"secret {SECRET}"}) as run:
        run.log_text(f"AWS_SECRET_ACCESS_KEY={SECRET}\nsource: {source}\n", "notes.txt")
        run.log_dict({"storage_options": {"key": "AKIAEXAMPLE", "secret": SECRET}}, "options.json")
        run.log_dataset("raw", source, "ab" * 8, "raw")
        tracking.log.info("reading %s", source)
    r = MlflowClient(uri).get_run(run.run_id)
    texts = artifact_texts(run.run_id, tmp_path / "art")
    everything = {
        "params": json.dumps(r.data.params),
        "tags": json.dumps(r.data.tags),
        "datasets": json.dumps([d.dataset.source for d in r.inputs.dataset_inputs]),
        "logs": caplog.text,
        **texts,
    }
    assert {name for name, text in everything.items() if SECRET in text or "AKIAEXAMPLE" in text} == set()
    # ...and they were there to hide: the redaction shows where.
    assert r.data.params["data.source"] == "s3://***@bucket/corpus.txt"
    assert r.data.tags["storage.root"] == "s3://***@bucket/runs" and r.data.tags["note"] == "secret ***"
    assert "AWS_SECRET_ACCESS_KEY=***" in texts["notes.txt"]
    assert json.loads(texts["options.json"]) == {"storage_options": {"key": "***", "secret": "***"}}
    assert "reading s3://***@bucket/corpus.txt" in caplog.text


# ----------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny character LSTM trained for a few steps on made-up text."""
    from mllm.train import train

    d = tmp_path_factory.mktemp("trained")
    write_char_ids(d, 600)
    cfg = config(
        train={"max_steps": 6, "eval_interval": 3, "eval_batches": 2, "log_interval": 2, "checkpoint_interval": 3},
        sample={"max_new_tokens": 12, "methods": ["greedy"]},
    )
    cfg.paths = {
        "train_ids": str(d / "train.npy"),
        "val_ids": str(d / "val.npy"),
        "vocab": str(d / "vocab.json"),
        "checkpoint_dir": str(d / "ckpt"),
    }
    return train(cfg).checkpoint


def _scored(checkpoint: str, bits_per_byte: float):
    """An evaluation of the checkpoint as the evaluate stage hands it on (a language model's)."""
    from tasks.model import Evaluation

    return Evaluation(
        split="val",
        checkpoint=checkpoint,
        loss=bits_per_byte,
        tokens=100,
        report="",
        headline="val_bits_per_byte",
        higher_is_better=False,
        metrics={"val_loss": bits_per_byte, "val_bits_per_byte": bits_per_byte},
    )


def test_champion_moves_only_when_its_headline_improves_and_the_model_generates(uri, checkpoint, tmp_path):
    cfg = config(sample={"max_new_tokens": 12, "methods": ["greedy"]})
    name = cfg.recipe
    client = MlflowClient(uri)
    results = []
    corpus, other = ["a" * 64, "b" * 64], ["c" * 64]
    # The last two: a far better model of a corpus that shares no file with the champion's, under
    # the recipe's name (no rival: registered beside it) and under a name of its own (its first).
    for loss, files, model_name in (
        (2.0, corpus, None),
        (2.5, corpus, None),
        (1.5, corpus, None),
        (0.5, other, None),
        (0.5, other, f"{name}-other"),
    ):
        with RunTracker(cfg, str(tmp_path / "storage")) as run:
            results.append(
                registry.log_model(run, _scored(checkpoint, loss), files=files, model_name=model_name).model_dump(
                    mode="json"
                )
            )
            results[-1]["champion"] = str(client.get_model_version_by_alias(model_name or name, "champion").version)
    assert [(r["version"], r["promoted"], r["champion"]) for r in results] == [
        ("1", True, "1"),
        ("2", False, "1"),
        ("3", True, "3"),
        ("4", False, "3"),
        ("1", True, "1"),
    ]
    assert results[3]["reason"].startswith(
        "not judged against champion v3, whose corpus shares no file with this run's"
    )
    assert results[4]["name"] == f"{name}-other" and results[4]["reason"] == "no champion yet"
    assert registry.current_champion(client, name).files == sorted(f[:16] for f in corpus)
    assert results[0]["previous"] is None
    assert results[1]["previous"]["version"] == "1" and results[1]["previous"]["val_loss"] == 2.0
    assert results[2]["previous"]["version"] == "1"
    decisions = [client.get_run(r["run_id"]).data.tags["champion.decision"] for r in results]
    assert decisions[0].startswith("promoted")
    assert decisions[1].startswith("kept: val_bits_per_byte 2.5 >= champion v1 2")
    assert decisions[2].startswith("promoted: val_bits_per_byte 1.5 < champion v1 2")
    report = json.loads(artifact_texts(results[1]["run_id"], tmp_path / "art")["champion.json"])
    assert report["promoted"] is False and report["version"] == "2" and report["val_loss"] == 2.5
    assert client.get_model_version(name, "2").tags["val_loss"] == "2.5"

    model = mlflow.pyfunc.load_model(f"models:/{name}@champion", dst_path=str(tmp_path))
    params = model.metadata.get_params_schema()
    assert {p.name for p in params.params} >= {"method", "max_new_tokens", "temperature", "top_k", "top_p", "seed"}
    # The served model generates exactly what the checkpoint does through mllm itself.
    loaded = load_checkpoint(checkpoint)
    texts = model.predict(["The ", "and "], params={"max_new_tokens": 7})
    assert texts == [sample_text(loaded, p, "greedy", max_new_tokens=7) for p in ("The ", "and ")]
    assert texts[0].startswith("The ") and len(texts[0]) > len("The ")
    top_p = {"method": "top-p", "top_p": 0.9, "seed": 3, "max_new_tokens": 20}
    sampled = model.predict(pd.DataFrame({"prompt": ["The "]}), params=top_p)
    assert sampled == [sample_text(loaded, "The ", **top_p)]
    assert model.predict({"prompt": ["the "]}, params={"max_new_tokens": 3})[0].startswith("the ")

    # A bad parameter is refused by its name with what it may be, as a 400 of the scoring server.
    from mlflow.exceptions import MlflowException

    refusals = []
    for inputs, bad in (
        (["The "], {"method": "nope"}),
        (["The "], {"max_new_tokens": -5}),
        (["The "], {"max_new_tokens": 5000}),
        (["The "], {"top_p": 1.5}),
        (["The "], {"max_new_tokens": 5, "nope": 1}),
        (["The "], {"max_new_tokens": "abc"}),
        (["The "], {"seed": 1.5}),
        ([5], {}),
        (["The ", None], {}),
        (["Thé: "], {}),
    ):
        with pytest.raises(MlflowException) as e:
            model.predict(inputs, params=bad)
        assert e.value.get_http_status_code() == 400 and not e.value.json_kwargs
        refusals.append(e.value.message)
    bound = "give a whole number from 1 to 1024 (this server's bound: MLLM_SERVE_MAX_NEW_TOKENS sets it)"
    assert refusals[:4] == [
        "parameter method 'nope': a language model samples with greedy, temperature, top-k, top-p, beam",
        f"parameter max_new_tokens -5: {bound}",
        f"parameter max_new_tokens 5000: {bound}",
        "parameter top_p 1.5: give a number above 0 and at most 1",
    ]
    assert refusals[4].startswith(
        "unknown parameter nope: this model takes beam_width, drop_unsupported, max_new_tokens, method"
    )
    # A value of the wrong type by its name and bounds, not in MLflow's words; a prompt that is not text.
    assert refusals[5:] == [
        f"parameter max_new_tokens 'abc': {bound}",
        "parameter seed 1.5: give a whole number",
        'the prompt 5 is not text (int): send each prompt as a string, e.g. {"inputs": ["The "]}',
        'the prompt None is not text (NoneType): send each prompt as a string, e.g. {"inputs": ["The "]}',
        "the prompt 'Thé: ' loses 'é' ':' to the normalisation its model's corpus had (the model reads 'Th '): "
        "leave them out, or send the parameter drop_unsupported: true to sample from what is left",
    ]
    assert model.predict(["Thé: "], params={"drop_unsupported": True, "max_new_tokens": 7}) == [
        sample_text(loaded, "Th ", "greedy", max_new_tokens=7)
    ]


@pytest.mark.integration
def test_registered_model_loads_and_serves_where_prefect_cannot_be_imported(checkpoint, tmp_path):
    """The model carries its own code (mllm and tasks/tracking/served_model.py): a serving environment
    without Prefect loads it with pyfunc and answers /invocations from `mlflow models serve`."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri  # restored by forget_tracking_uri
    cfg = config(sample={"max_new_tokens": 12, "methods": ["greedy"]})
    with RunTracker(cfg, str(tmp_path / "storage")) as run:
        registry.log_model(run, _scored(checkpoint, 2.0))
    expected = sample_text(load_checkpoint(checkpoint), "The ", "greedy", max_new_tokens=9)

    blocker = tmp_path / "no-prefect"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoPrefect:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'prefect' or name.startswith('prefect.'):\n"
        "            raise ImportError('prefect is not installed here')\n"
        "sys.meta_path.insert(0, NoPrefect())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(blocker),
        "MLFLOW_TRACKING_URI": uri,
        # MLflow starts uvicorn by name, as from an activated environment.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    load = (
        "import mlflow.pyfunc, json\n"
        "try:\n    import prefect\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('prefect imported')\n"
        f"m = mlflow.pyfunc.load_model('models:/{cfg.recipe}@champion')\n"
        "print(json.dumps(m.predict(['The '], params={'max_new_tokens': 9})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", load], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [expected]

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "models",
            "serve",
            "-m",
            f"models:/{cfg.recipe}@champion",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        body = json.dumps({"inputs": ["The "], "params": {"max_new_tokens": 9}}).encode()
        deadline = time.monotonic() + 240
        while True:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.loads(response.read())
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow models serve did not answer in 240 s"
                time.sleep(1)
        refused = {}
        for name, inputs, params in (
            ("bad", ["The "], {"method": "nope", "max_new_tokens": -5}),
            ("unknown", ["The "], {"nope": 1}),
            ("type", ["The "], {"max_new_tokens": "abc"}),
            ("number", [5], {}),
            ("dropped", ["Ünïcödé: 日本 "], {}),
        ):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations",
                data=json.dumps({"inputs": inputs, "params": params}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=60)
            assert e.value.code == 400
            refused[name] = json.loads(e.value.read())
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    assert answer == {"predictions": [expected]}
    # The request's mistake in the message, and no traceback of the server's code beside it.
    assert all("stack_trace" not in r and r["error_code"] == "INVALID_PARAMETER_VALUE" for r in refused.values())
    assert refused["bad"]["message"].endswith(
        "Error: parameter method 'nope': a language model samples with greedy, temperature, top-k, top-p, beam"
    )
    assert "unknown parameter nope: this model takes" in refused["unknown"]["message"]
    assert refused["type"]["message"].endswith(
        "Error: parameter max_new_tokens 'abc': give a whole number from 1 "
        "to 1024 (this server's bound: MLLM_SERVE_MAX_NEW_TOKENS sets it)"
    )
    assert "the prompt 5 is not text (int): send each prompt as a string" in refused["number"]["message"]
    assert refused["dropped"]["message"].endswith(
        "loses 'Ü' 'ï' 'ö' 'é' ':' '日' '本' to the normalisation its model's corpus had (the model reads 'ncd '): "
        "leave them out, or send the parameter drop_unsupported: true to sample from what is left"
    )
    assert "prefect" not in (tmp_path / "serve.log").read_text().lower()


# ----------------------------------------------------------------------------- what the UI shows


def test_stage_digests_named_key_stay_in_clear_and_real_keys_do_not(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    got = scrub(
        {
            "train.key": "c492b81f6515010e",
            "data.splits_key": "b89dbc854f529349",
            "data.tokens_key": "09e82874a286feb5",
            "api_key": "sk-live-123456",
            "key": "AKIAEXAMPLE",
            "aws_secret_access_key": "abc",
            "secret_train_key": "x",
            "note": f"train.key={SECRET}",
            "line": "train.key=c492b81f6515010e api_key=sk-live-123456 http://u:pw@host/x",
        }
    )
    assert got == {
        "train.key": "c492b81f6515010e",
        "data.splits_key": "b89dbc854f529349",
        "data.tokens_key": "09e82874a286feb5",
        "api_key": "***",
        "key": "***",
        "aws_secret_access_key": "***",
        "secret_train_key": "***",
        "note": "train.key=***",
        "line": "train.key=c492b81f6515010e api_key=*** http://***@host/x",
    }


def test_a_recipes_experiment_opens_in_the_model_training_view_and_shows_the_training_key(uri, tmp_path):
    cfg = config()
    with RunTracker(cfg, str(tmp_path / "storage")) as run:
        run.set_tags({"train.key": "c492b81f6515010e"})
    client = MlflowClient(uri)
    r = client.get_run(run.run_id)
    assert r.data.tags["train.key"] == "c492b81f6515010e"
    # The tag MLflow 3's UI reads to choose the experiment's view; without it, the GenAI view.
    assert client.get_experiment(r.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_system_metrics_are_sampled_beside_the_training_and_once_at_least(uri, tmp_path, monkeypatch):
    from tasks.tracking.system import system_metrics

    cfg, root = config(), str(tmp_path / "storage")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with RunTracker(cfg, root) as run, system_metrics(run.run_id, root):
        sum(i * i for i in range(3_000_000))  # some CPU work to be seen
        # Sampled while the work goes on: a second sample within a few intervals (more on a
        # loaded machine, where the monitor's thread waits its turn).
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and len(MlflowClient(uri).get_metric_history(run.run_id, "system/system_memory_usage_megabytes")) < 2
        ):
            time.sleep(0.2)
    with RunTracker(cfg, root) as short:
        monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "60")
        with system_metrics(short.run_id, root):
            pass  # shorter than one interval: one sample at the end
    client = MlflowClient(uri)
    for run_id, at_least in ((run.run_id, 2), (short.run_id, 1)):
        metrics = client.get_run(run_id).data.metrics
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics), metrics
        assert metrics["system/system_memory_usage_megabytes"] > 0
        assert len(client.get_metric_history(run_id, "system/system_memory_usage_megabytes")) >= at_least
