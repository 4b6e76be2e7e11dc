"""Model families through the pipeline's tasks and flows: the training key follows every edit of
`mllm`'s source, and a sequence experiment runs end to end through `mllm-pipeline run`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # whole pipelines, one per family


# --- code digests -------------------------------------------------------------------------


def test_editing_any_mllm_source_changes_the_training_key(tmp_path: Path) -> None:
    # A copy of the package, digested in a fresh process before and after editing what one file
    # that the old hand-kept list of modules left out does (the windows sampler): a comment would
    # change no key (tests/tasks/test_layout.py).
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "mllm", copy / "mllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tasks", copy / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    probe = textwrap.dedent("""
        import json, types
        from mllm.resolve import resolve
        from tasks.model.train import train_key
        data = types.SimpleNamespace(splits=types.SimpleNamespace(key="s"), vocab=types.SimpleNamespace(digest="v"))
        print(json.dumps(train_key(resolve("smoke"), data)))
    """)

    def key() -> str:
        env = dict(os.environ, PYTHONPATH=str(copy))
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    before = key()
    assert key() == before  # the same code, the same key
    windows = copy / "mllm" / "lm" / "windows.py"
    windows.write_text(
        windows.read_text().replace(
            "return windows(self.ids, self.take() * self.stride, self.window)",
            "return windows(self.ids, self.stride * self.take(), self.window)",
        )
    )
    assert key() != before


# --- through the pipeline -----------------------------------------------------------------


def test_count_rnn_runs_through_the_pipeline_and_its_model_counts(tmp_path: Path) -> None:
    from commands import cli
    from mlflow.tracking import MlflowClient

    storage = tmp_path / "storage"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    out = cli("run", "--recipe", "count-rnn", "--storage", str(storage), timeout=300, **env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "accuracy 100.00%" in out.stdout and "sample (greedy): 11" in out.stdout
    assert not (storage / "raw").exists()  # nothing downloaded: the data was made from the config
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    version = client.get_model_version_by_alias("count-rnn", "champion")
    assert version.tags["headline"] == "accuracy" and float(version.tags["headline.value"]) == 1.0
    metrics = client.get_run(version.run_id).data.metrics
    assert metrics["final_accuracy"] == 1.0 and "final_train_accuracy" in metrics
    # The served model and a checkpoint answer the same, through the same entry point.
    served = cli("sample", "--model", "count-rnn@champion", "--storage", str(storage), "--prompt", "7 8 9 10", **env)
    assert served.returncode == 0 and served.stdout.strip() == "11", served.stderr[-2000:]
    best = next(storage.glob("runs/*/checkpoints/best.pt"))
    local = cli("sample", "--checkpoint", str(best), "--prompt-file", str(_lines(tmp_path, ["7 8 9 10", "", "50"])))
    assert local.returncode == 0 and local.stdout.splitlines() == ["11", "", "51"], local.stdout + local.stderr
    bad = cli("sample", "--checkpoint", str(best), "--prompt", "seven")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "not numbers below 128" in bad.stderr


def _lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path
