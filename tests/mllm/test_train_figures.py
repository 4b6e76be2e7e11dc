"""One definition of a training's speed figures wherever they are shown, and a resumed training
that says so (issue 64, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from textdata import write_char_ids

from mllm.config import RunConfig
from mllm.train import train

GPT = {"arch": "gpt", "n_embd": 16, "n_head": 2, "n_layer": 1, "block_size": 16, "dropout": 0.0}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    write_char_ids(d, 1200)
    return d


def make_config(data_dir: Path, ckpt: Path, **train_) -> RunConfig:
    t = {
        "batch_size": 4,
        "window": 16,
        "max_steps": 8,
        "log_interval": 2,
        "eval_interval": 3,
        "eval_batches": 2,
        "checkpoint_interval": 4,
        "lr": 3e-3,
    }
    return RunConfig.model_validate(
        {
            "model": GPT,
            "train": {**t, **train_},
            "paths": {
                "train_ids": str(data_dir / "train.npy"),
                "val_ids": str(data_dir / "val.npy"),
                "vocab": str(data_dir / "vocab.json"),
                "checkpoint_dir": str(ckpt),
            },
        }
    )


def whole(checkpoint: str) -> tuple[float, float]:
    """(tokens, training seconds without evaluations) a checkpoint's metrics hold."""
    m = torch.load(checkpoint, weights_only=True)["metrics"]
    return m["tokens"], m["elapsed_s"] - m["eval_s"]


def test_a_resumed_training_says_where_from_and_its_figures_cover_every_run(data_dir, tmp_path):
    class Crash(Exception):
        pass

    def crash_at_4(progress):
        if progress["step"] == 4:
            raise Crash  # as Ctrl-C would: last.pt holds step 4

    cfg = make_config(data_dir, tmp_path / "run")
    said: list[str] = []
    with pytest.raises(Crash):
        train(cfg, on_progress=crash_at_4, on_notice=said.append)
    assert not [s for s in said if s.startswith("resumed")]
    records: list[dict] = []
    result = train(cfg, on_notice=said.append, on_metrics=records.extend)
    last = str(tmp_path / "run" / "last.pt")
    assert f"resumed from {last}: step 4 of 8" in said
    # The figures: every token of both runs (4 windows of 16 a step, 8 steps) over both runs'
    # training seconds, evaluations left out; the MFU from the same rate.
    tokens, seconds = whole(result.checkpoint)
    assert tokens == 8 * 4 * 16
    assert result.tokens_per_s == pytest.approx(tokens / seconds)
    # Each logged interval's figures by the same definition: its MFU from its rate, as the result's.
    logged = [r for r in records if "mfu" in r]
    assert logged and all(
        r["mfu"] / r["tokens_per_s"] == pytest.approx(result.mfu / result.tokens_per_s) for r in logged
    )
    assert f"{result.tokens_per_s:,.0f} tok/s, mfu {result.mfu:.1%} over the training" in result.done_line()
    # Run again once finished: nothing trains, and the figures are the same, not the last interval's.
    again = train(cfg, on_notice=said.append)
    assert said[-1] == f"resumed from {last}: step 8 of 8"
    assert (again.steps, again.tokens_per_s, again.mfu) == (8, result.tokens_per_s, result.mfu)


def test_a_time_budget_reports_its_end_to_the_progress_bar(data_dir, tmp_path):
    seen: list[dict] = []
    train(
        make_config(data_dir, tmp_path / "budget", max_steps=None, max_minutes=0.02, log_interval=1),
        on_progress=seen.append,
    )
    assert seen and all(p["budget_s"] == pytest.approx(1.2) for p in seen)
    assert all(p["elapsed_s"] > 0 for p in seen)
