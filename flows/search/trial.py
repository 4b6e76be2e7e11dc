"""One trial of a search: a pipeline run of the sampled config whose training a pruner may stop at
an evaluation, run once more after a server's passing failure, and recorded in the study."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from flows.launch import (
    data_runner,
    with_results,
)
from flows.pipeline import evaluate, judge, prepare
from flows.search.report import TrialOutcome
from flows.search.space import Dim
from flows.search.study import optuna_module, resumed_number
from flows.stack import database
from flows.sweep.parent import PARENT_TAG, passing, retry_delay_s, supersede
from flows.training import run_training
from mllm import UserError
from mllm.config import RunConfig
from mllm.redact import scrub
from mllm.resolve import Overrides, resolve
from tasks import trials
from tasks.caching import forget_exception
from tasks.model import Prepared
from tasks.model import train as training_stage
from tasks.tracking import outage
from tasks.tracking import servers as tracking_servers
from tasks.tracking.champion import current_champion
from tasks.tracking.store import client as tracking_client
from tasks.tracking.tracker import (
    RunTracker,
    log_data,
)

STUDY_TAG, TRIAL_TAG, STATE_TAG = "search.study", "search.trial", "trial_state"
_preparing = threading.Lock()


@flow(name="search-trial", on_failure=[forget_exception], on_crashed=[forget_exception])
def trial_run(
    cfg: RunConfig,
    data: Prepared,
    root: str,
    study: str,
    number: int,
    tags: dict[str, str],
    pool: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """One trial: the pipeline's training, evaluation and judgement in a run nested under the
    study's; a pruned training ends the trial without an evaluation."""
    key = training_stage.train_key(cfg, data)
    with RunTracker(cfg, root, tags=tags, run_name=f"{study}-trial-{number}") as run:
        log_data(run.run_id, quote(cfg), root, quote(data))
        run.set_tags(training_stage.lineage_tags(cfg, data))
        trained = run_training(cfg, data, root, run.run_id, pool, search=pool is not None)
        found = {
            "mlflow_run_id": run.run_id,
            "step": trained.steps,
            "val_loss": trained.val_loss,
            "resumed_from_step": trained.resumed_from_step,
            "key": key,
        }
        if trained.stop_reason == "pruned":
            with contextlib.suppress(Exception):  # a picture is no reason to fail the trial
                run.log_loss_curve()
            run.set_tags({STATE_TAG: "pruned", "trial.step": str(trained.steps)})
            return {**found, "state": "pruned"}
        evaluation, samples = with_results(evaluate, root)(cfg, trained, data)
        outage.check_back(trained.run_dir)
        judge(
            run.run_id,
            cfg,
            root,
            trained,
            evaluation,
            samples,
            data,
            current_champion(tracking_client(root), model or cfg.recipe),
            None,
            model,
        )
        run.set_tags({STATE_TAG: "complete", "trial.step": str(trained.steps)})
        return {**found, "state": "complete", "value": evaluation.score, "headline": evaluation.headline}


@dataclass(frozen=True)
class TrialPlan:
    """What every trial of a search shares: the recipe and its fixed overrides, the space drawn from,
    where its runs go and train, and the sign that turns a val loss into the study's direction."""

    recipe: str
    space: dict[str, Dim]
    overrides: Overrides
    source: str | list[str] | None
    root: str
    parent_id: str
    pool: str | None
    sign: float
    model: str | None = None


@task(name="search-trial", cache_policy=NO_CACHE, persist_result=False, on_failure=[forget_exception])
def run_one(study: Any, trial: Any, plan: TrialPlan) -> TrialOutcome:
    """Ask the trial's values, run it, and tell the study how it ended (a failure too)."""
    params = {field: dim.suggest(trial) for field, dim in plan.space.items()}
    resumes = resumed_number(study.trials[trial.number])
    outcome = TrialOutcome(number=trial.number, params=params, state="failed", resumes=resumes)
    tags = {
        PARENT_TAG: plan.parent_id,
        STUDY_TAG: study.study_name,
        TRIAL_TAG: str(trial.number),
        **({"train.pool": plan.pool} if plan.pool else {}),
    }
    if resumes is not None:
        tags["search.resumes"] = str(resumes)
        # What the dead trial reported, so the pruner sees the whole curve of the resumed one.
        for step, value in study.trials[resumes].intermediate_values.items():
            trial.report(value, step)
    try:
        found = _run_trial(study, trial, plan, params, tags)
    except Exception as e:  # noqa: BLE001 (a failed trial is told to the study and reported, not raised)
        message = scrub(str(e).splitlines()[0]) if str(e) else ""
        if not isinstance(e, UserError):
            message = database.down_line(e) or f"{type(e).__name__}: {message}"
        outcome.error = message[:500]
        trial.set_user_attr("error", outcome.error)
        mark_failed(plan.root, plan.parent_id, study.study_name, trial.number)
        study.tell(trial, state=optuna_module().trial.TrialState.FAIL)
        return outcome
    return _told(study, trial, outcome, found)


