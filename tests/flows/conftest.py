"""Tests of flows/: an MLflow store of each test's own; its integration tests, the session's Prefect server."""

from pipeline_rooms import _own_mlflow_store  # noqa: F401 (a fixture, found by name)
