"""The stack on PostgreSQL, for real: its own cluster (initdb under the stack's home) with training
on its pool, kept across `down`/`up`; a team's server given by `--database-url` whose password
reaches no file, log or terminal; and a sweep with more points than the pool has slots.

The servers run from the machine's PostgreSQL binaries (Debian's /usr/lib/postgresql/N/bin;
`.ci/run` installs them). As root they run as the user `postgres`, so their folders are made in
/tmp where that user can enter (pytest's own temp folders are private to root). Without the
binaries these tests skip, unless MLLM_REQUIRE_POSTGRES=1 (CI) makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from uuid import UUID

import prewarmed
import psycopg
import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterStartTime,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Scheduled
from textdata import make_text

from flows.stack import database
from flows.stack import servers as stack
from flows.stack.pool_api import set_slots
from mllm import UserError

pytestmark = pytest.mark.integration

BIN = database.server_bin()
if BIN is None:
    if os.environ.get("MLLM_REQUIRE_POSTGRES") == "1":
        raise RuntimeError(
            "MLLM_REQUIRE_POSTGRES=1 but PostgreSQL's server is not installed (apt-get install postgresql)"
        )
    pytest.skip("PostgreSQL's server is not installed (apt-get install postgresql)", allow_module_level=True)

FAST = [
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.checkpoint_interval=6",
    "train.log_interval=3",
    "sample.max_new_tokens=20",
]
TEAM_PASSWORD = "s3cret-Team-pw"


@pytest.fixture(scope="module")
def team_server(open_dir: Path) -> Iterator[int]:
    """A PostgreSQL server of the test's own on a free port: role `team` (CREATEDB) with a password."""
    folder = open_dir / "team"
    folder.mkdir()
    user = database.owner()
    if user:
        shutil.chown(folder, user, user)
    pwfile = folder / "pw"
    pwfile.write_text(TEAM_PASSWORD + "\n")
    if user:
        shutil.chown(pwfile, user, user)
    subprocess.run(
        database.as_owner(
            [
                str(BIN / "initdb"),
                "-D",
                str(folder / "data"),
                "-U",
                "team",
                f"--pwfile={pwfile}",
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
                "--no-locale",
            ]
        ),
        check=True,
        capture_output=True,
    )
    port = stack.free_port()
    server = stack.Service(
        "team-postgres",
        database.as_owner(
            [
                str(BIN / "postgres"),
                "-D",
                str(folder / "data"),
                "-p",
                str(port),
                "-h",
                "127.0.0.1",
                "-c",
                "unix_socket_directories=",
            ]
        ),
        str(folder / "server.log"),
    )
    server.start()
    try:
        server.wait_ready(60, ready=lambda: database._accepts(BIN, port))
        yield port
    finally:
        server.stop()


def _worker_env(open_dir: Path) -> dict[str, str]:
    # Two made-up GPUs: each training side by side must see one of its own (flows/gpus.py).
    return {
        "OMP_NUM_THREADS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "MLLM_GPUS": "0,1",
        "MLLM_GPU_LOCKS": str(open_dir / "gpu-locks"),
    }


