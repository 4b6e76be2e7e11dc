"""Settings: every environment variable the project reads is a field of one settings class per
layer, the docs' table is theirs, a bad value is one line naming the variable, and no module
outside them reads the environment but to hand it on to a process it starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mllm import UserError

ROOT = Path(__file__).resolve().parents[1]
# The only module that touches os.environ: the other settings modules read it through
# pydantic-settings, and a child process's environment, or a setting handed to a library that reads
# its own there (MLflow's client, CUDA), goes through its `environment`, `export` and `exported`.
HANDS_ON = {"mllm/settings.py"}


def test_the_docs_table_is_the_settings_classes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flows.settings"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc.endswith(out.stdout), (
        "docs/settings.md's tables differ from `python -m flows.settings`: paste its output"
    )


def test_only_the_settings_modules_read_the_environment() -> None:
    readers = {
        str(p.relative_to(ROOT))
        for room in ("mllm", "tasks", "flows")
        for p in (ROOT / room).rglob("*.py")
        if re.search(r"os\.environ|getenv", p.read_text())
    }
    assert readers <= HANDS_ON, f"read the environment outside the settings modules: {sorted(readers - HANDS_ON)}"


def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch) -> None:
    from flows.settings import settings as flow_settings
    from mllm.settings import settings as mllm_settings
    from tasks.settings import settings as task_settings

    monkeypatch.setenv("MLLM_S3_READ_TIMEOUT", "soon")
    with pytest.raises(UserError, match=r"^MLLM_S3_READ_TIMEOUT='soon': give seconds an S3 request waits for a byte"):
        mllm_settings()
    monkeypatch.setenv("MLLM_METRICS_RETRY_S", "0")
    with pytest.raises(
        UserError, match=r"^MLLM_METRICS_RETRY_S='0': give the seconds between two looks .* more than 0$"
    ):
        task_settings()
    monkeypatch.delenv("MLLM_METRICS_RETRY_S")
    monkeypatch.setenv("MLLM_TRAIN_RESTARTS", "-1")
    with pytest.raises(UserError, match=r"^MLLM_TRAIN_RESTARTS='-1': give how often a training"):
        flow_settings()
    monkeypatch.setenv("MLLM_TRAIN_RESTARTS", "")  # empty: the default
    monkeypatch.setenv("MLLM_SEARCH_GRACE_S", "2.5")
    s = flow_settings()
    assert (s.train_restarts, s.search_grace_s) == (3, 2.5)


# Imports every module of the three packages in a fresh interpreter (a __main__ would run its
# command) and prints what changed in the environment and in typer's classes.
_IMPORT_ALL = """
import importlib, os, pkgutil, sys
import typer
from typer._click.exceptions import NoSuchOption

def typer_now():
    return {(c.__name__, n): getattr(c, n) for c in (typer.core.TyperOption, typer.core.TyperArgument,
            typer.core.TyperCommand, typer.core.TyperGroup, NoSuchOption) for n in vars(c)}

env, typer_before = dict(os.environ), typer_now()
for package in ("mllm", "tasks", "flows"):
    for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
print(sorted(set(env.items()) ^ set(os.environ.items())))
print(sorted(k for k, v in typer_now().items() if typer_before.get(k) is not v))
"""


@pytest.mark.slow
def test_importing_the_packages_changes_no_environment_and_no_library() -> None:
    from flows import QUIET_ENV

    # As a Prefect worker imports the flows: none of the defaults set, PREFECT_API_URL empty.
    # (DO_NOT_TRACK stays: without it, importing Prefect starts its analytics.)
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV or k == "DO_NOT_TRACK"}
    env["PREFECT_API_URL"] = ""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout


def test_the_entry_points_set_the_defaults_and_the_users_own_wins(monkeypatch) -> None:
    from flows import QUIET_ENV
    from flows.settings import process_defaults

    for k in QUIET_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "2")
    monkeypatch.setenv("PREFECT_API_URL", " ")
    process_defaults()
    assert os.environ["PREFECT_CLIENT_MAX_RETRIES"] == "2"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert "PREFECT_API_URL" not in os.environ
