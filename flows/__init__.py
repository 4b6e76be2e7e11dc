"""Prefect flows and the CLI: compose the stages, choose where training runs."""

# The one list of environment defaults for this project's processes and the servers it starts
# (set by the entry points: flows.settings.process_defaults).
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
    # MLflow prints a "View run" link when a run ends, and it opens MLflow 3.17's UI in its GenAI
    # view; the CLI prints `run_url` instead (tasks/tracking/store.py), which asks for the
    # model-training view.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    # Prefect's client retries a 502/503/429/408, a timeout and a dropped connection with back-off
    # doubling from 2 s, PREFECT_CLIENT_MAX_RETRIES times: its default of 5 gives up after about a
    # minute, less than a server on SQLite under a sweep (`database is locked`) or one restarting
    # behind a proxy may answer 503. 7 waits about 4 minutes, as long as MLflow's own client does
    # with its defaults (MLFLOW_HTTP_REQUEST_MAX_RETRIES 7, BACKOFF_FACTOR 2: it also retries 500
    # and 504), which are left as they are. The stack's Prefect server answers 503 while its
    # database cannot be reached (flows/stack/prefect_server.py), so an outage of the database
    # shorter than these retries fails nothing; any other 500 is not retried (it would not mend).
    # PREFECT_CLIENT_RETRY_EXTRA_CODES is left unset: with 500 in it, a server's bug would keep
    # every client waiting out its 4 minutes before the same error.
    "PREFECT_CLIENT_MAX_RETRIES": "7",
}
