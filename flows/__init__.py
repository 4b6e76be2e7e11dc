"""Prefect flows and the CLI: compose the stages, choose where training runs."""

import os

# The one list of environment defaults for this project's processes and the servers it starts.
# Both Prefect and MLflow try to send usage data home, which only fails (and logs an error) on a
# machine without internet; a busy 2-core machine can take longer than Prefect's default 20 s to
# start its temporary server.
QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "PYTHONUNBUFFERED": "1",
}

for _name, _value in QUIET_ENV.items():
    os.environ.setdefault(_name, _value)

# An empty PREFECT_API_URL names no server, and is taken as unset: Prefect would start its
# temporary server for the flows but aim its events client at the empty URL, logging an error
# line for every event of the run.
if not os.environ.get("PREFECT_API_URL", "x").strip():
    del os.environ["PREFECT_API_URL"]
