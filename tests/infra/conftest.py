"""Tests of infra/: the session's Prefect server and an MLflow store of each test's own."""

from pipeline_rooms import _own_mlflow_store, _session_prefect_server  # noqa: F401 (fixtures, found by name)
