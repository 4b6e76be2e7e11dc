"""The environment variables the flows, the CLI and the stack read, each a typed field with its
default and its meaning (docs/settings.md is generated from these fields), and the defaults the
entry points set up: the only place under `flows` that reads or sets the environment."""

from __future__ import annotations

import atexit
import gc

from pydantic import Field

from mllm.settings import environment, export, export_defaults, seconds
from tasks.settings import TaskSettings


class FlowSettings(TaskSettings):
    """The tasks' settings (the servers' URLs, the flow run) and the flows' own."""

    storage: str | None = Field(
        None, validation_alias="MLLM_STORAGE", description="the storage root, a folder or URL [./storage]"
    )
    sweep_retry_delay_s: float = seconds(
        "MLLM_SWEEP_RETRY_DELAY_S", 10.0, "the seconds before a failed point runs again"
    )
    search_grace_s: float = seconds(
        "MLLM_SEARCH_GRACE_S",
        90.0,
        "the seconds a search trial's heartbeat may be late before another search takes the trial over",
    )
    train_restarts: int = Field(
        3,
        ge=0,
        validation_alias="MLLM_TRAIN_RESTARTS",
        description="how often a training whose worker was lost is handed out again",
    )
    lost_after_s: float = seconds(
        "MLLM_LOST_AFTER_S",
        300.0,
        "the seconds a pool's training may stay unclaimed or silent before it counts as lost",
        zero_ok=False,
    )
    gpus: str | None = Field(
        None,
        validation_alias="MLLM_GPUS",
        description="the GPUs a worker hands out, one per training [CUDA_VISIBLE_DEVICES, else every GPU torch sees]",
    )
    cuda_visible_devices: str | None = Field(
        None, validation_alias="CUDA_VISIBLE_DEVICES", description="the GPUs CUDA shows this process"
    )
    gpu_locks: str | None = Field(
        None,
        validation_alias="MLLM_GPU_LOCKS",
        description="the folder of a worker's GPU locks [$TMPDIR/mllm-gpus-UID]",
    )
    progress: bool = Field(
        False, validation_alias="MLLM_PROGRESS", description="progress bars where standard error is not a terminal"
    )
    stack_home: str | None = Field(
        None, validation_alias="MLLM_STACK_HOME", description="the stack's folder [./.mllm-stack]"
    )
    stack_login_tries: int = Field(
        10,
        ge=1,
        validation_alias="MLLM_STACK_LOGIN_TRIES",
        description="failed logins a minute, per user and per address, before a "
        "secured stack's gate locks them out for 300 s",
    )
    caddy: str | None = Field(
        None, validation_alias="MLLM_CADDY", description="the Caddy program a secured stack runs [caddy on PATH]"
    )
    postgres_bin: str | None = Field(
        None,
        validation_alias="MLLM_POSTGRES_BIN",
        description="the folder of PostgreSQL's programs [the newest installed]",
    )
    postgres_user: str = Field(
        "postgres",
        validation_alias="MLLM_POSTGRES_USER",
        description="the user the stack runs PostgreSQL as when started by root",
    )
    study_database: str | None = Field(
        None,
        validation_alias="MLLM_STUDY_DATABASE",
        description="where a search keeps its Optuna study [the stack's PostgreSQL, "
        "else optuna.db beside the storage root]",
    )
    prefect_api_auth_string: str | None = Field(
        None,
        validation_alias="PREFECT_API_AUTH_STRING",
        description="the credential Prefect's client sends (user:password)",
    )
    prefect_api_ssl_cert_file: str | None = Field(
        None, validation_alias="PREFECT_API_SSL_CERT_FILE", description="the CA file Prefect's server is checked with"
    )
    prefect_api_tls_insecure_skip_verify: bool = Field(
        False,
        validation_alias="PREFECT_API_TLS_INSECURE_SKIP_VERIFY",
        description="Prefect's client trusts any certificate",
    )


def settings() -> FlowSettings:
    return FlowSettings.read()


def process_defaults() -> None:
    """Set up this process's environment for the pipeline: flows.QUIET_ENV's defaults (the user's
    own setting wins), and an empty PREFECT_API_URL taken as unset (Prefect would start its
    temporary server for the flows but aim its events client at the empty URL, logging an error
    line for every event of the run). Run by the entry points, the CLI's before it imports Prefect
    (which reads DO_NOT_TRACK and its settings when imported) and each flow a worker runs."""
    from flows import QUIET_ENV

    export_defaults(QUIET_ENV)
    if not environment().get("PREFECT_API_URL", "x").strip():
        export({"PREFECT_API_URL": None})
    # The last exit handler (they run in reverse order) takes every object out of the collector's
    # reach before the interpreter's own collections at exit: after a training those took 17-38 s
    # of a command's or a flow run's exit here (docs/benchmarks/orchestration.md, "Ctrl-C"). Once
    # per process however often this runs.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    # What exists now stays for the process's life (in a flow run a worker started: every import);
    # each full collection walked it again, 0.7-1.5 s here with the GIL held, and Prefect's
    # worker gives a flow run 1 s to acknowledge a cancel before it marks the run Crashed.
    gc.freeze()


def markdown() -> str:
    """docs/settings.md's tables, one per layer, from the fields above and those of `mllm` and
    `tasks` (`python -m flows.settings` prints them)."""
    from mllm.settings import MllmSettings

    out = []
    for title, cls in (
        ("mllm (the model package)", MllmSettings),
        ("tasks (the stages, MLflow)", TaskSettings),
        ("flows (the flows, the CLI, the stack)", FlowSettings),
    ):
        out += [f"### {title}", "", "| variable | default | what it sets |", "|---|---|---|"]
        out += [f"| `{name}` | {f'`{default}`' if default else ''} | {what} |" for name, default, what in cls.table()]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
