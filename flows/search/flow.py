"""`mllm-pipeline search`: Optuna samples a space of config fields, and each trial is a tracked,
cached pipeline run whose training a pruner may stop at an evaluation (docs/search.md)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import warnings
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

import tasks
from flows import dispatch
from flows.launch import (
    check_model_name,
    preflight,
    storage_root,
    training_pool,
)
from flows.search.dead import PROCESS_ATTR, crash_flow_runs, this_process
from flows.search.record import SearchResult, TrialsFailed, record
from flows.search.report import TrialOutcome
from flows.search.space import NO_SPACE, Dim, Space, check_space, space_text, study_name
from flows.search.study import (
    Heartbeats,
    check_options,
    check_study,
    one_at_a_time,
    open_storage,
    open_study,
    optuna_module,
    resumed_number,
    study_lock,
    study_store,
)
from flows.search.trial import STUDY_TAG, TrialPlan, mark_failed, run_one
from flows.stack import database, orphans
from flows.sweep.parent import ParentRun
from flows.training import train
from mllm import UserError
from mllm.config import RunConfig
from mllm.families.base import family_of
from mllm.redact import scrub
from mllm.resolve import NO_OVERRIDES, Overrides
from tasks.caching import forget_exception
from tasks.tracking.provenance import code_git_info, run_tags
from tasks.tracking.tracker import (
    MAX_PARAM_VALUE,
    MAX_TAG_VALUE,
    RunTracker,
)

# --- the study -----------------------------------------------------------------------------


class StudyRun(ParentRun):
    """The study's MLflow run, one for the study however many times the search is run: a rerun
    finds it by its tag and opens it again."""

    def __init__(
        self,
        cfg: RunConfig,
        root: str,
        study: str,
        space: dict[str, Dim],
        overrides: Overrides,
        options: dict[str, str],
    ):
        super().__init__(cfg, root, {}, overrides)
        self.study, self.space, self.options = study, space, options

    def __enter__(self) -> StudyRun:
        self.experiment_id = RunTracker(self.cfg, self.root)._experiment(self.cfg.recipe)
        found = self.client.search_runs(
            [self.experiment_id],
            f"tags.`{STUDY_TAG}` = '{self.study}' and tags.`search.parent` = 'true'",
            max_results=1,
        )
        if found:
            run = found[0]
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            tags = scrub(
                {
                    **run_tags(self.cfg, self.root, code_git_info()),
                    STUDY_TAG: self.study,
                    "search.parent": "true",
                    "search.space": space_text(self.space),
                }
            )
            run = self.client.create_run(
                self.experiment_id,
                run_name=f"search-{self.study}",
                tags={k: v[:MAX_TAG_VALUE] for k, v in tags.items()},
            )
            params = {f"space.{f}": d.spec for f, d in self.space.items()} | self.options
            if self.overrides:
                params["overrides"] = " ".join(self.overrides.items())
            for name, value in scrub(params).items():
                self.client.log_param(run.info.run_id, name, value[:MAX_PARAM_VALUE])
        self.run_id, self.artifact_uri = run.info.run_id, run.info.artifact_uri
        return self


def revive(study: Any, root: str, parent_id: str) -> list[int]:
    """Trials left RUNNING by a dead search (this process holds the study's lock): each failed and
    asked again with its parameters, so that its training resumes from its checkpoint."""
    optuna = optuna_module()
    revived = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        crash_flow_runs(t, known_dead=True)  # its search is dead: this one holds the lock
        study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(t.params, user_attrs={"resumes": t.number})
        revived.append(t.number)
    for number in revived:
        mark_failed(root, parent_id, study.study_name, number, _resumed_by(study, number))
    return revived


def _resumed_by(study: Any, number: int) -> int | None:
    waiting = study.get_trials(deepcopy=False, states=(optuna_module().trial.TrialState.WAITING,))
    return next((t.number for t in waiting if resumed_number(t) == number), None)


def on_stale(root: str, parent: dict[str, str]) -> Any:
    """On PostgreSQL, for a trial whose heartbeat stopped (its search died, here or on another
    machine): Optuna's callback queues it again with its parameters; its MLflow run is marked."""
    optuna = optuna_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental in Optuna 5
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback()

    def failed(study: Any, frozen: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            retry(study, frozen)
        if parent.get("id"):
            mark_failed(root, parent["id"], study.study_name, frozen.number, _resumed_by(study, frozen.number))
        crash_flow_runs(frozen, known_dead=False)  # where its process is known gone

    return failed


def claim(st: Any, trials_n: int) -> Any | None:
    """The next trial to run, or None once the study has its trials (finished, running or queued,
    by any search). Trials whose heartbeat stopped are failed and queued again first."""
    with warnings.catch_warnings():
        # Optuna calls its heartbeats experimental and meant for study.optimize: this search beats them itself.
        warnings.simplefilter("ignore")
        optuna_module().storages.fail_stale_trials(st)
        outcomes = outcomes_of(st)
        queued = any(o.state == "waiting" for o in outcomes)
        counted = sum(
            o.state in ("complete", "pruned", "failed", "running", "waiting") and o.resumed_by is None for o in outcomes
        )
        return st.ask() if queued or counted < trials_n else None


def outcomes_of(study: Any) -> list[TrialOutcome]:
    """Every trial of the study, from what it holds (runs of earlier searches included)."""
    resumed_by = {resumed_number(t): t.number for t in study.trials if resumed_number(t) is not None}
    out = []
    for t in study.trials:
        state = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}.get(t.state.name, t.state.name.lower())
        a = t.user_attrs
        out.append(
            TrialOutcome(
                number=t.number,
                params={k: str(v) for k, v in t.params.items()},
                state=state,
                value=t.value if state == "complete" else None,
                step=a.get("step"),
                val_loss=a.get("val_loss"),
                mlflow_run_id=a.get("mlflow_run_id"),
                resumes=resumed_number(t),
                resumed_by=resumed_by.get(t.number),
                resumed_from_step=a.get("resumed_from_step"),
                error=a.get("error")
                or (f"its process died; resumed by trial {resumed_by[t.number]}" if t.number in resumed_by else None),
            )
        )
    return out


def finished_count(outcomes: list[TrialOutcome]) -> int:
    """Trials that count toward --trials: complete, pruned, or failed (a dead one resumed by
    another counts once, as the other)."""
    return sum(o.state in ("complete", "pruned", "failed") and o.resumed_by is None for o in outcomes)


class TrialsEnded:
    """The terminal's bar of trials (`tasks.report_progress("trials", ...)`)."""

    def __init__(self, total: int, done: int, higher: bool):
        self.total, self.ended, self.failed, self.higher, self.best = total, done, 0, higher, None
        self.lock = threading.Lock()
        tasks.report_progress("trials", done, total)

    def __call__(self, future: Any) -> None:
        try:
            o = future.wrapped_future.result().result()
        except BaseException:  # noqa: BLE001 (a trial that crashed its thread ended too)
            o = TrialOutcome(number=-1, params={}, state="failed")
        self.record(o)

    def record(self, o: TrialOutcome) -> None:
        with self.lock:
            self.ended += 1
            self.failed += o.state == "failed"
            if o.value is not None and (self.best is None or (o.value > self.best) == self.higher):
                self.best = o.value
            best = "" if self.best is None else f", best {self.best:.4f}"
            tasks.report_progress(
                "trials", self.ended, self.total, failed=self.failed, last=f"trial {o.number} {o.state}{best}"
            )


def _run_name() -> str:
    """Named after the recipe and the start, as the pipeline's flow runs are."""

    from prefect.runtime import flow_run

    return f"search-{flow_run.parameters.get('recipe')}-{time.strftime('%Y%m%d-%H%M%S')}"


@flow(
    name="search",
    flow_run_name=_run_name,
    persist_result=False,
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=32),
    on_failure=[forget_exception],
    on_crashed=[forget_exception],
)
def search(
    recipe: str = "default",
    space: Space = {},
    trials_n: int = 20,
    sampler: str = "tpe",
    pruner: str = "median",
    study: str | None = None,
    source: str | list[str] | None = None,
    storage_url: str | None = None,
    overrides: Overrides = NO_OVERRIDES,
    train_on: str | None = None,
    parallel: int | None = None,
    startup_trials: int = 5,
    model: str | None = None,
) -> SearchResult:
    """Search a space of config fields with Optuna; each trial is a pipeline run, stopped at an
    evaluation when the pruner says so. Running it again continues the study.

    Args:
        recipe: A shipped recipe (see `mllm-pipeline recipes`).
        space: Fields and their values, as section.field=SPEC: a list 2,4,6, or a range 1e-4..1e-2,
            log:1e-4..1e-2, int:64..512.
        trials_n: How many trials the study finishes (complete, pruned or failed), earlier runs' included.
        sampler: tpe or random.
        pruner: median, halving, hyperband or none.
        study: The study's name [from the recipe, the space, the fixed fields and the data].
        source: The corpus to train on when not the recipe's own.
        storage_url: The storage root [$MLLM_STORAGE or ./storage].
        overrides: Config fields fixed for every trial, as section.field=value.
        train_on: A work pool whose workers train the trials [this process, one at a time].
        parallel: At most this many trials at once on the pool [as many as its slots take].
        startup_trials: TPE's random trials before it models the results; the median pruner prunes
            nothing before this many trials finished.
        model: The registered model the trials' models join [the recipe's name].
    """
    if model:
        check_model_name(model)
    if not space:
        raise UserError(NO_SPACE)
    pool = training_pool(recipe, train_on)
    check_options(trials_n, sampler, pruner, parallel, startup_trials)
    base = check_space(recipe, space, overrides, source)
    name = study or study_name(recipe, space, overrides, base)
    root = storage_root(storage_url)
    store = study_store(root)
    check_study(store, name, space, recipe)
    preflight(root)
    if pool:
        dispatch.ensure_deployment(train, pool)
    options = {"sampler": sampler, "pruner": pruner, "trials": str(trials_n), "study": name, "study_file": store.shown}
    parent_id: dict[str, str] = {}
    rdb = open_storage(store, on_stale(root, parent_id))
    with study_lock(store, name), Heartbeats(rdb, store) as beats:
        with one_at_a_time(rdb, store, name):
            st = beats.study = open_study(rdb, store, name, recipe, space, base, options, startup_trials)
            parent = StudyRun(base, root, name, space, overrides, options).__enter__()
        parent_id["id"] = parent.run_id
        with contextlib.ExitStack() as stack:
            stack.push(parent.__exit__)
            sign = (
                -1.0 if family_of(base).higher_is_better else 1.0
            )  # the pruner reads val loss in the study's direction
            plan = TrialPlan(recipe, space, overrides, source, root, parent.run_id, pool, sign, model)
            result = run_study(st, beats, rdb, store, plan, trials_n, parallel, parent)
    rdb.engine.dispose()
    if result.failed:
        raise TrialsFailed(result)  # the flow run fails, after every trial ran and was recorded
    return result


