"""What every test of the pipeline's rooms (tasks, flows, stack, cli, infra) gets, imported by each
room's conftest.py: the session's Prefect server, started before any module's fixtures, and an
MLflow store of the test's own. tests/mllm and the project-wide tests need neither."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_prefect_server(prefect_server) -> None:
    """Session-scoped so that it runs before a module's own fixtures, which may start commands."""


@pytest.fixture(autouse=True)
def _own_mlflow_store(own_mlflow_store) -> None:
    """Each test its own empty MLflow store (conftest.own_mlflow_store)."""
