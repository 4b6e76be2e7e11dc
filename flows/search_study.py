"""A search's study: where Optuna keeps it (optuna.db beside the storage root), the lock a
running search holds on it, its sampler and pruner, and the checks of a search's options made
before anything starts."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from flows.search_space import Dim, space_text
from mllm import UserError, storage
from mllm.config import RunConfig
from tasks.tracking.tracker import local_store

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "hyperband", "none")


def study_file(root: str) -> str:
    """optuna.db beside the storage root (in the current folder for an object-store root)."""
    return os.path.join(os.path.dirname(local_store(root)), "optuna.db")


def optuna_module() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the terminal shows the bar and the table
    return optuna


def open_storage(path: str) -> Any:
    return optuna_module().storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"connect_args": {"timeout": 60}})


def check_study(root: str, name: str, space: dict[str, Dim], recipe: str) -> None:
    """A study of this name in the store with another space or recipe: one line, nothing opened
    for writing (the store is only read, and only when it exists)."""
    path = study_file(root)
    if not os.path.exists(path):
        return
    st = open_storage(path)
    try:
        attrs = st.get_study_user_attrs(st.get_study_id_from_name(name))
    except KeyError:
        return
    if (attrs.get("space"), attrs.get("recipe")) != (space_text(space), recipe):
        raise UserError(f"study {name} in {path} searches recipe {attrs.get('recipe')} over "
                        f"{attrs.get('space')!r}, not {recipe} over {space_text(space)!r}: give another --study "
                        "name, or leave --study out (the name then follows the recipe and the space)")


@contextlib.contextmanager
def study_lock(path: str, name: str):
    """The study held by this process: a RUNNING trial another search finds belongs to a dead one."""
    folder = os.path.join(os.path.dirname(path), "optuna.locks", name)
    with storage.exclusive(folder, lambda: print(f"another search of study {name} is running: waiting for it")):
        yield


def make_sampler(name: str, seed: int) -> Any:
    samplers = optuna_module().samplers
    return samplers.RandomSampler(seed=seed) if name == "random" else samplers.TPESampler(seed=seed)


def make_pruner(name: str, cfg: RunConfig, startup: int) -> Any:
    pruners = optuna_module().pruners
    if name == "median":
        return pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0)
    if name == "halving":
        return pruners.SuccessiveHalvingPruner(min_resource=cfg.train.eval_interval)
    if name == "hyperband":
        return pruners.HyperbandPruner(min_resource=cfg.train.eval_interval,
                                       max_resource=cfg.train.max_steps or "auto")
    return pruners.NopPruner()


def check_options(trials_n: int, sampler: str, pruner: str, parallel: int | None, pool: str | None,
                  startup: int) -> None:
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
    if pool and pruner != "none":
        raise UserError(f"--pruner {pruner} with a work pool: a worker's training cannot ask this process's "
                        "pruner yet: give --pruner none with --train-on, or train here")
