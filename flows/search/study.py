"""A search's study: where Optuna keeps it (SQLite or PostgreSQL), the lock or heartbeat that tells a dead
trial, its sampler and pruner, and the checks of a search's options made before anything starts."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flows.search.space import Dim, space_text
from flows.settings import settings
from flows.stack import database
from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.families.base import family_of
from tasks.tracking.store import local_store

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "hyperband", "none")


def grace_s() -> float:
    """How long a trial's search may go silent before its trial counts as dead: 90 s (a busy CPU
    stalls threads), or MLLM_SEARCH_GRACE_S."""
    return settings().search_grace_s


def heartbeat_s() -> float:
    """How often a search beats for its trials: every 10 s, more often under a grace below 30 s."""
    return min(10.0, grace_s() / 3)


def study_file(root: str) -> str:
    """optuna.db beside the storage root (in the current folder for an object-store root)."""
    return os.path.join(os.path.dirname(local_store(root)), "optuna.db")


@dataclass
class StudyStore:
    """Where the study lives: `url` carries the database's password, for Optuna's storage only;
    `shown` names it without (for the terminal, MLflow and Prefect)."""

    url: str = field(repr=False)
    shown: str
    shared: bool  # PostgreSQL: several searches at once

    @property
    def exists(self) -> bool:
        return self.shared or os.path.exists(self.url.removeprefix("sqlite:///"))


def study_store(root: str) -> StudyStore:
    found = database.study_database()
    if found:
        return StudyStore(found[0], found[1], shared=True)
    path = study_file(root)
    return StudyStore(f"sqlite:///{path}", path, shared=False)


def optuna_module() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the terminal shows the bar and the table
    return optuna


def open_storage(store: StudyStore, on_stale: Callable[[Any, Any], None] | None = None) -> Any:
    optuna = optuna_module()
    if not store.shared:
        return optuna.storages.RDBStorage(store.url, engine_kwargs={"connect_args": {"timeout": 60}})
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    # Optuna creates its tables and enum types when it opens a new database; two searches
    # opening it at once race there (PostgreSQL refuses the second CREATE TYPE). One at a time.
    lock = create_engine(store.url, poolclass=NullPool)
    try:
        with lock.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(hashtext('mllm-search:schema'))"))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # heartbeats are "experimental" in Optuna 5
                    return optuna.storages.RDBStorage(
                        store.url,
                        engine_kwargs={"pool_pre_ping": True},
                        heartbeat_interval=max(1, round(heartbeat_s())),
                        grace_period=max(1, round(grace_s())),
                        heartbeat_stale_trial_callback=on_stale,
                    )
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(hashtext('mllm-search:schema'))"))
                conn.commit()
    finally:
        lock.dispose()


def check_study(store: StudyStore, name: str, space: dict[str, Dim], recipe: str) -> None:
    """A study of this name in the store with another space or recipe: one line, nothing opened
    for writing (the store is only read, and only when it exists)."""
    if not store.exists:
        return
    st = open_storage(store)
    try:
        attrs = st.get_study_user_attrs(st.get_study_id_from_name(name))
    except KeyError:
        return
    finally:
        st.engine.dispose()
    if (attrs.get("space"), attrs.get("recipe")) != (space_text(space), recipe):
        raise UserError(
            f"study {name} in {store.shown} searches recipe {attrs.get('recipe')} over "
            f"{attrs.get('space')!r}, not {recipe} over {space_text(space)!r}: give another --study "
            "name, or leave --study out (the name then follows the recipe and the space)"
        )


@contextlib.contextmanager
def study_lock(store: StudyStore, name: str):
    """The study held by this process: a RUNNING trial another search finds belongs to a dead one.
    (No lock on PostgreSQL: there heartbeats tell the dead.)"""
    if store.shared:
        yield
        return
    folder = os.path.join(os.path.dirname(store.shown), "optuna.locks", name)
    with storage.exclusive(folder, lambda: print(f"another search of study {name} is running: waiting for it")):
        yield


@contextlib.contextmanager
def one_at_a_time(rdb: Any, store: StudyStore, name: str) -> Iterator[None]:
    """On PostgreSQL, the study's advisory lock while inside (searches count and ask in turn)."""
    if not store.shared:
        yield
        return
    from sqlalchemy import text

    with rdb.engine.connect() as conn:
        conn.execute(text("SELECT pg_advisory_lock(hashtext(:n))"), {"n": f"mllm-search:{name}"})
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(hashtext(:n))"), {"n": f"mllm-search:{name}"})
            conn.commit()


