"""`make clean` after a pipeline run in a folder: it takes everything the run left there (the
defaults: ./storage, MLflow's store and artifacts beside it) and nothing of the user's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from commands import cli
from textdata import make_text

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_takes_what_a_run_left_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    here = tmp_path / "checkout"
    here.mkdir()
    (here / "book.txt").write_text(make_text(), encoding="utf-8")
    (here / "notes").mkdir()
    (here / "notes" / "plan.md").write_text("mine\n")
    (here / "mlflow.yaml").write_text("mine too\n")  # named like an output, not one
    mine = _tree(here)
    # What a user's checkout holds besides: the venv and pip's metadata of the editable install.
    for made in (".venv/bin", "mllm_pipeline.egg-info"):
        (here / made).mkdir(parents=True)
    # The CLI's defaults, as `make run` has them: no tracking URI, storage ./storage.
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        "book.txt",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.eval_interval=4",
        "--set",
        "sample.max_new_tokens=5",
        cwd=here,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    left = {name.split("/")[0] for name in _tree(here) - mine}
    assert {"storage", "mlflow.db", "mlruns"} <= left, left  # what README's outputs name

    done = subprocess.run(["make", "-f", str(REPO / "Makefile"), "clean"], cwd=here, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _tree(here) == mine, _tree(here) - mine
