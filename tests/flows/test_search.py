"""`mllm-pipeline search`: the space, bad input, the training loop's pruning hook, a real search of
the smoke recipe whose pruned trials say so in MLflow, and a study that resumes a killed trial
from its checkpoint."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import prewarmed
import pytest
import torch

from flows.search.space import check_space, parse_space
from mllm import UserError
from mllm.resolve import Overrides

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "train.max_steps=40",
    "train.eval_interval=10",
    "train.checkpoint_interval=10",
    "train.log_interval=10",
    "sample.max_new_tokens=10",
    "sample.methods=[greedy]",
]


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return prewarmed.run("flows.cli", list(args), dict(os.environ, COLUMNS="200"), REPO, timeout)


def _sets(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


# --- the space -----------------------------------------------------------------------------


def test_space_specs_are_lists_and_ranges() -> None:
    space = parse_space(
        [
            "model.n_layer=1, 2,3",
            "train.lr=log:1e-4..1e-2",
            "model.hidden_size=int:16..64",
            "train.dropout=0..0.5",
            "sample.methods=[greedy],[top-p, greedy]",
        ]
    )
    assert space["model.n_layer"].choices == ("1", "2", "3")
    lr = space["train.lr"]
    assert (lr.low, lr.high, lr.log, lr.integer) == (1e-4, 1e-2, True, False)
    assert lr.spec == "log:0.0001..0.01" and lr.edges() == ["0.0001", "0.01"]
    hidden = space["model.hidden_size"]
    assert (hidden.low, hidden.high, hidden.integer, hidden.log) == (16, 64, True, False)
    assert hidden.spec == "int:16..64"
    assert space["sample.methods"].choices == ("[greedy]", "[top-p, greedy]")
    base = check_space("smoke", parse_space(["train.lr=log:1e-4..1e-2", "model.hidden_size=int:16..64"]))
    assert base.recipe == "smoke"


@pytest.mark.parametrize(
    "items, needle",
    [
        ([], "give at least one --space"),
        (["train.lr"], "malformed --space"),
        (["train.lr=1e-2..1e-4"], "the low end 1e-2 is not below the high end 1e-4"),
        (["train.lr=1e-3..1e-3"], "not below"),
        (["train.lr=log:0..1e-2"], "a log: range needs both ends above 0"),
        (["train.lr=log:-1..1"], "above 0"),
        (["model.hidden_size=int:16..6.5e1"], "must be integers"),
        (["train.lr=cube:1..2"], "unknown range kind 'cube'"),
        (["train.lr=1e-3,,2e-3"], "empty value"),
        (["train.lr=1e-3,1e-3"], "twice"),
        (["train.lr=1e-3", "train.lr=2e-3"], "given twice"),
    ],
)
def test_malformed_spaces_are_refused(items: list[str], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        parse_space(items)


@pytest.mark.parametrize(
    "items, sets, needle",
    [
        (["train.bogus=1,2"], [], "train.bogus: unknown field"),
        (["model.block_size=8,16"], [], "model.block_size: a field of the gpt family"),
        (["train.lr=1e-3,fast"], [], "--space train.lr=1e-3,fast: recipe smoke with --set: train.lr"),
        (["train.lr=1e-4..1e-2"], ["train.lr=1e-3"], "in both --set and --space"),
    ],
)
def test_spaces_that_do_not_fit_the_recipe_are_refused(items: list[str], sets: list[str], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        check_space("smoke", parse_space(items), Overrides.parse(sets))


# --- the training loop's hook --------------------------------------------------------------


def test_training_stops_where_its_eval_hook_says_with_its_checkpoint_written(tmp_path: Path) -> None:
    from textdata import write_char_ids

    from mllm.config import RunConfig
    from mllm.runtime.checkpoint import read_checkpoint
    from mllm.train import train

    write_char_ids(tmp_path, 600)
    cfg = RunConfig.model_validate(
        {
            "model": {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 1},
            "train": {
                "batch_size": 8,
                "window": 16,
                "max_steps": 40,
                "log_interval": 5,
                "eval_interval": 5,
                "eval_batches": 2,
                "checkpoint_interval": 100,
                "lr": 3e-3,
            },
            "paths": {
                "train_ids": str(tmp_path / "train.npy"),
                "val_ids": str(tmp_path / "val.npy"),
                "vocab": str(tmp_path / "vocab.json"),
                "checkpoint_dir": str(tmp_path / "ckpt"),
            },
        }
    )
    asked: list[tuple[int, float]] = []

    def hook(step: int, val_loss: float) -> bool:
        asked.append((step, val_loss))
        return step == 15

    result = train(cfg, on_eval=hook)
    assert [s for s, _ in asked] == [5, 10, 15]  # asked at each evaluation, until it said stop
    assert (result.stop_reason, result.steps) == ("pruned", 15)
    assert result.val_loss == pytest.approx(asked[-1][1])
    state = read_checkpoint(str(tmp_path / "ckpt" / "last.pt"), "cpu")
    assert int(state["step"]) == 15  # written at the step it stopped, though no interval fell there
    # Asked again, it trains on from there; a hook that never says stop lets it end as configured.
    again = train(cfg, on_eval=lambda step, val: False)
    assert (again.resumed_from_step, again.steps, again.stop_reason) == (15, 40, "max_steps")
    assert torch.isfinite(torch.tensor(again.val_loss))


# --- bad input at the command line ---------------------------------------------------------


def _make_study(path: Path, name: str, space: str, recipe: str) -> None:
    import optuna

    st = optuna.create_study(study_name=name, storage=f"sqlite:///{path}")
    st.set_user_attr("space", space)
    st.set_user_attr("recipe", recipe)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--space", "train.nonsense=1,2"], "train.nonsense: unknown field"),
        (["--space", "train.lr=1e-2..1e-4"], "the low end 1e-2 is not below the high end 1e-4"),
        (["--space", "train.lr=log:0..1e-2"], "a log: range needs both ends above 0"),
        (["--space", "train.lr=1e-4..1e-2", "--trials", "0"], "--trials 0: give at least 1"),
        (["--space", "train.lr=1e-4..1e-2", "--study", "mine"], "study mine in"),
        (["--space", "train.lr=1e-4..1e-2", "--model", "a/b"], "--model 'a/b' is not a model name"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(
    args: list[str], needle: str, corpus: Path, tmp_path: Path, empty_mlflow_store: bytes
) -> None:
    root = tmp_path / "storage"
    if "mine" in args:  # a study of that name searching another space
        _make_study(tmp_path / "optuna.db", "mine", "model.n_layer=1,2", "smoke")
    before = (tmp_path / "optuna.db").exists() and (tmp_path / "optuna.db").read_bytes()
    out = cli("search", "--recipe", "smoke", "--source", str(corpus), "--storage", str(root), *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and needle in errors[0], out.stderr
    assert not root.exists()
    assert (tmp_path / "mlflow-store" / "mlflow.db").read_bytes() == empty_mlflow_store  # no MLflow run either
    after = (tmp_path / "optuna.db").exists() and (tmp_path / "optuna.db").read_bytes()
    assert after == before  # no study made, none changed


# --- real searches -------------------------------------------------------------------------


def _runs(client, parent_id: str) -> dict[str, object]:
    experiment = client.get_run(parent_id).info.experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return {r.data.tags["search.trial"]: r for r in children}


@pytest.mark.integration
def test_search_prunes_losing_trials_at_an_evaluation_and_its_best_recipe_trains(corpus: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from flows.search.flow import search

    root = tmp_path / "storage"
    # A fixed study name: the sampler's seed follows it, so the learning rates drawn are the same each time.
    result = search(
        recipe="smoke",
        space=["train.lr=log:1e-5..3e-2"],
        trials_n=5,
        sampler="random",
        pruner="median",
        study="prune-test",
        source=str(corpus),
        storage_url=str(root),
        overrides=FAST,
        startup_trials=1,
        model="prune-test-model",
    )
    states = [o.state for o in result.outcomes]
    assert len(states) == 5 and states[0] == "complete", states
    assert "pruned" in states and states.count("complete") >= 2, states
    assert result.study_file == str(tmp_path / "optuna.db")

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    parent = client.get_run(result.mlflow_run_id)
    assert parent.info.run_name == "search-prune-test" and parent.info.status == "FINISHED"
    assert parent.data.params["space.train.lr"] == "log:1e-05..0.03"
    assert (parent.data.params["sampler"], parent.data.params["pruner"]) == ("random", "median")
    assert parent.data.tags["search.best_trial"] == str(result.best.number)
    runs = _runs(client, result.mlflow_run_id)
    assert len(runs) == 5
    for o in result.outcomes:
        run = runs[str(o.number)]
        assert run.info.run_id == o.mlflow_run_id and run.info.status == "FINISHED"
        assert run.data.tags["trial_state"] == o.state
        assert float(run.data.params["train.lr"]) == pytest.approx(float(o.params["train.lr"]))
        val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
        if o.state == "pruned":
            # Stopped at an evaluation before the last step, where its last val loss was reported.
            assert o.step in (10, 20, 30) and run.data.tags["trial.step"] == str(o.step)
            assert val_steps == list(range(10, o.step + 1, 10))
            assert "final_val_bits_per_byte" not in run.data.metrics
        else:
            assert o.step == 40 and val_steps == [10, 20, 30, 40]
            assert run.data.metrics["final_val_bits_per_byte"] == pytest.approx(o.value)
    done = [o for o in result.outcomes if o.state == "complete"]
    assert result.best.value == min(o.value for o in done)
    # Each complete trial registered under the model named, none under the recipe's.
    versions = client.search_model_versions("name = 'prune-test-model'")
    assert sorted(v.run_id for v in versions) == sorted(o.mlflow_run_id for o in done)

    folder = root / "searches" / "prune-test"
    assert {p.name for p in folder.iterdir()} >= {
        "search.md",
        "search.csv",
        "search.json",
        "history.png",
        "params.png",
        "best.yaml",
    }
    assert sorted(a.path for a in client.list_artifacts(result.mlflow_run_id)) == sorted(
        ["best.yaml", "history.png", "params.png", "search.csv", "search.json", "search.md"]
    )

    # The same call again continues the study: nothing more to run, the same trials.
    again = search(
        recipe="smoke",
        space=["train.lr=log:1e-5..3e-2"],
        trials_n=5,
        sampler="random",
        pruner="median",
        study="prune-test",
        source=str(corpus),
        storage_url=str(root),
        overrides=FAST,
        startup_trials=1,
    )
    assert [(o.number, o.state, o.params) for o in again.outcomes] == [
        (o.number, o.state, o.params) for o in result.outcomes
    ]
    assert again.mlflow_run_id == result.mlflow_run_id

    # The best trial's recipe trains, with the best trial's config, through `run --recipe FILE`.
    out = cli("run", "--recipe", result.best_recipe, "--storage", str(tmp_path / "elsewhere"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "after 40 steps" in out.stdout
    mine = client.get_run(out.stdout.split("mlflow run: ")[1].split()[0])
    assert float(mine.data.params["train.lr"]) == pytest.approx(float(result.best.params["train.lr"]))
    assert mine.data.params["train.max_steps"] == "40"


@pytest.mark.integration
def test_a_trial_whose_tracking_server_was_away_runs_once_more_as_a_sweeps_point(tmp_path: Path, monkeypatch) -> None:
    # As a sweep's point (docs/sweeps.md): the retry finds the training in storage and records it;
    # the failed attempt's run goes to the trash, its curve kept in the run that stands for the trial.
    from mlflow.entities import Metric
    from mlflow.entities.lifecycle_stage import LifecycleStage
    from mlflow.tracking import MlflowClient

    from flows.search.trial import TRIAL_TAG, once_more_if_passing
    from flows.sweep.parent import PARENT_TAG
    from tasks.tracking.outage import TrackingAway

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLLM_SWEEP_RETRY_DELAY_S", "0")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # a local store: no server to wait for
    client = MlflowClient()
    experiment = client.create_experiment("searched")
    tags = {PARENT_TAG: client.create_run(experiment).info.run_id, TRIAL_TAG: "3"}
    runs: list[str] = []

    def attempt() -> dict[str, str]:
        runs.append(client.create_run(experiment, tags=tags).info.run_id)
        client.log_batch(runs[-1], metrics=[Metric("train_loss", 2.0, 0, 10 * len(runs))])
        if len(runs) == 1:
            client.set_terminated(runs[0], "FAILED")
            raise TrackingAway("the MLflow tracking server http://127.0.0.1:1 stopped answering during the run")
        return {"mlflow_run_id": runs[-1], "state": "complete"}

    root = str(tmp_path / "storage")
    assert once_more_if_passing(attempt, root, tags) == {"mlflow_run_id": runs[1], "state": "complete"}
    assert len(runs) == 2
    assert sorted(m.step for m in client.get_metric_history(runs[1], "train_loss")) == [10, 20]
    first = client.get_run(runs[0])
    assert first.info.lifecycle_stage == LifecycleStage.DELETED
    assert first.data.tags["search.superseded_by"] == runs[1]

    # The trial's own error is not a server's: it fails at once.
    def mistaken() -> dict[str, str]:
        runs.append("")
        raise UserError("model.n_layer must be at least 1")

    with pytest.raises(UserError, match="n_layer"):
        once_more_if_passing(mistaken, root, tags)
    assert len(runs) == 3


def _trial_states(db: Path) -> list[str]:
    with sqlite3.connect(db) as c:
        return [s for (s,) in c.execute("select state from trials order by number")]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
@pytest.mark.integration
def test_a_trial_killed_mid_training_is_resumed_from_its_checkpoint_by_the_next_search(
    how: int, corpus: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from mllm.runtime.checkpoint import read_checkpoint

    root = tmp_path / "storage"
    steps = 300
    args = [
        "search",
        "--recipe",
        "smoke",
        "--source",
        str(corpus),
        "--storage",
        str(root),
        "--space",
        "train.lr=1e-3..3e-3",
        "--trials",
        "2",
        "--sampler",
        "random",
        "--pruner",
        "none",
        *_sets(
            [
                f"train.max_steps={steps}",
                "train.eval_interval=100",
                "train.checkpoint_interval=20",
                "train.log_interval=20",
                "sample.max_new_tokens=10",
                "sample.methods=[greedy]",
            ]
        ),
    ]
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(root.glob("runs/*/checkpoints/last.pt")):
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read()[-3000:] if proc.stderr else ""
            )
            time.sleep(0.05)
        if how == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGKILL)  # the search and all it started in its group, at once
        else:
            os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: the command's own way out
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (ckpt,) = root.glob("runs/*/checkpoints/last.pt")
    at_kill = int(read_checkpoint(str(ckpt), "cpu")["step"])
    assert 0 < at_kill < steps
    assert _trial_states(tmp_path / "optuna.db") == ["RUNNING"]  # nobody told the study

    out = cli(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from their checkpoints: trials 0" in out.stdout
    states = _trial_states(tmp_path / "optuna.db")
    assert states == ["FAIL", "COMPLETE", "COMPLETE"], states  # the dead one, its resumption, the second

    import optuna

    st = optuna.load_study(
        study_name=out.stdout.split("study: ")[1].split()[0], storage=f"sqlite:///{tmp_path / 'optuna.db'}"
    )
    dead, resumed, second = st.trials
    assert resumed.params == dead.params and resumed.user_attrs["resumes"] == 0
    # The same params, the same training folder: on from the step its checkpoint held, to the end.
    assert resumed.user_attrs["resumed_from_step"] == at_kill and resumed.user_attrs["step"] == steps
    assert second.user_attrs["resumed_from_step"] == 0
    assert len(list(root.glob("runs/*/checkpoints"))) == 2  # no third training folder

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    old, new = client.get_run(_dead_run(client, st.study_name)), client.get_run(resumed.user_attrs["mlflow_run_id"])
    assert old.info.status == "KILLED" and old.data.tags["trial_state"] == "failed"
    assert old.data.tags["search.resumed_by"] == str(resumed.number)
    assert new.info.status == "FINISHED" and new.data.tags["trial_state"] == "complete"
    assert new.data.tags["search.resumes"] == "0"
    # The resumed run logs from the checkpoint on: no step before it again, none missing between the runs.
    old_steps = [m.step for m in client.get_metric_history(old.info.run_id, "train_loss")]
    new_steps = [m.step for m in client.get_metric_history(new.info.run_id, "train_loss")]
    # (Ctrl-C writes last.pt at the step it came, SIGKILL leaves the last one of the interval.)
    assert min(new_steps) == (at_kill // 20 + 1) * 20 and max(new_steps) == steps
    assert sorted(set(old_steps) | set(new_steps)) == list(range(20, steps + 1, 20))  # no step lost

    # No flow run of either search is left in flight on the Prefect server (`stack down` would
    # refuse): the rerun marked the killed search's Crashed (its own, the trial's, the training's).
    runs = _flow_runs_since(started)
    assert [(r.name, r.state.type.value) for r in runs if not r.state.is_final()] == []
    dead = [r for r in runs if r.name == f"{st.study_name}-trial-0"]
    if how == signal.SIGKILL:
        assert len(dead) == 1 and dead[0].state.is_crashed(), dead
        assert "took over trial 0" in dead[0].state.message
        crashed = sorted(r.name for r in runs if r.state.is_crashed())
        assert [n for n in crashed if n.startswith("search-smoke-")] and [n for n in crashed if n.endswith("-train")], (
            crashed
        )


def _flow_runs_since(started: float) -> list:
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                start_time=FlowRunFilterStartTime(after_=datetime.fromtimestamp(started, timezone.utc))
            )
        )


def _dead_run(client, study: str) -> str:
    (run,) = client.search_runs(
        [client.get_experiment_by_name("smoke").experiment_id],
        f"tags.`search.study` = '{study}' and tags.`search.trial` = '0'",
    )
    return run.info.run_id


def test_pruners_step_in_evaluations_of_the_recipe() -> None:
    import optuna

    from flows.search.study import make_pruner
    from mllm.resolve import resolve

    cfg = resolve("smoke", overrides=["train.eval_interval=10", "train.max_steps=40"])
    kinds = {name: type(make_pruner(name, cfg, 3)) for name in ("median", "halving", "hyperband", "none")}
    assert kinds == {
        "median": optuna.pruners.MedianPruner,
        "halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "none": optuna.pruners.NopPruner,
    }
    # Hyperband's brackets run from one evaluation to the whole training, in steps.
    hyperband = make_pruner("hyperband", cfg, 3)
    assert (hyperband._min_resource, hyperband._max_resource) == (10, 40)


def test_a_recipe_file_is_its_recipe_plus_the_fields_where_it_differs(tmp_path: Path) -> None:
    from mllm.resolve import recipe_file_overrides as as_overrides
    from mllm.resolve import resolve

    cfg = resolve(
        "smoke",
        overrides=["train.lr=0.0123", "model.hidden_size=48", "sample.methods=[greedy]"],
        source=str(tmp_path / "corpus.txt"),
    )
    path = tmp_path / "best.yaml"
    path.write_text("# a comment\n" + cfg.to_yaml(paths=False))
    name, sets = as_overrides(str(path), Overrides.parse(["train.max_steps=7"]))
    assert name == "smoke" and sets.items()[-1] == "train.max_steps=7"
    assert resolve(name, overrides=sets) == cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"max_steps": 7})}
    )
    assert as_overrides("smoke", Overrides.parse(["a=1"])) == ("smoke", Overrides.parse(["a=1"]))  # a name stays a name
    path.write_text("recipe: mine\ntrain: {lr: 0.1}\n")
    with pytest.raises(UserError, match="names recipe 'mine', not a shipped one"):
        as_overrides(str(path), Overrides())


@pytest.mark.integration
def test_a_trial_on_a_pool_asks_the_pruner_through_storage_and_trains_on_when_no_verdict_comes(tmp_path: Path) -> None:
    # The worker's side and the search's side of tasks/trials.py, over a storage folder as over S3,
    # with Optuna's median pruner answering (its verdicts are numpy's bools).
    import optuna

    from tasks import trials

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0))
    done = study.ask()
    done.report(2.0, 10)
    done.report(1.9, 20)
    study.tell(done, 1.8)
    trial = study.ask()
    run_dir = str(tmp_path / "run")
    asked = []

    def pruner(step: int, val_loss: float) -> bool:
        asked.append((step, val_loss))
        trial.report(val_loss, step)
        return trial.should_prune()

    worker = trials.through_storage(run_dir, wait_s=30)
    with trials.answering(run_dir, pruner, every_s=0.05):
        assert worker(10, 1.95) is False
        assert worker(20, 2.4) is True
    assert asked == [(10, 1.95), (20, 2.4)]
    # No search answers (it died): the training goes on after the wait.
    started = time.monotonic()
    assert trials.through_storage(run_dir, wait_s=1)(30, 2.3) is False
    assert time.monotonic() - started >= 1
    # A later trial of the same config (the same folder) never reads the verdicts of this one.
    with trials.answering(run_dir, lambda step, val_loss: False, every_s=0.05):
        assert not (tmp_path / "run" / "search" / "verdict-20.json").exists()
        assert worker(20, 2.4) is False


@pytest.mark.integration
def test_a_trial_whose_heartbeat_stopped_is_asked_again_with_its_values_and_the_study_stops_at_its_trials(
    tmp_path: Path,
) -> None:
    # The PostgreSQL path's bookkeeping (flows/search/flow.py claim and on_stale) on Optuna's heartbeats,
    # here over SQLite: the second trial's search "dies" (no more beats), the next ask fails it and
    # takes it again with its values, and the study then has its two trials.
    import warnings

    import optuna

    from flows.search.flow import claim, on_stale, outcomes_of
    from flows.search.study import resumed_number

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rdb = optuna.storages.RDBStorage(
            f"sqlite:///{tmp_path / 'study.db'}",
            heartbeat_interval=1,
            grace_period=1,
            heartbeat_stale_trial_callback=on_stale(str(tmp_path), {}),
        )
    study = optuna.create_study(storage=rdb, study_name="beats")
    first = claim(study, 2)
    rdb.record_heartbeat(first._trial_id)
    first.suggest_float("x", 0, 1)
    study.tell(first, 1.0)
    second = claim(study, 2)
    rdb.record_heartbeat(second._trial_id)
    x = second.suggest_float("x", 0, 1)
    time.sleep(2.5)  # its search is gone: no beat within the grace period
    again = claim(study, 2)
    assert again.number == 2 and resumed_number(study.trials[2]) == second.number
    assert again.suggest_float("x", 0, 1) == x
    assert study.trials[second.number].state == optuna.trial.TrialState.FAIL
    rdb.record_heartbeat(again._trial_id)
    study.tell(again, 0.5)
    assert claim(study, 2) is None
    states = {o.number: (o.state, o.resumed_by) for o in outcomes_of(study)}
    assert states == {0: ("complete", None), 1: ("failed", 2), 2: ("complete", None)}
