"""Faults around a training: how the champion is judged, checkpoints by time and on SIGTERM, a
tracking server that dies mid-training, a full disk, storage roots that share a tracking store,
checkpoints from another version of mllm. Each through the real CLI and real servers."""

from __future__ import annotations

import bz2
import os
from pathlib import Path

import prewarmed
import pytest
from commands import cli, one_line_error, temporary_server_home

pytestmark = pytest.mark.integration


def _logged_steps(client, experiment: str) -> list[int]:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [m.step for r in runs for m in client.get_metric_history(r.info.run_id, "train_loss")]


def test_sigterm_to_a_training_loses_no_step_since_the_last_one_logged(corpus, own_stores):
    import json
    import signal
    import sqlite3
    import time

    from mlflow.tracking import MlflowClient

    env, prefect, _, storage = own_stores
    # Prefect's temporary server, which the command starts, in `prefect`: a signal to the whole
    # group (below) must not reach it, or the command waits minutes on it to record the end.
    env["PREFECT_API_URL"] = ""
    temporary_server_home(prefect)  # a user's home after their first run: its database exists
    # No periodic checkpoint before the signal: by steps or by minutes, none would come.
    args = [
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--set",
        "train.max_steps=1500",
        "--set",
        "train.checkpoint_interval=1500",
        "--set",
        "train.checkpoint_minutes=60",
        "--set",
        "train.eval_interval=1500",
        "--set",
        "train.log_interval=10",
    ]
    proc = prewarmed.start("flows.cli", args, {**os.environ, "COLUMNS": "200", **env}, new_session=True)
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    deadline = time.monotonic() + 300
    while max(_logged_steps(client, "smoke"), default=0) < 50:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never logged step 50"
        time.sleep(0.2)
    sent = time.monotonic()
    # To every process of the command's group, as `timeout`, a batch scheduler or systemd send it
    # (docker stop and Kubernetes send it to the command alone: a subset of this).
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if "error" in line.lower() or "Crash" in line] == [
        "error: interrupted: finished stages and the last checkpoint are kept; run the same command to continue "
        "from them"
    ], stderr[-3000:]
    assert "websocket" not in stderr.lower() and "does not answer" not in stderr, stderr[-3000:]
    assert took < 10, took
    with sqlite3.connect(prefect / "prefect.db") as db:
        states = dict(
            db.execute(
                "SELECT f.name, r.state_type FROM flow_run r JOIN flow f ON f.id = r.flow_id "
                "WHERE f.name IN ('pipeline', 'train')"
            ).fetchall()
        )
    assert states == {"pipeline": "CANCELLED", "train": "CANCELLED"}
    [ckpt] = storage.glob("runs/*/checkpoints/last.pt")
    import torch

    step = torch.load(ckpt, weights_only=True)["step"]
    assert max(_logged_steps(client, "smoke")) <= step < 1500
    [run] = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run.info.status == "KILLED"

    # The same command again (on the session's Prefect server: the temporary one was the signal's
    # subject) goes on from that checkpoint.
    again = cli(*args, env={k: v for k, v in env.items() if k != "PREFECT_API_URL"})
    assert again.returncode == 0, again.stderr[-3000:]
    trained = json.loads(next(storage.glob("runs/*/trained.json")).read_text())
    assert trained["steps"] == 1500 and trained["resumed_from_step"] == step


def _start_training(args: list[str], env: dict[str, str]):
    return prewarmed.start("flows.cli", args, {**os.environ, "COLUMNS": "200", **env})