@pytest.fixture(scope="module")
def pg_stack(open_dir: Path) -> Iterator[dict]:
    """The stack on a PostgreSQL cluster of its own, its pool with 2 slots."""
    home = open_dir / "stack"
    mp = pytest.MonkeyPatch()
    mp.setenv("HOME", str(open_dir / "home"))
    try:
        state = stack.up(
            home, str(open_dir / "storage"), prefect_port=0, mlflow_port=0, slots=2, worker_env=_worker_env(open_dir)
        )
        for k, v in state["env"].items():
            mp.setenv(k, v)
        with temporary_settings({PREFECT_API_URL: state["env"]["PREFECT_API_URL"]}):
            yield {"home": home, "state": state, "root": str(open_dir / "storage"), "dir": open_dir}
    finally:
        stack.down(home, force=True)
        mp.undo()


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return prewarmed.run("flows.cli", list(args), {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd, timeout)


def _until_exit(proc, timeout: float) -> tuple[str, str, float | None]:
    """`proc.communicate(timeout)`, and the seconds from its first `error:` line on stderr to its
    exit (None without one): what a user waits on a prompt after the command said why it ended."""
    deadline = time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    said = None
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                    continue
                chunks[key.fd].append(data)
                if said is None and key.fd == proc.stderr.fileno() and b"\nerror: " in b"\n" + b"".join(chunks[key.fd]):
                    said = time.monotonic()
    proc.wait(max(deadline - time.monotonic(), 1.0))
    ended = time.monotonic()
    out, err = (b"".join(c).decode("utf-8", "replace").replace("\r\n", "\n") for c in chunks.values())
    proc.stdout.close()
    proc.stderr.close()
    return out, err, None if said is None else ended - said


def _cluster_query(home: Path, db: str, sql: str) -> list[tuple]:
    port = database.recorded(home)["database"].rsplit(":", 1)[1]
    password = (home / "postgres" / "password").read_text().strip()
    with psycopg.connect(host="127.0.0.1", port=int(port), user="mllm", password=password, dbname=db) as conn:
        return conn.execute(sql).fetchall()


def test_a_service_run_through_runuser_is_stopped_without_runusers_kill_two_seconds_later(open_dir: Path) -> None:
    # The stack's own PostgreSQL runs under `runuser` as root. Sent SIGTERM, runuser SIGKILLs its
    # command 2 s later, whatever it is doing; so the command is signalled, and given its time
    # (here 3 s, as a shutdown checkpoint can take under load).
    if database.owner() is None:
        pytest.skip("runs as the cluster's own user: no runuser")
    folder = open_dir / "slow-to-stop"
    folder.mkdir()
    folder.chmod(0o777)
    service = stack.Service(
        "slow-to-stop",
        database.as_owner(
            [
                "bash",
                "-c",
                f"trap 'sleep 3; echo finished > {folder}/done; exit 0' TERM; touch {folder}/ready; "
                "while :; do sleep 0.1; done",
            ]
        ),
        str(folder / "slow.log"),
    ).start()
    deadline = time.monotonic() + 30
    while not (folder / "ready").exists():  # its trap in place
        assert service.alive() and time.monotonic() < deadline
        time.sleep(0.05)
    assert service.stop() is True and not service.alive()
    assert (folder / "done").read_text() == "finished\n"
    assert "killed" not in (folder / "slow.log").read_text()


def test_the_stack_on_its_own_postgres_keeps_both_servers_records_in_its_cluster(pg_stack: dict) -> None:
    # What trains on it, and that its records outlive a restart: the two sweeps' test below.
    home = pg_stack["home"]
    assert [s.name for s in pg_stack["state"]["services"]] == ["postgres", "prefect-server", "mlflow-server", "worker"]
    assert database.recorded(home)["database"].startswith(
        f"PostgreSQL {(home / 'postgres/data/PG_VERSION').read_text().strip()} in "
    )
    assert not list(home.rglob("*.db"))  # no SQLite file: both servers are on PostgreSQL
    assert oct((home / "postgres" / "password").stat().st_mode & 0o777) == "0o600"


def test_two_sweeps_at_once_on_a_pool_of_two_slots_run_at_most_two_trainings_and_parallel_bounds_one(
    pg_stack: dict, tmp_path: Path
) -> None:
    # One sweep of two points and one of two that takes one at a time (--parallel 1), together on
    # the pool's two slots: four trainings, never more than two at once (three without the bound),
    # each on a GPU of its own; a sweep's points are flow runs of the pool's deployment, nested
    # under the sweep's MLflow run. Then the cluster holds their records, across a down and up too.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **pg_stack["state"]["env"]}
    started = datetime.now().astimezone()
    steps = ["train.max_steps=30", "train.eval_interval=15", "train.checkpoint_interval=15", "sample.max_new_tokens=10"]
    procs = {}
    for name, seed, options in (
        ("two", 5, ["--grid", "train.lr=1e-3,3e-3"]),
        ("one-at-a-time", 6, ["--parallel", "1", "--grid", "train.lr=1e-3,2e-3"]),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "corpus.txt").write_text(make_text(3000, seed=seed))
        procs[name] = prewarmed.start(
            "flows.cli",
            [
                "sweep",
                "--recipe",
                "smoke",
                "--source",
                str(folder / "corpus.txt"),
                "--storage",
                pg_stack["root"],
                "--train-on",
                "local",
                *options,
                *[a for s in steps for a in ("--set", s)],
            ],
            env,
            folder,
        )
    outs = {}
    for name, proc in procs.items():
        outs[name], err = proc.communicate(timeout=500)
        assert proc.returncode == 0, (name, err[-3000:])
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    parent_id = next(line.split()[-1] for line in outs["two"].splitlines() if line.startswith("sweep mlflow run:"))
    points = client.search_runs(
        [client.get_run(parent_id).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'"
    )
    assert len(points) == 2 and all(r.data.tags["train.pool"] == "local" for r in points)
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as prefect:
        trains = prefect.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])),
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=started)),
        )
        held = {}  # a training's GPU, and the times of its lines "training on GPU" and "... free again"
        for t in trains:
            logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[t.id])))
            took = next(m for m in logs if "CUDA_VISIBLE_DEVICES=" in m.message)
            freed = next(m for m in logs if "free again" in m.message)
            held[t.id] = (
                took.message.rsplit("CUDA_VISIBLE_DEVICES=", 1)[1].rstrip(")"),
                took.timestamp,
                freed.timestamp,
            )
    assert len(trains) == 4 and all(t.state.is_completed() and t.work_pool_name == "local" for t in trains)
    assert {t.parameters.get("run_id") for t in trains} >= {r.info.run_id for r in points}
    # Never more than the pool's two slots at once. (Whether two ran side by side at some moment is
    # the worker's polling's business: under three test workers on 2 cores, these 8 s trainings
    # started 20 s apart.) The sweep of two handed its second point to the pool before its first
    # had ended, as its points wait for slots, not for each other.
    assert _most_at_once(trains) <= 2, [(t.start_time, t.end_time) for t in trains]
    two = sorted((t for t in trains if "/two/" in str(t.parameters["cfg"]["data"]["source"])), key=lambda t: t.created)
    assert len(two) == 2 and two[1].created < two[0].end_time, [(t.created, t.end_time) for t in two]
    # Trainings that held a GPU at the same time held different ones of the worker's two: a GPU
    # goes to the next training only once the last freed it. (A flow run's own window is wider:
    # it starts before its training takes a GPU and ends after it frees it.)
    assert {g for g, _, _ in held.values()} <= {"0", "1"}
    same_gpu = [(a, b) for a in held for b in held if a < b and held[a][0] == held[b][0]]
    windows = sorted((f"{took:%H:%M:%S.%f}", f"{freed:%H:%M:%S.%f}", g) for g, took, freed in held.values())
    assert all(held[a][2] <= held[b][1] or held[b][2] <= held[a][1] for a, b in same_gpu), windows
    # The --parallel 1 sweep took one slot at a time: each of its trainings submitted after the last ended.
    bounded = sorted(
        (t for t in trains if "one-at-a-time" in str(t.parameters["cfg"]["data"]["source"])), key=lambda t: t.created
    )
    assert len(bounded) == 2 and _most_at_once(bounded) == 1
    assert all(later.created >= earlier.end_time for earlier, later in zip(bounded, bounded[1:]))

    bad = _cli("sweep", "--recipe", "smoke", "--parallel", "0", "--grid", "train.lr=1e-3,2e-3", cwd=tmp_path, env=env)
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: --parallel 0: give at least 1 (the points that run at once)"
    )

    # The rows are in the cluster's databases: MLflow's runs, Prefect's training flow runs on the pool.
    home, run_id = pg_stack["home"], points[0].info.run_id
    assert _cluster_query(home, "mllm_mlflow", f"SELECT status FROM runs WHERE run_uuid = '{run_id}'") == [
        ("FINISHED",)
    ]
    assert ("COMPLETED", "local") in _cluster_query(
        home,
        "mllm_prefect",
        "SELECT f.state_type::text, w.name FROM flow_run f JOIN work_queue q ON f.work_queue_id = q.id "
        "JOIN work_pool w ON q.work_pool_id = w.id",
    )
    # Down stops the cluster with the rest; up starts the same cluster again, records and all.
    stopped = dict(stack.down(home))
    assert stopped["postgres"] is True and not any(s.alive() for s in pg_stack["state"]["services"])
    again = stack.up(
        home, pg_stack["root"], prefect_port=0, mlflow_port=0, slots=2, worker_env=_worker_env(pg_stack["dir"])
    )
    pg_stack["state"] = again
    assert MlflowClient(again["env"]["MLFLOW_TRACKING_URI"]).get_run(run_id).info.status == "FINISHED"
    assert stack.slots_of(again["env"]["PREFECT_API_URL"], "local") == 2


