"""The checks a non-admin's request must pass beyond its route's rule (flows/stack/policy.py): a
body's job variables, a deployment, a forced state, a result-storage block, a worker's hello;
each answers None or the sentence, naming the field, that the gate's 403 carries."""

from __future__ import annotations

import json

from flows.stack.policy import (
    ENDPOINT_ENV,
    FORCEABLE,
    RESULTS_PREFIX,
    SAFE_ENV,
    SAFE_JOB_VARIABLES,
    TRAINING_ENTRYPOINT,
)
from mllm.storage import digest

CHECKS = ("jobvars", "training", "results", "state")


def _same(a: str | None, b: str | None) -> bool:
    return (a or "").rstrip("/") == (b or "").rstrip("/")


def endpoint_problem(what: str, value: object, storage_endpoint: str | None) -> str | None:
    """Why `what` may not point storage at `value`: only the stack's own endpoint is allowed."""
    if _same(value if isinstance(value, str) else None, storage_endpoint) and storage_endpoint:
        return None
    own = f"the stack's own ({storage_endpoint})" if storage_endpoint else "unset (the stack's storage has none)"
    return f"{what} must be {own}: a worker's storage endpoint is set on the worker, not by a caller"


def job_variables_problem(
    job_variables: object, tracking_uri: str | None = None, storage_endpoint: str | None = None
) -> str | None:
    """Why a non-admin may not set these job variables (a sentence naming the field), or None."""
    if job_variables in (None, {}):
        return None
    if not isinstance(job_variables, dict):
        return "job_variables must be an object"
    for name in job_variables:
        if name not in SAFE_JOB_VARIABLES:
            return (
                f"job variable {name!r} changes what a worker runs: an admin's alone "
                f"(a worker may set {', '.join(SAFE_JOB_VARIABLES)})"
            )
    env = job_variables.get("env") or {}
    if not isinstance(env, dict):
        return "job variable 'env' must be an object"
    for key, value in env.items():
        if key not in SAFE_ENV:
            return f"job variable env.{key} is not one a worker may set (it may set {', '.join(SAFE_ENV)})"
        if not isinstance(value, str):
            return f"job variable env.{key} must be a string"
        if key in ENDPOINT_ENV and (problem := endpoint_problem(f"job variable env.{key}", value, storage_endpoint)):
            return problem
    if tracking_uri and not _same(env.get("MLFLOW_TRACKING_URI", tracking_uri), tracking_uri):
        return f"job variable env.MLFLOW_TRACKING_URI must be the stack's own ({tracking_uri})"
    return None


def state_problem(data: dict) -> str | None:
    """Why a non-admin may not force this state: only the states that end a run."""
    if not data.get("force"):
        return None
    kind = str((data.get("state") or {}).get("type", "")).upper()
    if kind in FORCEABLE:
        return None
    return (
        f"force: true into {kind or 'a state'} skips the server's rules (a run re-run or marked done): "
        f"an admin's alone (a worker may force only {', '.join(FORCEABLE)})"
    )


def results_problem(name: object, data: dict | None = None, storage_endpoint: str | None = None) -> str | None:
    """Why a non-admin may not write this block document: only the pipeline's result storage
    (tasks/caching.py), each block named after the digest of its own base path, so that a block
    another root's runs read cannot be pointed elsewhere, and with the stack's storage endpoint."""
    if not (isinstance(name, str) and name.startswith(RESULTS_PREFIX)):
        return f"a worker writes only the pipeline's result storage blocks (named {RESULTS_PREFIX}...)"
    if data is None:
        return None
    fields = data.get("data") or {}
    if not isinstance(fields, dict) or not isinstance(fields.get("basepath"), str):
        return "a result storage block needs its basepath"
    if name != RESULTS_PREFIX + digest(fields["basepath"]):
        return f"block {name!r} is the result storage of another base path than {fields['basepath']!r}"
    options = fields.get("settings") or {}
    if not isinstance(options, dict):
        return "a result storage block's settings must be an object"
    if {"key", "secret", "token", "password"} & set(options):
        return "a result storage block holds no credential (the worker's environment has them)"
    endpoint = (options.get("client_kwargs") or {}).get("endpoint_url")
    if endpoint is not None:
        return endpoint_problem("the block's endpoint_url", endpoint, storage_endpoint)
    return None


def body_problem(
    check: str | None, body: bytes, tracking_uri: str | None = None, storage_endpoint: str | None = None
) -> str | None:
    """Why a non-admin's request body fails the route's check, or None (a PATCH of a block is
    checked by `results_problem` once the block's name is known)."""
    if check not in CHECKS:
        return None
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return "the body is not JSON"
    if not isinstance(data, dict):
        return "the body is not a JSON object"
    if check == "state":
        return state_problem(data)
    if check == "results":
        return results_problem(data["name"], data, storage_endpoint) if "name" in data else None
    if check == "training":
        if data.get("entrypoint") != TRAINING_ENTRYPOINT:
            return f"a worker may deploy only the project's training (entrypoint {TRAINING_ENTRYPOINT})"
        for field in ("pull_steps", "path", "job_variables_schema"):
            if data.get(field):
                return f"field {field!r} of a deployment is an admin's alone"
    return job_variables_problem(data.get("job_variables"), tracking_uri, storage_endpoint)


def hello_problem(message: dict) -> str | None:
    if message.get("type") == "worker.hello.v1" and (message.get("payload") or {}).get("create_pool_if_not_found"):
        return "create_pool_if_not_found: only an admin makes pools"
    return None
