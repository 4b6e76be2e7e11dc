"""Settings: every environment variable the project reads is a field of one settings class per
layer, the docs' table is theirs, a bad value is one line naming the variable, and no module
outside them reads the environment but to hand it on to a process it starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mllm import UserError

ROOT = Path(__file__).resolve().parents[1]
# Where the environment is handed on (to a child process, to torch, to MLflow's client), or set
# before a library reads it: the only reads of os.environ outside the settings modules.
HANDS_ON = {
    "flows/dispatch.py",
    "flows/history/runs.py",
    "flows/__init__.py",
    "flows/gpus.py",
    "flows/stack/servers.py",
    "flows/stack/processes.py",
    "flows/cli/stack_auth.py",
    "flows/stack/routes.py",  # MLflow's auth app, made only to list its routes, reads its settings there
    "tasks/tracking/outage.py",
    "tasks/tracking/store.py",
    "mllm/settings.py",
    # not yet through the settings (docs/settings.md says which variables)
    "flows/stack/users.py",
    "flows/stack/auth_errors.py",
    "tasks/tracking/served_model.py",
}


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
