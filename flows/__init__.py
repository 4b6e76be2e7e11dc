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
    # Prefect's client retries a 502/503/429/408, a timeout and a dropped connection with back-off
    # doubling from 2 s, PREFECT_CLIENT_MAX_RETRIES times: its default of 5 gives up after about a
    # minute, less than a server on SQLite under a sweep (`database is locked`) or one restarting
    # behind a proxy may answer 503. 7 waits about 4 minutes, as long as MLflow's own client does
    # with its defaults (MLFLOW_HTTP_REQUEST_MAX_RETRIES 7, BACKOFF_FACTOR 2: it also retries 500
    # and 504), which are left as they are. A server whose database is down answers 500, which
    # Prefect does not retry: that still ends a command in seconds (flows/stack/database.py).
    "PREFECT_CLIENT_MAX_RETRIES": "7",
}

for _name, _value in QUIET_ENV.items():
    os.environ.setdefault(_name, _value)

# An empty PREFECT_API_URL names no server, and is taken as unset: Prefect would start its
# temporary server for the flows but aim its events client at the empty URL, logging an error
# line for every event of the run.
if not os.environ.get("PREFECT_API_URL", "x").strip():
    del os.environ["PREFECT_API_URL"]
