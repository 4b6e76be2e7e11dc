"""The environment variables the pipeline's tasks read (the stages, MLflow tracking, the served
model), each a typed field with its default and its meaning: the only place under `tasks` that
reads the environment (docs/settings.md is generated from these fields)."""

from __future__ import annotations

from pydantic import Field

from mllm.settings import Settings, seconds


class TaskSettings(Settings):
    log_every_s: float = seconds("MLLM_LOG_EVERY_S", 10.0, "seconds between two progress lines in a worker's log")
    train_retry_delay_s: float = seconds(
        "MLLM_TRAIN_RETRY_DELAY_S", 5.0, "the seconds before a failed training runs again"
    )
    metrics_every_s: float = seconds("MLLM_METRICS_EVERY_S", 2.0, "seconds between metric requests")
    metrics_retry_s: float = seconds(
        "MLLM_METRICS_RETRY_S",
        10.0,
        "the seconds between two looks at a tracking server that stopped answering",
        zero_ok=False,
    )
    servers_wait_s: float = seconds(
        "MLLM_SERVERS_WAIT_S",
        240.0,
        "the seconds a retried point or trial waits for the Prefect and MLflow servers to answer",
    )
    system_metrics: bool = Field(
        True,
        validation_alias="MLLM_SYSTEM_METRICS",
        description="MLflow's system metrics (CPU, memory, GPU) around a training",
    )
    git_commit: str | None = Field(
        None,
        validation_alias="MLLM_GIT_COMMIT",
        description="the commit a run records where the code has no git checkout (set in the training image)",
    )
    mlflow_tracking_uri: str = Field(
        "",
        validation_alias="MLFLOW_TRACKING_URI",
        description="the MLflow store or server [mlflow.db beside the storage root]",
    )
    mlflow_tracking_username: str | None = Field(
        None, validation_alias="MLFLOW_TRACKING_USERNAME", description="the user MLflow's client logs in as"
    )
    mlflow_tracking_password: str | None = Field(
        None, validation_alias="MLFLOW_TRACKING_PASSWORD", description="that user's password"
    )
    mlflow_tracking_server_cert_path: str | None = Field(
        None,
        validation_alias="MLFLOW_TRACKING_SERVER_CERT_PATH",
        description="the CA file MLflow's server is checked with",
    )
    prefect_api_url: str = Field(
        "", validation_alias="PREFECT_API_URL", description="the Prefect server [a temporary one per command]"
    )
    flow_run_id: str | None = Field(
        None,
        validation_alias="PREFECT__FLOW_RUN_ID",
        description="the flow run a worker runs (set by Prefect's worker)",
    )


def settings() -> TaskSettings:
    return TaskSettings.read()