def _run_trial(study: Any, trial: Any, plan: TrialPlan, params: dict[str, str], tags: dict[str, str]) -> dict[str, Any]:
    """The trial's config prepared and run (`trial_run`), its training asking the pruner at each
    evaluation: what it found."""
    cfg = resolve(plan.recipe, overrides=plan.overrides.with_values(params), source=plan.source)
    with _preparing:  # trials on a pool start side by side: no two write one data stage at once
        data = with_results(prepare, plan.root, data_runner(cfg.data.task_runner))(cfg, plan.root)

    def ask_pruner(step: int, val_loss: float) -> bool:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a step reported before the process died: Optuna keeps the first
            trial.report(plan.sign * val_loss, step)
        return trial.should_prune()

    # Here: the training in this process asks the pruner; on a pool: its worker asks through storage.
    asking = (
        trials.asking(training_stage.train_key(cfg, data), ask_pruner)
        if plan.pool is None
        else trials.answering(training_stage.train_job(cfg, data, plan.root)[1], ask_pruner)
    )
    name = study.study_name
    with asking:
        return once_more_if_passing(
            lambda: trial_run.with_options(flow_run_name=f"{name}-trial-{trial.number}")(
                cfg=cfg,
                data=data,
                root=plan.root,
                study=name,
                number=trial.number,
                tags=tags,
                pool=plan.pool,
                model=plan.model,
            ),
            plan.root,
            tags,
        )


def _told(study: Any, trial: Any, outcome: TrialOutcome, found: dict[str, Any]) -> TrialOutcome:
    """The study told how a trial that ran ended (pruned, or its value), and its outcome."""
    for name in ("mlflow_run_id", "step", "val_loss", "resumed_from_step"):
        trial.set_user_attr(name, found[name])
    outcome = outcome.model_copy(
        update={k: found[k] for k in ("mlflow_run_id", "step", "val_loss", "resumed_from_step")}
        | {"state": found["state"]}
    )
    if found["state"] == "pruned":
        study.tell(trial, state=optuna_module().trial.TrialState.PRUNED)
    else:
        study.tell(trial, found["value"])
        outcome.value = found["value"]
    return outcome


def once_more_if_passing(attempt: Callable[[], dict[str, Any]], root: str, tags: dict[str, str]) -> dict[str, Any]:
    """A trial's run, run once more when it failed of a server's passing failure (a tracking
    server still away when its training ended, a refused connection, a 503 that outlasted the
    clients' retries), as a sweep runs its point again (docs/sweeps.md): after
    MLLM_SWEEP_RETRY_DELAY_S seconds, once both servers answer (at most 4 minutes). Its training is
    found in storage; the failed attempt's MLflow run is tagged `search.superseded_by`, its curve
    copied into the new run, and it goes to MLflow's trash."""
    try:
        return attempt()
    except Exception as e:
        if not passing(e):
            raise
        with contextlib.suppress(Exception):  # outside a flow run (a test): nothing to log to
            from prefect import get_run_logger

            get_run_logger().warning(
                "%s: the trial runs once more once the servers answer", scrub(str(e).splitlines()[0])
            )
    time.sleep(retry_delay_s())
    tracking_servers.wait_for_servers()  # bounded: a server still away fails the trial, as it would
    found = attempt()
    supersede(root, tags, found["mlflow_run_id"], same=TRIAL_TAG, mark="search.superseded_by")
    return found


def mark_failed(root: str, parent_id: str, study: str, number: int, resumed_by: int | None = None) -> None:
    """The trial's MLflow run (where it got that far), tagged failed; a run left RUNNING by a dead
    process is ended KILLED."""
    with contextlib.suppress(Exception):  # the trial's own error is the one to report
        client = tracking_client(root)
        experiment = client.get_run(parent_id).info.experiment_id
        query = f"tags.`{STUDY_TAG}` = '{study}' and tags.`{TRIAL_TAG}` = '{number}'"
        for run in client.search_runs([experiment], query):
            client.set_tag(run.info.run_id, STATE_TAG, "failed")
            if resumed_by is not None:
                client.set_tag(run.info.run_id, "search.resumed_by", str(resumed_by))
            if run.info.status == "RUNNING":
                client.set_terminated(run.info.run_id, "KILLED")