class Heartbeats:
    """This search's trials beating in the study (PostgreSQL only), from one thread."""

    def __init__(self, rdb: Any, store: StudyStore):
        self.rdb, self.ids, self.lock, self.stop = rdb, set(), threading.Lock(), threading.Event()
        self.study: Any = None  # set once the study is open: a search stopped by an error queues its trials again
        self.thread = (
            threading.Thread(target=self._beat, daemon=True, name="search-heartbeats") if store.shared else None
        )

    def __enter__(self) -> Heartbeats:
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop.set()
        if not self.thread:
            return
        self.thread.join(timeout=30)
        if exc_type is not None and self.study is not None:
            # Ctrl-C or a crash of this search: its trials are queued again now, not after the grace.
            callback = self.rdb.get_heartbeat_stale_trial_callback()
            for trial_id in list(self.ids):
                with contextlib.suppress(Exception):
                    if (
                        self.rdb.set_trial_state_values(trial_id, state=optuna_module().trial.TrialState.FAIL)
                        and callback
                    ):
                        callback(self.study, self.rdb.get_trial(trial_id))

    def add(self, trial_id: int) -> None:
        if self.thread:
            self.rdb.record_heartbeat(trial_id)
            with self.lock:
                self.ids.add(trial_id)

    def discard(self, trial_id: int) -> None:
        with self.lock:
            self.ids.discard(trial_id)

    def _beat(self) -> None:
        while not self.stop.wait(heartbeat_s()):
            with self.lock:
                ids = list(self.ids)
            for trial_id in ids:
                with contextlib.suppress(Exception):  # a dropped connection: the next beat reconnects
                    self.rdb.record_heartbeat(trial_id)


def resumed_number(t: Any) -> int | None:
    """The dead trial whose checkpoint this one resumes: re-queued by Optuna's heartbeat callback
    (the last of its retry history) or by `revive` (its `resumes`)."""
    history = t.system_attrs.get("retry_history")
    return history[-1] if history else t.user_attrs.get("resumes")


def make_sampler(name: str, seed: int, startup: int) -> Any:
    """TPE draws its first `startup` trials at random, then models them (Optuna's default of 10
    would leave a 12-trial study almost all random)."""
    samplers = optuna_module().samplers
    if name == "random":
        return samplers.RandomSampler(seed=seed)
    return samplers.TPESampler(seed=seed, n_startup_trials=startup)


def make_pruner(name: str, cfg: RunConfig, startup: int) -> Any:
    pruners = optuna_module().pruners
    if name == "median":
        return pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0)
    if name == "halving":
        return pruners.SuccessiveHalvingPruner(min_resource=cfg.train.eval_interval)
    if name == "hyperband":
        return pruners.HyperbandPruner(min_resource=cfg.train.eval_interval, max_resource=cfg.train.max_steps or "auto")
    return pruners.NopPruner()


def check_options(trials_n: int, sampler: str, pruner: str, parallel: int | None, startup: int) -> None:
    if trials_n < 1:
        raise UserError(f"--trials {trials_n}: give at least 1 (the trials the study should finish)")
    if sampler not in SAMPLERS:
        raise UserError(f"unknown --sampler {sampler!r}: choose {' or '.join(SAMPLERS)}")
    if pruner not in PRUNERS:
        raise UserError(f"unknown --pruner {pruner!r}: choose {', '.join(PRUNERS)}")
    if parallel is not None and parallel < 1:
        raise UserError(f"--parallel {parallel}: give at least 1 (the trials that run at once)")
    if startup < 0:
        raise UserError(f"--startup-trials {startup}: give 0 or more")


def open_study(
    rdb: Any,
    store: StudyStore,
    name: str,
    recipe: str,
    space: dict[str, Dim],
    base: RunConfig,
    options: dict,
    startup: int,
) -> Any:
    """The study (made, or loaded to continue), with its sampler and pruner."""
    higher = family_of(base).higher_is_better
    st = optuna_module().create_study(
        study_name=name, storage=rdb, direction="maximize" if higher else "minimize", load_if_exists=True
    )
    st.set_user_attr("space", space_text(space))
    st.set_user_attr("recipe", recipe)
    # A seed per start (and per process where searches share the study): a rerun, or the
    # search beside it, must not draw the same values again.
    where = [os.getpid(), socket.gethostname()] if store.shared else []
    st.sampler = make_sampler(options["sampler"], int(storage.digest([name, len(st.trials), *where])[:8], 16), startup)
    st.pruner = make_pruner(options["pruner"], base, startup)
    return st
