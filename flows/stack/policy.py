"""The secured stack's one policy: what each role may do on every route of the Prefect and MLflow servers,
and the table rendered for docs/team-stack.md."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROUTES = Path(__file__).with_name("routes.json")
LEVELS = {"all": ("viewer", "worker", "admin"), "worker": ("worker", "admin"), "admin": ("admin",)}

# LEVEL METHOD PATTERN [CHECK]: the first line whose method and pattern (fnmatch, over the route
# template) match a route gives its rule. WS is a websocket. Checks (for non-admins):
#   jobvars  the body's job_variables only from the safe set (SAFE_JOB_VARIABLES);
#   training a deployment only of the project's training flow, with no pull steps or other code;
#   results  a block document only of the pipeline's result storage (named mllm-results-...);
#   state    a forced state (force: true) only one that ends a run (FORCEABLE);
#   hello    a worker channel's hello may not create its pool (create_pool_if_not_found off);
#   (two checks joined by + both apply)
#   token    the credential may come inside the first message ({"type": "auth", "token": ...}),
#            as Prefect's event and log subscribers send it.
RULES = {
    "prefect": """
all    GET    /api/admin/version
admin  *      /api/admin/*
all    GET    /api/*
all    GET    /{ui:path}
all    POST   /api/*/filter
all    POST   /api/*/count
all    POST   /api/*/paginate
all    POST   /api/*/history
all    POST   /api/ui/*
all    POST   /api/flow_runs/lateness
all    POST   /api/events/count-by/{countable}
all    POST   /api/work_pools/{name}/concurrency_status
all    POST   /api/work_queues/{id}/concurrency_status
worker POST   /api/work_pools/{name}/get_scheduled_flow_runs
worker POST   /api/deployments/get_scheduled_flow_runs
worker POST   /api/work_queues/{id}/get_runs
worker POST   /api/work_pools/{work_pool_name}/workers/heartbeat
worker POST   /api/flows/
worker POST   /api/flow_runs/                                   jobvars
worker PATCH  /api/flow_runs/{id}                               jobvars
worker POST   /api/flow_runs/{id}/set_state                     state
worker POST   /api/flow_runs/{id}/input
worker PATCH  /api/flow_runs/{id}/labels
worker POST   /api/task_runs/
worker PATCH  /api/task_runs/{id}
worker POST   /api/task_runs/{id}/set_state
worker POST   /api/deployments/                                 training
worker POST   /api/deployments/{id}/create_flow_run             jobvars
worker POST   /api/logs/
worker POST   /api/block_types/
worker POST   /api/block_schemas/
worker POST   /api/block_documents/                             results
worker PATCH  /api/block_documents/{id}                         results
worker POST   /api/events
worker POST   /api/artifacts/
worker POST   /api/concurrency_limits/increment
worker POST   /api/concurrency_limits/decrement
worker POST   /api/v2/concurrency_limits/increment*
worker POST   /api/v2/concurrency_limits/decrement*
worker POST   /api/v2/concurrency_limits/leases/{lease_id}/renew
all    WS     /api/events/out                                   token
worker WS     /api/logs/out                                     token
worker WS     /api/events/in
worker WS     /api/task_runs/subscriptions/scheduled
worker WS     /api/work_pools/{work_pool_name}/workers/connect  token+hello
admin  *      *
""",
    "mlflow": """
all    GET    /*api/2.0/mlflow/users/current
all    GET    /*api/3.0/mlflow/users/current/permissions
admin  *      /*api/*/mlflow/users/*
admin  *      /*api/3.0/mlflow/roles/*
admin  *      /*api/*/mlflow/*permissions*
admin  *      /*api/*/mlflow/gateway*
admin  *      /*api/3.0/mlflow/workspaces*
admin  *      /*api/2.0/mlflow/webhooks*
admin  *      /signup
all    GET    *
all    POST   /*api/*/mlflow/*search*
all    POST   /*api/2.0/mlflow/registered-models/get-latest-versions
all    POST   /*api/2.0/mlflow/artifacts/presigned-download-url
all    POST   /*api/3.0/mlflow/traces/batchGetInfos
all    POST   /graphql
worker *      /*api/2.0/mlflow/runs/*
worker *      /*api/2.0/mlflow/experiments/*
worker *      /*api/2.0/mlflow/logged-models*
worker *      /*api/2.0/mlflow/model-versions/*
worker *      /*api/2.0/mlflow/registered-models/*
worker *      /*api/2.0/mlflow-artifacts/*
worker POST   /*api/2.0/mlflow/artifacts/presigned-upload-url
admin  *      *
""",
}

# The checks themselves are flows/stack/checks.py's.
# The job variables a non-admin may set on a flow run or training deployment, and the `env` keys:
# the settings a training needs to find storage and MLflow (flows/dispatch.py job_env) and the
# GPUs it asks for. A command, image, working folder or any other env var changes what a worker
# runs, and is the admin's alone.
SAFE_JOB_VARIABLES = ("env", "gpus", "device_requests")
SAFE_ENV = (
    "MLLM_STORAGE",
    "MLFLOW_TRACKING_URI",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "MLFLOW_S3_ENDPOINT_URL",
)
# The storage endpoints among them: only the stack's own (a worker's run writes where the stack's
# storage is, never where a caller points it).
ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL")
# The states a non-admin may force a flow run into, bypassing the server's orchestration rules:
# those Prefect's own clients force (a runner marking a cancelled run, an engine's crash or
# failed submission); forcing a run back to SCHEDULED, RUNNING or COMPLETED would re-run or fake it.
FORCEABLE = ("CANCELLING", "CANCELLED", "CRASHED", "FAILED")
TRAINING_ENTRYPOINT = "flows.training:train"  # flows/dispatch.py ENTRYPOINT
RESULTS_PREFIX = "mllm-results-"  # tasks/caching.py result_storage's blocks
# A worker's polls and heartbeats: POSTs every few seconds that change no one's work; not audited.
POLLS = (
    "/api/work_pools/{name}/get_scheduled_flow_runs",
    "/api/deployments/get_scheduled_flow_runs",
    "/api/work_queues/{id}/get_runs",
    "/api/work_pools/{work_pool_name}/workers/heartbeat",
)


@dataclass(frozen=True)
class Rule:
    level: str
    method: str
    pattern: str
    check: str | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        return LEVELS[self.level]


def _parse(text: str) -> list[Rule]:
    rules = []
    for line in text.strip().splitlines():
        level, method, pattern, *check = line.split()
        rules.append(Rule(level, method, pattern, check[0] if check else None))
    return rules


PARSED = {server: _parse(text) for server, text in RULES.items()}
DENIED = Rule("admin", "*", "(no route of the server)")


def rule_for(server: str, method: str, template: str) -> Rule:
    """The rule of one route template: the first line of the server's rules that matches it."""
    for rule in PARSED[server]:
        if rule.method in ("*", method) and fnmatch.fnmatchcase(template, rule.pattern):
            return rule
    return DENIED


@lru_cache(maxsize=1)
def routes() -> dict[str, list[tuple[str, str]]]:
    """Each server's (method, template) pairs, as its own route list gives them (WS: websocket)."""
    data = json.loads(ROUTES.read_text())
    return {server: [tuple(r) for r in found] for server, found in data.items()}


def _regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{[^}]+\})", template)
    body = "".join((".+" if p.endswith(":path}") else "[^/]+") if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(body.rstrip("/") + "/?")


@lru_cache(maxsize=1)
def _compiled() -> dict[str, list[tuple[str, str, re.Pattern]]]:
    return {server: [(m, t, _regex(t)) for m, t in found] for server, found in routes().items()}


_ORDER = {"all": 0, "worker": 1, "admin": 2}


def decide(server: str, method: str, path: str) -> tuple[Rule, list[str]]:
    """The rule for a request (HEAD as GET), and the templates its path matched: the most
    restrictive of their rules, the admin's alone when none matched."""
    method = "GET" if method == "HEAD" else method
    found = [t for m, t, rx in _compiled()[server] if m == method and rx.fullmatch(path)]
    if not found:
        return DENIED, []
    rules = [rule_for(server, method, t) for t in found]
    checks = {r.check for r in rules} - {None}
    strictest = max(rules, key=lambda r: _ORDER[r.level])
    if len(checks) > 1 or (checks and strictest.check is None and strictest.level != "admin"):
        return Rule("admin", method, strictest.pattern), found  # two checks could not both hold: admins only
    return Rule(strictest.level, method, strictest.pattern, next(iter(checks), None)), found


def has(rule: Rule, check: str) -> bool:
    return check in (rule.check or "").split("+")


# -- the table for the docs ----------------------------------------------------------------------


def render() -> str:
    """The policy as a Markdown table: every route of both servers with the roles it allows."""
    rows = ["| server | method | route | viewer | worker | admin | check |", "|---|---|---|---|---|---|---|"]
    for server, found in routes().items():
        for method, template in sorted(found, key=lambda r: (r[1], r[0])):
            rule = rule_for(server, method, template)
            marks = ["yes" if role in rule.roles else "-" for role in ("viewer", "worker", "admin")]
            rows.append(f"| {server} | {method} | `{template}` | {' | '.join(marks)} | {rule.check or ''} |")
    return "\n".join(rows) + "\n"