def _most_at_once(runs) -> int:
    events = sorted([(r.start_time, 1) for r in runs] + [(r.end_time, -1) for r in runs], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_two_searches_on_the_stacks_postgres_share_one_study_and_together_run_its_trials_once(
    pg_stack: dict, tmp_path: Path
) -> None:
    # The study lives in the stack's cluster (database mllm_optuna): two search processes started
    # together on it each take trials until the study has its five, none run twice.
    home = pg_stack["home"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **pg_stack["state"]["env"], "MLLM_STACK_HOME": str(home)}
    password = (home / "postgres" / "password").read_text().strip()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=11))
    started = datetime.now().astimezone()
    args = [
        "search",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        pg_stack["root"],
        "--space",
        "train.lr=log:1e-4..1e-2",
        "--trials",
        "5",
        "--sampler",
        "random",
        "--startup-trials",
        "1",
        "--study",
        "shared",
        *[a for s in FAST for a in ("--set", s)],
    ]
    procs = [prewarmed.start("flows.cli", args, env, tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=500) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "already finished" not in out + err and "Traceback" not in err
        assert password not in out + err
        port = database.recorded(home)["database"].rsplit(":", 1)[1]
        assert f"study: shared in postgresql://mllm@127.0.0.1:{port}/mllm_optuna" in out
    assert not (Path(pg_stack["root"]).parent / "optuna.db").exists() and not (tmp_path / "optuna.db").exists()

    trials = _cluster_query(
        home,
        "mllm_optuna",
        "SELECT t.number, t.state::text, t.trial_id FROM trials t JOIN studies s "
        "ON t.study_id = s.study_id WHERE s.study_name = 'shared' ORDER BY t.number",
    )
    assert [n for n, _, _ in trials] == [0, 1, 2, 3, 4], trials
    assert {state for _, state, _ in trials} <= {"COMPLETE", "PRUNED"}, trials
    # Each trial beat its heartbeat while it ran (Optuna's own table).
    beats = _cluster_query(home, "mllm_optuna", "SELECT DISTINCT trial_id FROM trial_heartbeats")
    assert {t for _, _, t in trials} <= {b for (b,) in beats}

    # One MLflow run per trial, under the one study run; and both searches ran trials.
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("smoke").experiment_id
    parents = client.search_runs([experiment], "tags.`search.study` = 'shared' and tags.`search.parent` = 'true'")
    # (MLflow's params are scrubbed: a URL's user is hidden as well)
    assert (
        len(parents) == 1 and parents[0].data.params["study_file"] == f"postgresql://***@127.0.0.1:{port}/mllm_optuna"
    )
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(int(r.data.tags["search.trial"]) for r in children) == [0, 1, 2, 3, 4]
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as prefect:
        trial_runs = prefect.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["search-trial"])),
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=started)),
        )
        searches = {prefect.read_task_run(r.parent_task_run_id).flow_run_id for r in trial_runs}
    assert len(trial_runs) == 5 and len(searches) == 2, (len(trial_runs), searches)
    # The cluster's password reached neither server's records.
    for db, sql in (
        ("mllm_mlflow", "SELECT count(*) FROM params WHERE value LIKE %s"),
        ("mllm_mlflow", "SELECT count(*) FROM tags WHERE value LIKE %s"),
        ("mllm_prefect", "SELECT count(*) FROM log WHERE message LIKE %s"),
        ("mllm_prefect", "SELECT count(*) FROM flow_run WHERE parameters::text LIKE %s"),
    ):
        assert _cluster_query(home, db, sql.replace("%s", f"'%{password}%'")) == [(0,)], (db, sql)


