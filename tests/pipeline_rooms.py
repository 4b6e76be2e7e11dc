"""What every test of the pipeline's rooms (tasks, flows, stack, cli, infra) gets, imported by each
room's conftest.py: an MLflow store of the test's own. (Their integration tests get the session's
Prefect server too: tests/conftest.py, pytest_collection_modifyitems.) tests/mllm and the
project-wide tests need neither."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_mlflow_store(own_mlflow_store) -> None:
    """Each test its own empty MLflow store (conftest.own_mlflow_store)."""
