"""How a run is launched: its storage root, where Prefect keeps task results, and the work pool
its training goes to (`--train-on`, else the recipe's `pipeline.pool`, else this process)."""

from __future__ import annotations

import os
from typing import Any

from mllm.config import LAUNCH_SECTION, recipe_dict
from tasks.caching import result_storage


def storage_root(storage_url: str | None = None) -> str:
    """The storage root: --storage, else $MLLM_STORAGE, else ./storage."""
    root = storage_url or os.environ.get("MLLM_STORAGE") or "storage"
    if "://" not in root:
        root = os.path.abspath(os.path.expanduser(root))
    return root.rstrip("/")


def with_results(fl: Any, root: str) -> Any:
    """The flow with its task results (and so Prefect's cache records) kept under `root`."""
    # The flows themselves persist nothing (a failed run would leave its pickled exception in
    # storage); their tasks take this storage for their results and cache records.
    return fl.with_options(result_storage=result_storage(root), persist_result=False)


def training_pool(recipe: str | None, train_on: str | None) -> str | None:
    """Where a recipe trains: the pool asked for, else the one its recipe file names under
    `pipeline: {pool: NAME}`, else None (this process). Not part of the run's config: where a
    model trains is not what it is."""
    if train_on:
        return train_on
    if recipe is None:
        return None
    return (recipe_dict(recipe).get(LAUNCH_SECTION) or {}).get("pool")