def test_a_search_killed_by_ctrl_c_then_sigkill_on_the_stacks_postgres_resumes_its_trial_from_each_checkpoint(
    pg_stack: dict, tmp_path: Path
) -> None:
    # tests/flows/test_search.py's kill-and-resume on the stack's study database rather than a local file,
    # interrupted both ways in turn: the first search Ctrl-C'd (SIGINT to the command, as a terminal
    # sends it) mid-training, the second, which resumed that trial, killed with its process group
    # (SIGKILL) mid the resumed training; the third resumes it again, from the newer checkpoint,
    # with the same parameters, and finishes the study.
    import optuna

    from mllm.runtime.checkpoint import read_checkpoint

    home = pg_stack["home"]
    # A trial counts as dead once its search has been silent 3 s, not 90 (MLLM_SEARCH_GRACE_S).
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **pg_stack["state"]["env"],
        "MLLM_STACK_HOME": str(home),
        "MLLM_SEARCH_GRACE_S": "3",
    }
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=23))
    # A checkpoint every 10 steps: the Ctrl-C comes at the first, the kill at the next after the
    # resume, and the steps after it (a few ms each) leave the kill seconds to land under load.
    steps = 200
    sets = [
        f"train.max_steps={steps}",
        "train.eval_interval=100",
        "train.checkpoint_interval=10",
        "train.log_interval=10",
        "sample.max_new_tokens=10",
        "sample.methods=[greedy]",
    ]
    args = [
        "search",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        pg_stack["root"],
        "--space",
        "train.lr=1e-3..3e-3",
        "--trials",
        "2",
        "--sampler",
        "random",
        "--pruner",
        "none",
        "--study",
        "resumed",
        *[a for s in sets for a in ("--set", s)],
    ]
    runs = Path(pg_stack["root"]) / "runs"
    before = set(runs.glob("*/checkpoints/last.pt"))

    def states() -> list[str]:
        return [
            s
            for (s,) in _cluster_query(
                home,
                "mllm_optuna",
                "SELECT t.state::text FROM trials t JOIN studies s ON "
                "t.study_id = s.study_id WHERE s.study_name = 'resumed' "
                "ORDER BY t.number",
            )
        ]

    def interrupted(until, stop) -> tuple[int, str]:
        """A search started and, once `until()` holds mid-training, stopped by `stop(pid)`."""
        proc = prewarmed.start("flows.cli", args, env, tmp_path, new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not until():
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.05)
            stopped = time.monotonic()
            stop(proc.pid)
            _, err = proc.communicate(timeout=30)  # promptly: a hang fails here
            print(f"the search ended {time.monotonic() - stopped:.1f} s after its signal, exit {proc.returncode}")
            return proc.returncode, err
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    # Ctrl-C once the first checkpoint is written: the training writes last.pt at the step it came,
    # and the search, which knows its trial is dead, fails it and queues it again at once.
    code, err = interrupted(
        lambda: set(runs.glob("*/checkpoints/last.pt")) - before, lambda pid: os.kill(pid, signal.SIGINT)
    )
    assert code == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
    line = (
        "error: interrupted: finished stages and the last checkpoint are kept; run the same command to continue "
        "from them"
    )
    assert [e for e in err.splitlines() if e.startswith("error:")] == [line] and err.strip().endswith(line), err[-3000:]
    (ckpt,) = set(runs.glob("*/checkpoints/last.pt")) - before
    at_ctrl_c = int(read_checkpoint(str(ckpt), "cpu")["step"])
    assert 0 < at_ctrl_c < steps
    assert states() == ["FAIL", "WAITING"]
    assert _cluster_query(
        home, "mllm_prefect", "SELECT state_type::text FROM flow_run WHERE name = 'resumed-trial-0'"
    ) == [("CANCELLED",)]

    # Again at once (no grace to wait: the trial is queued), killed once the resumed training has
    # written a newer checkpoint: nothing tells the study, whose trial stays RUNNING.
    seen = [ckpt.stat().st_mtime_ns]

    def newer() -> bool:
        if ckpt.stat().st_mtime_ns == seen[0]:
            return False
        seen[0] = ckpt.stat().st_mtime_ns
        return int(read_checkpoint(str(ckpt), "cpu")["step"]) > at_ctrl_c

    code, _ = interrupted(newer, lambda pid: os.killpg(pid, signal.SIGKILL))
    at_kill = int(read_checkpoint(str(ckpt), "cpu")["step"])
    assert code == -signal.SIGKILL and at_ctrl_c < at_kill < steps
    assert states() == ["FAIL", "RUNNING"]  # nobody told the study
    time.sleep(4)  # its heartbeat silent past the grace

    out = _cli(*args, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed (resumed by trial 1)" in out.stdout and "failed (resumed by trial 2)" in out.stdout, out.stdout[
        -2000:
    ]
    # Each dead one, resumed by the next; the second trial: every trial once, none lost or repeated.
    assert states() == ["FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    port = database.recorded(home)["database"].rsplit(":", 1)[1]
    password = (home / "postgres" / "password").read_text().strip()
    study = optuna.load_study(
        study_name="resumed", storage=f"postgresql+psycopg://mllm:{password}@127.0.0.1:{port}/mllm_optuna"
    )
    first, once, twice, second = study.trials
    assert first.params == once.params == twice.params and second.params != first.params
    # The same params, the same training folder: on from the step its checkpoint held, to the end.
    assert twice.user_attrs["resumed_from_step"] == at_kill and twice.user_attrs["step"] == steps
    assert second.user_attrs["resumed_from_step"] == 0
    assert len(set(runs.glob("*/checkpoints/last.pt")) - before) == 2  # no third training folder

    # The MLflow runs of the dead trials ended KILLED, each saying which trial resumed it; each run
    # logs from its checkpoint on (Ctrl-C's at the step it came, SIGKILL's at an interval), no step
    # lost between them.
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    by_trial = {t.number: client.get_run(_trial_run(client, t.number)) for t in (first, once, twice)}
    for number in (0, 1):
        run = by_trial[number]
        assert (run.info.status, run.data.tags["trial_state"]) == ("KILLED", "failed")
        assert run.data.tags["search.resumed_by"] == str(number + 1)
    assert by_trial[2].info.status == "FINISHED" and by_trial[2].data.tags["search.resumes"] == "1"
    logged = {n: [m.step for m in client.get_metric_history(r.info.run_id, "train_loss")] for n, r in by_trial.items()}
    assert min(logged[1]) == (at_ctrl_c // 10 + 1) * 10 and min(logged[2]) == at_kill + 10 and max(logged[2]) == steps
    assert sorted(set().union(*logged.values())) == list(range(10, steps + 1, 10))


def _trial_run(client: MlflowClient, number: int) -> str:
    (run,) = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id],
        f"tags.`search.study` = 'resumed' and tags.`search.trial` = '{number}'",
    )
    return run.info.run_id


