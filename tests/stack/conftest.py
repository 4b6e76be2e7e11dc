"""Tests of flows/stack/: an MLflow store of each test's own; its integration tests, the session's Prefect server."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pipeline_rooms import _own_mlflow_store  # noqa: F401 (a fixture, found by name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report kept on its test (`item.rep_call`...), for fixtures that end what a
    failed test left behind and fail a passing one that left it."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="module")
def open_dir() -> Iterator[Path]:
    """A folder the PostgreSQL cluster's user (postgres, when we are root) can enter: a stack whose
    home is there runs on PostgreSQL where its server is installed, as `stack up` does for a user;
    under pytest's private folders it falls back to SQLite."""
    folder = Path(tempfile.mkdtemp(prefix="mllm-pg-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