def _wait_for_logged_step(client, proc, step: int, timeout: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout
    while max(_logged_steps(client, "smoke"), default=0) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"training never logged step {step}"
        time.sleep(0.3)


def _kill(server) -> float:
    """SIGKILL to the server's process (and the workers it started), as a crash or the OOM killer would."""
    import signal
    import time

    os.killpg(server.process.pid, signal.SIGKILL)
    return time.monotonic()


def test_a_tracking_server_killed_mid_training_and_back_gets_every_metric(corpus, own_stores, tmp_path):
    import time

    from mlflow.tracking import MlflowClient
    from servers import TcpProxy, run_mlflow_server

    env, *_ = own_stores
    folder = tmp_path / "mlflow-server"
    # The address the command knows is a forwarder's: the server behind it is killed, and the one
    # that comes back in its place (on the same store) was started beforehand, so that the training
    # need not outlast a server's start (10-30 s here) to meet it.
    with run_mlflow_server(folder) as server, run_mlflow_server(folder, wait=False) as standby:
        proxy = TcpProxy(int(server.url.rsplit(":", 1)[1])).start()
        env = {**env, "MLFLOW_TRACKING_URI": proxy.url}
        client = MlflowClient(server.url)
        # The standby answers (its store opened) before the training starts, and the training looks
        # at an away server every second, not 10: on a fast CPU (a Zen 5 EPYC) the 2,900 steps after
        # the kill took less time than the standby's start plus one 10 s wait, and the training
        # ended with its server still away.
        standby.wait_ready()
        MlflowClient(standby.url).search_experiments()
        env = {**env, "MLLM_METRICS_RETRY_S": "1"}
        proc = _start_training(
            [
                "run",
                "--recipe",
                "smoke",
                "--source",
                str(corpus),
                "--set",
                "train.max_steps=3000",
                "--set",
                "train.log_interval=10",
            ],
            env,
        )
        _wait_for_logged_step(client, proc, 100)
        killed = _kill(server)
        # Back once the training has met the dead server (its next metric request, within 2 s).
        while not proxy.unreached:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proxy.upstream = ("127.0.0.1", int(standby.url.rsplit(":", 1)[1]))
        assert proc.poll() is None, "the training ended before its tracking server came back"
        _, stderr = proc.communicate(timeout=600)
        took = time.monotonic() - killed
        proxy.stop()
        assert proc.returncode == 0, stderr[-3000:]
        print(f"killed at step >= 100; command finished normally {took:.1f} s after the kill")
        assert "Traceback" not in stderr and "Retrying" not in stderr and "storage unreachable" not in stderr
        assert stderr.count(f"the MLflow tracking server {proxy.url} stopped answering at step") == 1, stderr[-3000:]
        assert "answers again: sent the metrics held since step" in stderr, [
            line for line in stderr.splitlines() if "MLflow" in line
        ]
        client = MlflowClient(standby.url)
        [run] = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
        assert run.info.status == "FINISHED" and run.data.tags["decision"] == "promoted"
        # Each step logged once, none lost while the server was away.
        assert sorted(_logged_steps(client, "smoke")) == list(range(10, 3001, 10))


def test_a_tracking_server_that_stays_away_ends_the_run_in_one_line_and_is_told_later(corpus, own_stores, tmp_path):
    import subprocess
    import time

    from mlflow.tracking import MlflowClient
    from servers import TcpProxy, run_mlflow_server

    env, _, _, storage = own_stores
    folder = tmp_path / "mlflow-server"
    args = ["run", "--recipe", "smoke", "--source", str(corpus), "--set", "train.max_steps=800"]
    # As above: the server that comes back at the command's address was started beforehand.
    with run_mlflow_server(folder) as server, run_mlflow_server(folder, wait=False) as standby:
        proxy = TcpProxy(int(server.url.rsplit(":", 1)[1])).start()
        env = {**env, "MLFLOW_TRACKING_URI": proxy.url}
        client = MlflowClient(server.url)
        proc = _start_training(args, env)
        _wait_for_logged_step(client, proc, 50)
        [first] = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
        killed = _kill(server)
        stdout, stderr = proc.communicate(timeout=600)
        took = time.monotonic() - killed
        print(f"the command's outcome {took:.1f} s after the kill")
        line = one_line_error(
            subprocess.CompletedProcess(args, proc.returncode, stdout, stderr),
            f"the MLflow tracking server {proxy.url} stopped answering during the run",
            "the training is finished and kept in",
            "run the same command",
        )
        assert "storage unreachable" not in stderr and "Retrying" not in stderr
        assert json_steps(storage) == 800, line  # the training went on to its end
        assert took < 120, took

        proxy.upstream = ("127.0.0.1", int(standby.wait_ready().url.rsplit(":", 1)[1]))
        client = MlflowClient(standby.url)
        again = cli(*args, env=env)
        proxy.stop()
        assert again.returncode == 0, again.stderr[-3000:]
        runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("smoke").experiment_id])}
        assert runs[first.info.run_id].info.status == "FAILED"  # closed when the server came back
        assert "stopped answering" in runs[first.info.run_id].data.tags["error"]
        # The metrics it could not take while away were kept in storage and sent then: each step once.
        history = client.get_metric_history(first.info.run_id, "train_loss")
        assert sorted(m.step for m in history) == list(range(10, 801, 10)), [m.step for m in history]
        [second] = [r for r in runs.values() if r.info.run_id != first.info.run_id]
        assert second.info.status == "FINISHED" and second.data.tags["train.resumed_from_step"] == "800"
    assert "are kept in" in stderr and "were not sent" not in stderr, stderr[-3000:]
    assert not list(storage.glob("tracking/unfinished/*.json")) and not list(storage.glob("tracking/unsent/*.json"))