def test_a_team_server_by_url_takes_the_stacks_records_and_its_password_goes_nowhere(
    team_server: int, open_dir: Path, tmp_path: Path
) -> None:
    home = open_dir / "team-stack"
    url = f"postgresql://team:{TEAM_PASSWORD}@127.0.0.1:{team_server}/shared"
    up = _cli(
        "stack",
        "up",
        "--home",
        str(home),
        "--database-url",
        url,
        "--prefect-port",
        "0",
        "--mlflow-port",
        "0",
        "--storage",
        str(open_dir / "team-storage"),
        cwd=tmp_path,
        timeout=300,
    )
    status = up
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert (
            f"PostgreSQL at postgresql://team@127.0.0.1:{team_server} (databases shared_prefect, shared_mlflow)"
            in up.stdout
        )
        # The default: one slot per GPU, else one per two cores.
        assert f"slots           {stack.default_slots()} " in up.stdout
        # `up --slots` on the running stack changes the pool's limit, nothing else.
        resize = _cli("stack", "up", "--home", str(home), "--slots", "3", cwd=tmp_path)
        assert resize.returncode == 0 and "slots           3 " in resize.stdout, resize.stderr[-2000:]
        assert TEAM_PASSWORD not in resize.stdout + resize.stderr
        state = stack.load(home)
        assert [s.name for s in state["services"]] == [
            "prefect-server",
            "mlflow-server",
            "worker",
        ]  # no cluster of its own
        client = MlflowClient(state["env"]["MLFLOW_TRACKING_URI"])
        client.create_experiment("team-experiment")
        status = _cli("stack", "status", "--home", str(home), cwd=tmp_path)
        assert status.returncode == 0 and "shared_prefect" in status.stdout
        with psycopg.connect(
            host="127.0.0.1", port=team_server, user="team", password=TEAM_PASSWORD, dbname="shared_mlflow"
        ) as conn:
            assert conn.execute("SELECT name FROM experiments WHERE name = 'team-experiment'").fetchall()
        with psycopg.connect(
            host="127.0.0.1", port=team_server, user="team", password=TEAM_PASSWORD, dbname="shared_prefect"
        ) as conn:
            assert conn.execute("SELECT concurrency_limit FROM work_pool WHERE name = 'local'").fetchall() == [(3,)]
    finally:
        down = _cli("stack", "down", "--home", str(home), cwd=tmp_path)
    assert down.returncode == 0
    for text in (up.stdout, up.stderr, status.stdout, status.stderr, down.stdout, down.stderr):
        assert TEAM_PASSWORD not in text
    files = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name == "prefect-server.log" for p in files)
    for path in files:
        assert TEAM_PASSWORD.encode() not in path.read_bytes(), path

    # A wrong password: one line naming the server (not the password), exit 2, nothing left running.
    bad = _cli(
        "stack",
        "up",
        "--home",
        str(open_dir / "bad"),
        "--database-url",
        f"postgresql://team:wrong-{TEAM_PASSWORD}@127.0.0.1:{team_server}/shared",
        "--prefect-port",
        "0",
        "--mlflow-port",
        "0",
        cwd=tmp_path,
        timeout=120,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    # (the terminal's scrubber hides a URL's user as well)
    assert lines[-1].startswith("error: the database server postgresql://")
    assert f"@127.0.0.1:{team_server} did not take the stack's databases shared_prefect, shared_mlflow" in lines[-1]
    assert "password authentication failed" in lines[-1] and TEAM_PASSWORD not in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr and not stack.load(open_dir / "bad")["services"]


def test_a_pipeline_on_a_pool_of_one_slot_that_trains_on_that_pool_is_refused_in_one_line(
    pg_stack: dict, tmp_path: Path
) -> None:
    env, api = pg_stack["state"]["env"], pg_stack["state"]["env"]["PREFECT_API_URL"]
    set_slots(api, "local", 1)
    try:
        out = _cli(
            "schedule",
            "--recipe",
            "smoke",
            "--interval",
            "3600",
            "--pool",
            "local",
            "--train-on",
            "local",
            cwd=tmp_path,
            env=env,
        )
    finally:
        set_slots(api, "local", 2)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: pool 'local' has one slot, which the pipeline's own flow run takes: its training, handed to the same "
        "pool, would wait for that slot for ever. Give the pool two or more (`mllm-pipeline stack up --slots 2`, or "
        "`prefect work-pool set-concurrency-limit local 2`), or train on another pool (--train-on)"
    ], out.stderr
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        assert not [d for d in prefect.read_deployments() if d.name == "smoke"]  # nothing half-made


