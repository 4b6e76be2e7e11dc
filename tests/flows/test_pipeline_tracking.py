"""The pipeline recorded in a real MLflow server over HTTP, and reproduced from its commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import mlflow
import mlflow.pyfunc
import prewarmed
import pytest
from mlflow.tracking import MlflowClient
from textdata import make_text

from flows.artifacts.pipeline import summary
from flows.pipeline import pipeline
from mllm.resolve import resolve
from tasks.tracking.tracker import flatten

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=20",
]


def git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_pipeline_run_is_recorded_in_mlflow_over_http(
    mlflow_server,
    corpus: Path,
    tmp_path: Path,
    monkeypatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    overrides = FAST + ["sample.methods=[greedy, top-k]"]
    r = pipeline(recipe="smoke", source=str(corpus), storage_url=str(tmp_path / "storage"), overrides=overrides)
    cfg = resolve("smoke", overrides=overrides, source=str(corpus))
    client = MlflowClient(mlflow_server.url)
    run = client.get_run(r.mlflow_run_id)

    assert client.get_experiment(run.info.experiment_id).name == "smoke"
    assert run.info.status == "FINISHED"
    # The config, and what training found out: the precision it chose and the peak behind its MFU.
    chosen = {k: v for k, v in run.data.params.items() if k not in flatten(cfg.to_dict())}
    assert {k: v for k, v in run.data.params.items() if k not in chosen} == flatten(cfg.to_dict())
    assert chosen["train.dtype_used"] == r.trained.dtype_used and chosen["train.dtype_reason"]
    assert float(chosen["train.peak_tflops"]) > 0 and chosen["train.peak_source"].startswith("measured")
    assert all(0 < m.value <= 1 for m in client.get_metric_history(run.info.run_id, "mfu"))
    assert run.data.metrics["final_mfu"] == pytest.approx(r.trained.mfu)
    # Its threads and whether the machine was busy, as trained.json has them (issue 64, item 2).
    assert (chosen["train.threads"], chosen["train.busy"]) == (str(r.trained.threads), str(r.trained.busy))
    assert chosen["train.threads_reason"] == r.trained.threads_reason and "train.cpu_share" in chosen
    text = summary(r)  # the Prefect artifact's text
    assert f"| precision | {r.trained.dtype_used} (" in text and f"| MFU | {r.trained.mfu:.1%} of " in text
    # Batched per-step metrics: every log step and every evaluation, with its step.
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [3, 6, 9, 12]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [6, 12]
    assert {"lr", "grad_norm", "tokens_per_s", "final_val_bits_per_byte"} <= set(run.data.metrics)
    assert run.data.metrics["final_val_loss"] == pytest.approx(r.evaluation.loss)

    inputs = {d.dataset.name: d.dataset for d in run.inputs.dataset_inputs}
    assert {"corpus", "tokens", "train", "val"} <= set(inputs)
    assert inputs["corpus"].digest == r.data.raw_sha256[:36]
    assert json.loads(inputs["train"].source)["uri"] == r.data.splits.train.ids

    tags = run.data.tags
    assert tags["git.commit"] == git(REPO, "rev-parse", "HEAD")
    assert tags["prefect.flow_run_id"]
    assert tags["storage.root"] == str(tmp_path / "storage")
    assert tags["data.raw_sha256"] == r.data.raw_sha256

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "samples")
    }
    assert {
        "config.yaml",
        "vocab.json",
        "evaluation.md",
        "loss_curve.png",
        "samples/greedy.txt",
        "samples/top-k.txt",
        "samples/prompts.json",
    } <= artifacts
    for path in artifacts - {"loss_curve.png", "samples"}:
        text = Path(
            mlflow.artifacts.download_artifacts(
                run_id=run.info.run_id, artifact_path=path, dst_path=str(tmp_path / "a"), tracking_uri=mlflow_server.url
            )
        ).read_text()
        assert secret not in text
    assert secret not in json.dumps([run.data.params, tags])

    assert r.champion.name == "smoke" and r.champion.promoted
    model = mlflow.pyfunc.load_model("models:/smoke@champion", dst_path=str(tmp_path))
    [text] = model.predict(["The "], params={"method": "greedy", "max_new_tokens": 15})
    assert text.startswith("The ") and len(text) == 4 + 15

    # The same model from the CLI, by registered name and by run; MLflow's copy of the model's
    # files, made in the temporary folder, is gone once the command ends.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server.url, TMPDIR=str(temporary))
    for how in (["--model", "smoke@champion"], ["--run", r.mlflow_run_id]):
        out = prewarmed.run(
            "flows.cli",
            ["sample", *how, "--prompt", "The ", "--method", "greedy", "--max-new-tokens", "15"],
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.rstrip("\n") == text
        assert not list(temporary.iterdir()), list(temporary.iterdir())

    out = prewarmed.run("flows.cli", ["runs", "--json"], env=env, timeout=300)
    rows = json.loads(out.stdout)
    [row] = [row for row in rows if row["run_id"] == r.mlflow_run_id]
    assert row["val_loss"] == pytest.approx(r.evaluation.loss) and row["mfu"] == pytest.approx(r.trained.mfu)
    assert row["dtype"] == r.trained.dtype_used


def _scratch_repo(tmp_path: Path) -> Path:
    """A copy of the project's tracked files as a git repository of its own."""
    repo = tmp_path / "project"
    for rel in git(REPO, "ls-files").splitlines():
        src = REPO / rel
        if src.is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / rel)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "first")
    return repo