def json_steps(storage: Path) -> int:
    import json

    return json.loads(next(storage.glob("runs/*/trained.json")).read_text())["steps"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs (mounting needs root: where it cannot be mounted, the test is skipped)."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_one_line_naming_the_storage_root_with_no_retry_and_no_empty_folder(
    corpus, own_stores, small_disk
):
    import shutil

    env, _, _, _ = own_stores
    storage = small_disk / "storage"
    args = ("--recipe", "smoke", "--source", str(corpus), "--storage", str(storage))
    assert cli("prepare", *args, env=env).returncode == 0  # the data stages fit
    # Fill the disk but for a few KB: the first checkpoint (about 150 KB) cannot be written.
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - 40_000))
    out = cli("run", *args, env=env)
    line = one_line_error(out, f"storage root {storage} is on a full disk (", "MB free of", "--storage")
    assert "Traceback" not in out.stderr and "OSError" not in out.stderr and "Retry" not in out.stderr, out.stderr
    assert out.stderr.count("training smoke lstm") == 1, out.stderr  # not retried from step 0
    assert not list(storage.glob("runs/*/checkpoints")), line  # no empty checkpoints folder
    # Room made, the same command goes on from the finished stages.
    (small_disk / "filler").unlink()
    again = cli("run", *args, env=env)
    assert again.returncode == 0 and "promoted to champion" in again.stdout, again.stderr[-3000:]


def test_sibling_storage_roots_share_the_default_store_and_a_copy_of_the_text_keeps_the_champion(
    corpus, own_stores, tmp_path
):
    from mlflow.tracking import MlflowClient

    env, *_ = own_stores
    env = {**env, "MLFLOW_TRACKING_URI": ""}  # the default store: mlflow.db beside the root
    args = ("run", "--recipe", "smoke", "--set", "train.max_steps=30")
    a, b = tmp_path / "a", tmp_path / "b"
    first = cli(*args, "--source", str(corpus), "--storage", str(a), env=env)
    assert first.returncode == 0 and "promoted to champion: no champion yet" in first.stdout, first.stderr[-3000:]
    assert (tmp_path / "mlflow.db").exists()  # shared by every root in tmp_path
    # The champion in the shared store has this very training key, but its training is in a/:
    # b trains its own (README: a new --storage trains), and the same weights keep the champion.
    second = cli(*args, "--source", str(corpus), "--storage", str(b), env=env)
    assert second.returncode == 0 and "skipped" not in second.stdout, second.stdout
    assert "champion kept" in second.stdout and "ties" in second.stdout, second.stdout
    assert list(b.glob("runs/*/checkpoints/best.pt")) and list(b.glob("runs/*/trained.json"))
    # Where the training is there, the run skips.
    third = cli(*args, "--source", str(corpus), "--storage", str(a), env=env)
    assert third.returncode == 0 and third.stdout.startswith("skipped: "), third.stdout
    # The same text compressed: another corpus digest, so another split. The champion is rescored
    # on this one, as the challenger was scored; the weights are the same, so the scores are, and a
    # tie keeps it.
    packed = tmp_path / "corpus.txt.bz2"
    packed.write_bytes(bz2.compress(corpus.read_bytes()))
    fourth = cli(*args, "--source", str(packed), "--storage", str(a), env=env)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert "(champion kept: val_bits_per_byte" in fourth.stdout, fourth.stdout
    assert "ties (within 0.01%)" in fourth.stdout and "both on this run's validation split" in fourth.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert str(client.get_model_version_by_alias("smoke", "champion").version) == "1"
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id], order_by=["start_time"])
    assert [r.data.tags["decision"] for r in runs] == ["promoted", "kept", "skipped", "kept"]