def run_study(
    st: Any,
    beats: Heartbeats,
    rdb: Any,
    store: Any,
    plan: TrialPlan,
    trials_n: int,
    parallel: int | None,
    parent: StudyRun,
) -> SearchResult:
    """Trials until the study has `trials_n` (a dead search's resumed first), then the record."""
    fam = family_of(parent.cfg)
    revived = [] if store.shared else revive(st, plan.root, parent.run_id)
    done = finished_count(outcomes_of(st))
    ended = TrialsEnded(trials_n, done, fam.higher_is_better)
    futures: list[Any] = []
    me = this_process()
    while True:
        running = [f.wrapped_future for f in futures if not f.wrapped_future.done()]
        if parallel and len(running) >= parallel:
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        with one_at_a_time(rdb, store, st.study_name):
            trial = claim(st, trials_n)
            if trial is None:
                break
            beats.add(trial._trial_id)
            trial.set_user_attr(PROCESS_ATTR, me)  # for the search that takes over, should this one die
        one = run_one.with_options(task_run_name=f"trial {trial.number}")
        if plan.pool is None:
            # One at a time, each asking the sampler what the last taught; in this thread,
            # where a Ctrl-C reaches the training, which writes its checkpoint first.
            ended.record(one(st, trial, plan))
            beats.discard(trial._trial_id)
            continue
        future = one.submit(st, trial, plan)
        future.add_done_callback(ended)
        future.add_done_callback(lambda _, tid=trial._trial_id: beats.discard(tid))
        futures.append(future)
    for f in futures:
        f.wait()
    outcomes = outcomes_of(st)
    if down := next((o.error for o in outcomes if o.error and o.error.startswith(database.DOWN)), None):
        orphans.stop_reporting()  # its state cannot be written: no minutes of retries
        raise UserError(down)
    p = plan
    return record(parent, st, p.recipe, p.space, p.overrides, p.source, outcomes, fam, store.shown, revived)
