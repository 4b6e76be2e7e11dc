"""What a lineage chain is made of: its links, their statuses, and the values read into them.
Shared by a model's chain (flows/history/lineage.py) and a corpus's (flows/history/lineage_corpus.py)."""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException

from mllm.redact import scrub
from mllm.storage import hide_credentials

OK, MISSING, CHANGED, UNRECORDED = "ok", "missing", "changed", "unrecorded"
UNCHECKED = "unchecked"  # recorded, but nothing that could contradict it answered
BROKEN = (MISSING, CHANGED)  # a chain with one of these makes `lineage` exit non-zero


def get_or_none(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except MlflowException:
        return None


def make_link(link: str, status: str, /, **fields: Any) -> dict[str, Any]:
    return {"link": link, "status": status, **{k: v for k, v in fields.items() if v not in (None, "")}}


def model_id(version: Any) -> str | None:
    """The LoggedModel a registered version was made from (its source is models:/<model id>)."""
    source = version.source or ""
    return getattr(version, "model_id", None) or (
        source[len("models:/") :] if source.startswith("models:/m-") else None
    )


def as_int(x: str | None) -> int | None:
    return int(x) if x and x.isdigit() else None


def as_float(x: str | None) -> float | None:
    try:
        return float(x) if x is not None else None
    except ValueError:
        return None


def clean(obj: Any) -> Any:
    """Every string without credentials: URLs lose user:password, secrets in values go."""
    if isinstance(obj, str):
        return scrub(hide_credentials(obj) if "://" in obj else obj)
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return obj