def test_a_pipeline_flow_run_on_a_pool_of_one_slot_refuses_to_hand_its_training_to_that_pool(
    pg_stack: dict, tmp_path: Path, monkeypatch
) -> None:
    # Scheduled while the pool had two slots; then the pool is cut to one, which the pipeline's own
    # flow run takes: its training would wait for ever, so the pipeline refuses before its data
    # stages. The flow run is the deployment's own, made by the server; its pipeline runs here, in
    # the process the worker would have started, with the variable the worker sets
    # (PREFECT__FLOW_RUN_ID). That a flow run's error ends it Failed, naming the form's fields, is
    # test_stack.py's test_a_ui_run_with_bad_parameters_fails_naming_the_forms_fields.
    from flows import dispatch, schedule
    from flows.training import train

    api = pg_stack["state"]["env"]["PREFECT_API_URL"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=9))
    # The stack's server named here, as the one-line test above does for its client: not left to
    # whichever settings context this worker's earlier modules left current.
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        deployment = schedule.upsert(
            "smoke",
            interval=3600,
            pool="local",
            train_on="local",
            source=str(corpus),
            storage_url=pg_stack["root"],
            overrides=FAST,
            paused=True,
        )
        # Due in an hour, lest the stack's worker start it meanwhile.
        run = prefect.create_flow_run_from_deployment(
            UUID(deployment["id"]), state=Scheduled(scheduled_time=datetime.now(timezone.utc) + timedelta(hours=1))
        )
        assert run.work_pool_name == "local"
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(run.id))
        dispatch.ensure_deployment(train, "local")  # two slots: the training may wait for the second
        set_slots(api, "local", 1)
        try:
            with pytest.raises(UserError) as refused:
                dispatch.ensure_deployment(train, "local")
        finally:
            set_slots(api, "local", 2)
            prefect.delete_flow_run(run.id)
            schedule.delete("smoke")
    assert str(refused.value) == dispatch.one_slot("local")