@pytest.mark.parametrize("case", ["newer format", "config field", "empty file"])
def test_a_checkpoint_this_mllm_cannot_read_says_why_in_one_line(case, own_stores, tmp_path):

    import torch
    from textdata import write_char_ids

    from mllm.config import RunConfig
    from mllm.train import train

    env, *_ = own_stores
    write_char_ids(tmp_path, 300)
    cfg = RunConfig.model_validate(
        {
            "model": {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 1},
            "train": {"batch_size": 4, "window": 8, "max_steps": 2, "eval_interval": 2, "eval_batches": 1},
            "paths": {
                "train_ids": str(tmp_path / "train.npy"),
                "val_ids": str(tmp_path / "val.npy"),
                "vocab": str(tmp_path / "vocab.json"),
                "checkpoint_dir": str(tmp_path / "ck"),
            },
        }
    )
    path = Path(train(cfg).checkpoint)
    state = torch.load(path, weights_only=True)
    assert state["format"] == 1  # every checkpoint says its format
    needle = {
        "newer format": "was written by a newer mllm (checkpoint format 2; this one reads formats up to 1): "
        "upgrade mllm-pipeline",
        "config field": "has a config this mllm cannot read: model.n_layer:",
        "empty file": "is empty (0 bytes)",
    }[case]
    if case == "newer format":
        torch.save({**state, "format": 2}, path)
    elif case == "config field":
        state["config"]["model"]["n_layer"] = "four"
        torch.save(state, path)
    else:
        path.write_bytes(b"")
    one_line_error(cli("sample", "--checkpoint", str(path), "--prompt", "the", env=env), needle)
    out = prewarmed.run("mllm.sample", ["--checkpoint", str(path), "--prompt", "the"], timeout=120)
    one_line_error(out, needle)


def test_a_missing_extra_is_named_with_its_brackets_and_recipes_say_which_need_one(corpus, own_stores, tmp_path):
    env, *_ = own_stores
    listed = cli("recipes", env=env).stdout
    assert [line.split()[0] for line in listed.splitlines() if "mllm-pipeline[embeddings]" in line] == [
        "cbow",
        "cbow-smoke",
    ]
    assert {line.split()[0] for line in listed.splitlines() if "mllm-pipeline[seq2seq]" in line} >= {"seq2seq-smoke"}
    # An environment without gensim: a module that is not there, first on the path.
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "gensim.py").write_text(
        'raise ModuleNotFoundError("No module named gensim", name="gensim")\n'
    )
    path = os.pathsep.join([str(tmp_path / "missing"), os.environ.get("PYTHONPATH", "")])
    out = cli(
        "run",
        "--recipe",
        "cbow-smoke",
        "--source",
        str(corpus),
        "--set",
        "train.max_steps=5",
        env={**env, "PYTHONPATH": path},
    )
    one_line_error(out, "pip install 'mllm-pipeline[embeddings]'")


def test_a_server_error_is_called_one_and_retried_like_a_cut_connection(failing_server, own_stores):
    url, hits = failing_server
    env, *_ = own_stores
    out = cli("prepare", "--recipe", "smoke", "--source", f"{url}/book.txt", env=env)
    line = one_line_error(out, f"the server of {url}/book.txt answered HTTP 500", "not a missing file")
    assert "not found" not in line
    assert len({h for h in hits}) == 1 and len(hits) >= 3, hits  # the download task's two retries


@pytest.mark.parametrize("form", ["path", "file://"])
def test_a_symbolic_link_loop_is_called_one(form, own_stores, tmp_path):
    env, *_ = own_stores
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.symlink_to(b)
    b.symlink_to(a)
    source = str(a) if form == "path" else f"file://{a}"
    line = one_line_error(cli("prepare", "--recipe", "smoke", "--source", source, env=env), "symbolic link loop")
    assert "not found" not in line and "local copy" not in line


def test_the_readme_synopsis_names_options_that_exist(own_stores):
    env, *_ = own_stores
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    synopsis = readme[readme.index("## The CLI") : readme.index("```", readme.index("## The CLI") + 20)]
    for command, option in [
        (("run",), "--tag"),
        (("run",), "--force"),
        (("sample",), "--storage"),
        (("schedule",), "--timezone"),
        (("stack", "up"), "--pool"),
        (("stack", "up"), "--storage"),
    ]:
        assert option in synopsis, option
        assert option in cli(*command, "--help", env=env).stdout, (command, option)
