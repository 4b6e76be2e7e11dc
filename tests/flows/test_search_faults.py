"""`mllm-pipeline search` where new users met faults (issue 64): a trial pruned before its first log
step, the exit status when trials fail, a space with nothing to search, and the search
benchmark stopped by SIGTERM. (A dead search's flow runs marked Crashed: tests/flows/test_search.py's
kill-and-resume test.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import cli, one_line_error

REPO = Path(__file__).resolve().parents[2]
TINY = ["train.max_steps=40", "train.checkpoint_interval=10", "sample.max_new_tokens=10", "sample.methods=[greedy]"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


@pytest.mark.integration
def test_a_trial_pruned_at_its_first_evaluation_before_any_log_step_is_recorded_pruned(
    corpus: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from flows.search.flow import search

    # Evaluations every 10 steps, the first log step at 40; no terminal (pytest's output), so the
    # training logs its progress as lines. The study's name fixes the sampler's draws: trial 0
    # trains at lr 0.03, trial 1 at 1e-05, whose val loss at step 10 is far above trial 0's.
    result = search(
        recipe="smoke",
        space=["train.lr=0.03,1e-05"],
        trials_n=2,
        sampler="random",
        pruner="median",
        study="first-eval",
        source=str(corpus),
        storage_url=str(tmp_path / "storage"),
        overrides=[*TINY, "train.eval_interval=10", "train.log_interval=40"],
        startup_trials=1,
    )
    (done, pruned) = result.outcomes
    assert (done.params["train.lr"], done.state, done.step) == ("0.03", "complete", 40)
    assert (pruned.params["train.lr"], pruned.state, pruned.step, pruned.error) == ("1e-05", "pruned", 10, None)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(pruned.mlflow_run_id)
    assert run.data.tags["trial_state"] == "pruned" and run.info.status == "FINISHED"
    # The step it stopped at is logged as a log step is: its train loss and tokens per second.
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [10]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "tokens_per_s")] == [10]


@pytest.mark.integration
def test_a_search_with_a_failed_trial_exits_1_after_its_table_as_a_sweep_does(corpus: Path, tmp_path: Path) -> None:
    # A window longer than the validation split resolves, then fails in training (as in
    # tests/test_sweep.py); the study's name fixes the draws: trial 0 that window, trial 1 16.
    out = cli(
        "search",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        str(tmp_path / "storage"),
        "--space",
        "train.window=16,5000",
        "--trials",
        "2",
        "--sampler",
        "random",
        "--pruner",
        "none",
        "--study",
        "one-of-two-fails",
        *_sets([*TINY, "train.eval_interval=20", "train.log_interval=20"]),
    )
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stdout + out.stderr
    assert "best: trial 1" in out.stdout and "study: one-of-two-fails" in out.stdout  # the table and the rest first
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith("error: 1 of 2 trials failed: trial 0 (the validation split has"), errors[0]
    assert errors[0].endswith("their logs: the Prefect flow runs one-of-two-fails-trial-0"), errors[0]

    # The rule is the same for both commands, and each one's help says it.
    for command, what in (("search", "a trial"), ("sweep", "a point")):
        helped = cli(command, "--help")
        assert helped.returncode == 0
        assert f"Exit status 1 when {what}" in " ".join(helped.stdout.split()), helped.stdout


@pytest.mark.parametrize("space", [["model.hidden_size=48"], ["model.hidden_size=48", "train.lr=1e-3..1e-2"]])
def test_a_space_field_with_one_value_is_refused_before_anything_runs(space: list[str], tmp_path: Path) -> None:
    here = tmp_path / "here"
    here.mkdir()
    out = cli("search", "--recipe", "smoke", *[a for s in space for a in ("--space", s)], "--trials", "3", cwd=here)
    one_line_error(out, "--space model.hidden_size=48 has one value: nothing to search", "--set model.hidden_size=48")
    assert list(here.iterdir()) == []  # no study, no storage


@pytest.mark.integration
def test_the_search_benchmark_stopped_by_sigterm_leaves_no_folder_and_no_process(corpus: Path, tmp_path: Path) -> None:
    import psutil

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.search",
            "--quick",
            "--grid-points",
            "2",
            "--fields",
            "1",
            "--steps",
            "20",
            "--pruners",
            "median",
            "--source",
            str(corpus),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        # Stopped while its sweep runs: once the command has written into the benchmark's folder.
        while not list(tmp.glob("bench-search-*/grid/prefect/*")):
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()[0][-3000:]
            time.sleep(0.2)
        family = psutil.Process(bench.pid).children(recursive=True)
        assert family  # the sweep's command, at least
        bench.send_signal(signal.SIGTERM)
        output = bench.communicate(timeout=120)[0]
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert list(tmp.glob("bench-search-*")) == []
    assert [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


@pytest.mark.integration  # its flow runs are on the session's Prefect server
def test_a_dead_search_found_by_its_heartbeat_has_its_flow_runs_crashed_only_once_its_process_is_gone() -> None:
    # PostgreSQL's path (flows/search/dead.py): a stopped heartbeat alone proves no death (a stalled
    # search, one on another machine); a process of this machine that is gone does.
    import socket
    from types import SimpleNamespace

    import psutil
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from flows.search.dead import PROCESS_ATTR, crash_flow_runs

    @flow(name="search")
    def searching() -> None:
        pass

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(ended.pid).create_time()
    ended.wait()
    me = psutil.Process()
    cases = {
        "gone": {"host": socket.gethostname(), "pid": ended.pid, "started": started},
        "alive": {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time()},
        "elsewhere": {"host": "another-machine", "pid": ended.pid, "started": started},
    }
    with get_client(sync_client=True) as client:
        runs = {case: client.create_flow_run(searching, name=f"dead-search-{case}", state=Running()) for case in cases}
        try:
            for case, process in cases.items():
                trial = SimpleNamespace(
                    number=3, user_attrs={PROCESS_ATTR: {"flow_run": str(runs[case].id), **process}}
                )
                assert crash_flow_runs(trial, known_dead=False) == ([f"dead-search-{case}"] if case == "gone" else [])
            states = {case: client.read_flow_run(run.id).state for case, run in runs.items()}
        finally:  # none left in flight on the session's server
            for run in runs.values():
                client.set_flow_run_state(run.id, Completed(), force=True)
    assert states["gone"].is_crashed() and "took over trial 3" in states["gone"].message
    assert states["alive"].is_running() and states["elsewhere"].is_running()