def test_a_dataset_two_runs_log_in_the_same_instant_is_linked_to_both(pg_stack: dict, monkeypatch) -> None:
    # MLflow's server looks a dataset up, then inserts it: another insert of the same dataset between
    # the two (a sweep's points log one corpus at once) made it refuse the run's input with
    # PostgreSQL's duplicate key, a raw line and a retried task in the sweep. Made certain here: the
    # database holds that other insert uncommitted, so the server's lookup misses it and its own
    # insert waits on the key until the other commits.
    import threading
    import uuid

    from mllm.config import RunConfig
    from tasks.tracking.tracker import RunTracker

    home = pg_stack["home"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", pg_stack["state"]["env"]["MLFLOW_TRACKING_URI"])  # the stack's server
    client = MlflowClient(pg_stack["state"]["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.create_experiment(f"dataset-race-{uuid.uuid4().hex[:8]}")
    run_id = client.create_run(experiment).info.run_id
    digest = uuid.uuid4().hex
    port = int(database.recorded(home)["database"].rsplit(":", 1)[1])
    login = dict(
        host="127.0.0.1",
        port=port,
        user="mllm",
        password=(home / "postgres" / "password").read_text().strip(),
        dbname="mllm_mlflow",
    )
    failed: list[BaseException] = []

    def log() -> None:
        try:
            RunTracker.attach(run_id, RunConfig(), pg_stack["root"]).log_dataset(
                "corpus", "/data/corpus.txt", digest, "raw"
            )
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            failed.append(e)

    racing, row = threading.Thread(target=log), None
    with psycopg.connect(**login) as other, psycopg.connect(**login, autocommit=True) as watcher:
        other.execute(
            "INSERT INTO datasets (dataset_uuid, experiment_id, name, digest, dataset_source_type, "
            "dataset_source) VALUES (%s, %s, 'corpus', %s, 'local', '/data/corpus.txt')",
            (uuid.uuid4().hex, int(experiment), digest),
        )
        racing.start()
        deadline = time.monotonic() + 60
        while row is None and racing.is_alive() and time.monotonic() < deadline:
            row = watcher.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE 'INSERT INTO datasets%'"
            ).fetchone()
            time.sleep(0.1)
        other.commit()  # the other insert lands; the server's, waiting on the key, is refused
    racing.join(60)
    assert row is not None, "the server's insert never waited on the other: the race was not made"
    assert not failed, failed
    inputs = client.get_run(run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("corpus", digest)]


def test_stack_up_marks_the_pools_flow_runs_whose_process_is_gone_as_crashed(pg_stack: dict, tmp_path: Path) -> None:
    # A training on the pool whose worker is killed with it (SIGKILL: nothing can write its state),
    # and the pipeline following it too: Prefect's records keep it Running, holding a slot.
    home, env = pg_stack["home"], pg_stack["state"]["env"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=8))
    steps = [
        "train.max_steps=2000",
        "train.checkpoint_interval=20",
        "train.log_interval=10",
        "sample.max_new_tokens=10",
    ]
    runs = Path(pg_stack["root"]) / "runs"
    before = set(runs.glob("*/checkpoints/last.pt"))
    proc = prewarmed.start(
        "flows.cli",
        [
            "run",
            "--recipe",
            "smoke",
            "--source",
            str(corpus),
            "--storage",
            pg_stack["root"],
            "--train-on",
            "local",
            *[a for s in steps for a in ("--set", s)],
        ],
        {**os.environ, "OMP_NUM_THREADS": "1", **env},
        tmp_path,
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not set(runs.glob("*/checkpoints/last.pt")) - before and proc.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        worker = next(s for s in stack.load(home)["services"] if s.name == "worker")
        for pid in [worker.pid, *stack.descendants(worker.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    api = env["PREFECT_API_URL"]
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        running = [
            r for r in prefect.read_flow_runs() if r.state_type.value == "RUNNING" and r.work_pool_name == "local"
        ]
    assert len(running) == 1, running

    up = _cli("stack", "up", "--home", str(home), cwd=tmp_path, env={"HOME": str(pg_stack["dir"] / "home")})
    assert up.returncode == 0, up.stderr[-3000:]
    assert (
        f"marked Crashed, freeing their slots of pool 'local': 1 flow run(s) whose process is gone ({running[0].name}); "
        "run their commands again to resume them"
    ) in up.stderr, up.stderr
    assert "started again: worker" in up.stderr
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        run = prefect.read_flow_run(running[0].id)
    assert run.state_type.value == "CRASHED" and "its process is gone" in run.state.message
    # Nothing else is judged gone: a second `up` marks nothing.
    again = _cli("stack", "up", "--home", str(home), cwd=tmp_path, env={"HOME": str(pg_stack["dir"] / "home")})
    assert again.returncode == 0 and "marked Crashed" not in again.stderr
    # The pipeline killed with SIGKILL closed nothing: its MLflow run is closed here, as its user would.
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    for r in client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "attributes.status = 'RUNNING'"
    ):
        client.set_terminated(r.info.run_id, "KILLED")


def test_the_database_stopped_under_a_sweep_ends_it_in_one_line_and_its_rerun_trains_each_point_once(
    pg_stack: dict, tmp_path: Path
) -> None:
    # Last in this module: it stops the stack's database under the servers. A sweep of three points
    # on the pool, cut to one slot for it: one trains, the others wait in the pool's queue, when the
    # database stops at the first checkpoint. (On two slots the third point had to come while the
    # first two trained; the sweep hands its points over seconds apart, and under a loaded CI run
    # all three trained before the third was seen queued, c034eb3.)
    home, env = pg_stack["home"], {**pg_stack["state"]["env"], "MLLM_STACK_HOME": str(pg_stack["home"])}
    # 1,200 steps (about 15 s a training on one quiet Zen 3 core): with 300, the first training ended
    # before the sweep had handed over its last point (CI-like run of ebb480c).
    max_steps = 1200
    steps = [
        f"train.max_steps={max_steps}",
        "train.eval_interval=400",
        "train.checkpoint_interval=50",
        "train.log_interval=40",
        "sample.max_new_tokens=10",
    ]
    runs = Path(pg_stack["root"]) / "runs"
    api = env["PREFECT_API_URL"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(3000, seed=7))
    args = [
        "sweep",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        pg_stack["root"],
        "--train-on",
        "local",
        "--grid",
        "train.lr=1e-3,2e-3,3e-3",
        *[a for s in steps for a in ("--set", s)],
    ]

    def command(client_env: dict[str, str]) -> subprocess.Popen:
        return prewarmed.start("flows.cli", args, {**os.environ, "OMP_NUM_THREADS": "1", **env, **client_env}, tmp_path)

    def stop_database() -> float:
        # The database goes away as an administrator stops it (`pg_ctl stop`), under the command.
        subprocess.run(
            database.as_owner([str(BIN / "pg_ctl"), "stop", "-D", str(home / "postgres" / "data"), "-m", "fast"]),
            check=True,
            capture_output=True,
        )
        return time.monotonic()

    def stack_up() -> subprocess.CompletedProcess:
        return _cli("stack", "up", "--home", str(home), cwd=tmp_path, env={"HOME": str(pg_stack["dir"] / "home")})

    def through_outage(proc: subprocess.Popen, while_down=lambda: None) -> tuple[str, str, float | None]:
        """Stop the database under the running command, do `while_down`, and wait for its end; the
        seconds from its `error:` line to its exit (None without one) come last."""
        try:
            stopped = stop_database()
            assert proc.poll() is None, "the command ended before the database stopped"
            while_down()
            out, err, after_line = _until_exit(proc, timeout=300)
            print(
                f"the sweep ended {time.monotonic() - stopped:.1f} s after the database stopped, exit "
                f"{proc.returncode}" + ("" if after_line is None else f", {after_line:.1f} s after its error line")
            )
            return out, err, after_line
        finally:
            if proc.poll() is None:
                proc.kill()

    def flow_runs(after: datetime, flow: str | None = None) -> list:
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
            return prefect.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])) if flow else None,
                flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=after)),
            )

    # Down for longer than the command's retries (told here to give up after two, a point's retry
    # to come after a second and to wait three for the servers): one line. The trainings it handed
    # to the pool go on in the worker, whose client retries for minutes (PREFECT_CLIENT_MAX_RETRIES
    # 7, flows/__init__.py), and finish once `stack up` below starts the database again.
    set_slots(api, "local", 1)
    started = datetime.now().astimezone()
    before = set(runs.glob("*/checkpoints/last.pt"))
    proc = command({"PREFECT_CLIENT_MAX_RETRIES": "2", "MLLM_SWEEP_RETRY_DELAY_S": "1", "MLLM_SERVERS_WAIT_S": "3"})
    deadline = time.monotonic() + 240
    while not set(runs.glob("*/checkpoints/last.pt")) - before and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None and set(runs.glob("*/checkpoints/last.pt")) - before, proc.stderr.read()[-3000:]

    def waiting() -> list[str]:
        trainings = flow_runs(started, "train")
        return [r.name for r in trainings if r.state_type.value == "SCHEDULED"] if len(trainings) == 3 else []

    # The other points' trainings, waiting for the slot (both, unless the first ended before the
    # sweep handed over the last).
    while not (queued := waiting()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert queued, [(r.name, r.state_name) for r in flow_runs(started, "train")]
    out, err, after_line = through_outage(proc)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the database of the Prefect and MLflow servers is down (the stack's PostgreSQL "), (
        last
    )
    assert f"in {home / 'postgres'} on 127.0.0.1:" in last and "`mllm-pipeline stack up`" in last
    for noise in ("Traceback", "asyncpg", "psycopg", "Error logging to API", "PrefectHTTPStatusError"):
        assert noise not in err, [line for line in err.splitlines() if noise in line]
    # And it ends then, not after Prefect's client has retried its unsent log lines against the
    # server that answers 503 (16 s with these two retries, minutes with the default 7).
    assert after_line is not None and after_line < 10, after_line

    status = _cli("stack", "status", "--home", str(home), cwd=tmp_path)
    assert status.returncode == 1
    assert any(line.startswith("postgres        NOT RUNNING") for line in status.stdout.splitlines()), status.stdout
    assert "down: postgres (the servers' database)" in status.stdout
    servers = {s.name: s.pid for s in stack.load(home)["services"] if s.name in ("prefect-server", "mlflow-server")}

    up = stack_up()
    assert up.returncode == 0, up.stderr[-3000:]
    assert "started again: postgres" in up.stderr and "prefect-server, mlflow-server" in up.stderr.split("reused:")[1]
    # The sweep's flow run and its three points' pipelines, which the command could not end.
    assert (
        "marked Crashed: 4 flow run(s) left in flight by commands that ended as the database was down" in up.stderr
    ), up.stderr
    # The trainings still queued would run for no one and take the slot from the sweep run again.
    assert (
        f"cancelled: {len(queued)} training(s) those commands had queued on pool 'local' ({queued[0]}" in up.stderr
    ), up.stderr
    assert {s.name: s.pid for s in stack.load(home)["services"] if s.name in servers} == servers  # reused as they ran
    assert _cli("stack", "status", "--home", str(home), cwd=tmp_path).returncode == 0

    # The training on the pool ends once its client's back-off (doubling from 2 s) meets the
    # database again: waited for here, lest the outage below catch it too and double its next wait.
    deadline = time.monotonic() + 240
    while [r for r in flow_runs(started) if not r.state.is_final()] and time.monotonic() < deadline:
        time.sleep(0.5)
    first = sorted((r.name, r.state_name) for r in flow_runs(started))
    cancelled = ["Cancelled"] * len(queued)
    assert sorted(state for _, state in first if state != "Completed") == [*cancelled, *["Crashed"] * 4], first
    trained = ["Completed"] * (3 - len(queued))
    assert sorted(r.state_name for r in flow_runs(started, "train")) == [*cancelled, *trained], first
    set_slots(api, "local", 2)  # the pool's own limit again

    # The same command again, with the clients' retries (minutes), and the database down under it
    # for less than those: stopped once a worker has taken a training the command handed to the
    # pool, started again 8 s later by `stack up`. Prefect's server answers 503 meanwhile, which
    # every client retries, and the command goes on. MLflow, on the same database, may answer 500
    # or 503: its records are held and sent once it answers, as the tracking tests show.
    again_started = datetime.now().astimezone()
    proc = command({})
    deadline = time.monotonic() + 240
    while not [r for r in flow_runs(again_started, "train") if r.state_type.value != "SCHEDULED"]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.5)

    def back_in_eight_seconds() -> None:
        time.sleep(8)
        back = stack_up()
        assert back.returncode == 0 and "started again: postgres" in back.stderr, back.stderr[-3000:]
        assert "marked Crashed" not in back.stderr, back.stderr[-3000:]  # the command in flight is not judged gone

    out, err, _ = through_outage(proc, back_in_eight_seconds)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "Server error '500" not in err and "PrefectHTTPStatusError" not in err, err[
        -3000:
    ]
    # Each point trained once: those the worker finished are found in storage, the cancelled ones
    # train now (their trainings' MLflow tags say where each began).
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    parent = next(line.split()[-1] for line in out.splitlines() if line.startswith("sweep mlflow run:"))
    points = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(r.data.tags["train.resumed_from_step"] for r in points) == ["0"] * len(queued) + [str(max_steps)] * (
        3 - len(queued)
    ), [r.data.tags for r in points]
    # Nothing is left in flight: no MLflow run RUNNING, and every flow run of this command Completed.
    assert _cluster_query(home, "mllm_mlflow", "SELECT count(*) FROM runs WHERE status = 'RUNNING'") == [(0,)]
    states = [(r.name, r.state_name) for r in flow_runs(again_started)]
    assert [s for s in states if s[1] != "Completed"] == [] and len(states) >= 7, states
    assert (
        _cluster_query(
            home,
            "mllm_prefect",
            "SELECT name, state_type::text FROM flow_run WHERE state_type::text IN "
            "('RUNNING', 'PENDING', 'SCHEDULED', 'CANCELLING') AND "
            f"created >= '{started.isoformat()}'",
        )
        == []
    )