def test_reproducing_a_skipped_run_on_s3_reruns_its_commit_compares_with_the_training_it_reused_registers_nothing(
    tmp_path: Path,
) -> None:
    from servers import run_s3_server

    repo = _scratch_repo(tmp_path)
    first = git(repo, "rev-parse", "HEAD")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(), encoding="utf-8")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with run_s3_server(tmp_path / "s3") as s3:
        s3.client().create_bucket(Bucket="runs")
        env = dict(
            os.environ,
            **s3.env,
            PYTHONPATH=str(repo),
            MLFLOW_TRACKING_URI=tracking,
            PREFECT_HOME=str(tmp_path / "prefect"),
        )

        def cli(*args: str) -> subprocess.CompletedProcess:
            return prewarmed.run("flows.cli", [*args, "--storage", "s3://runs/r"], env, repo, 600)

        sets = [a for s in FAST for a in ("--set", s)]
        # A relative source, as README's `make run SOURCE=../...` gives: the reproduction runs in a
        # folder of its own, and must find it all the same.
        for _ in range(2):  # the second finds the champion trained on the same data, config and code
            out = cli("run", "--recipe", "smoke", "--source", "../corpus.txt", *sets)
            assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.startswith("skipped:")
        trained, skipped = sorted(json.loads(cli("runs", "--json").stdout), key=lambda r: r["started"] + r["decision"])
        assert (trained["decision"], skipped["decision"]) == ("promoted", "skipped")
        # The record names the source absolutely (MLflow's params are the config.yaml artifact's fields).
        assert MlflowClient(tracking).get_run(trained["run_id"]).data.params["data.source"] == str(corpus)

        # A later commit: the reproduction still runs the first one's code.
        (repo / "NOTES.md").write_text("a later change\n")
        git(repo, "add", "-A")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "second")

        client = MlflowClient(tracking)

        def registry() -> list[tuple[str, list[str]]]:
            return sorted(
                (str(v.version), sorted(client.get_model_version("smoke", v.version).aliases))
                for v in client.search_model_versions("name = 'smoke'")
            )

        before = registry()
        assert before == [("1", ["champion"])]
        out = cli("reproduce", skipped["run_id"])
        assert out.returncode == 0, out.stderr[-3000:]
        assert registry() == before  # no version registered, no alias moved
        lines = out.stdout.splitlines()  # the reproduction's own output, then the comparison
        lines = lines[next(i for i, line in enumerate(lines) if line.startswith("reproduced ")) :]
        assert "(registered nothing)" in lines[0]
        assert any(
            line
            == "model: not registered (reproduces run " + skipped["run_id"] + ": registered nothing, no alias moved)"
            for line in out.stdout.splitlines()
        )
        assert f"compared with run {trained['run_id']}" in lines[1]
        row = next(line.split() for line in lines if line.startswith("final_val_loss"))
        assert row[1] != "-" and float(row[3]) < 1e-6  # the training it reused, matched

        [new] = client.search_runs(
            [client.get_experiment_by_name("smoke").experiment_id],
            filter_string=f"tags.reproduces = '{skipped['run_id']}'",
        )
        assert new.data.tags["decision"] == "reproduction" and "model_version" not in new.data.tags
        assert new.data.tags["storage.root"].startswith("s3://runs/r/reproductions/")
        assert new.data.tags["git.commit"] == first
        old = client.get_run(trained["run_id"])
        # It trains in the precision the original ran in, whatever `auto` would pick today.
        assert (
            new.data.params["train.dtype"] == old.data.params["train.dtype_used"] == new.data.params["train.dtype_used"]
        )
        # And eager as it ran (a short run: `auto` did not compile), whatever `auto` would decide today.
        assert old.data.params["train.compile_used"] == "False" and new.data.params["train.compile"].lower() == "false"
        assert new.data.metrics["final_val_loss"] == pytest.approx(old.data.metrics["final_val_loss"], abs=1e-6)
        assert not (tmp_path / "worktrees").exists() and git(repo, "worktree", "list").count("\n") == 0

        out = cli("reproduce", "0" * 32)
        assert out.returncode == 2 and "no MLflow run" in out.stderr
