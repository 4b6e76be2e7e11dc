"""Faults around a training: how the champion is judged, checkpoints by time and on SIGTERM, a
tracking server that dies mid-training, a full disk, storage roots that share a tracking store,
checkpoints from another version of mllm. Each through the real CLI and real servers."""

from __future__ import annotations

import bz2
import os
import sys
from pathlib import Path

from test_faults import _one_line_error, cli, own_stores  # noqa: F401 (a fixture)


def test_the_same_model_trained_twice_from_two_copies_of_its_text_keeps_the_champion(corpus, own_stores, tmp_path):
    from mlflow.tracking import MlflowClient

    env, *_ = own_stores
    packed = tmp_path / "corpus.txt.bz2"
    packed.write_bytes(bz2.compress(corpus.read_bytes()))
    args = ("run", "--recipe", "smoke", "--set", "train.max_steps=30")
    first = cli(*args, "--source", str(corpus), env=env)
    assert first.returncode == 0 and "promoted to champion: no champion yet" in first.stdout, first.stderr[-3000:]
    # Another corpus digest, so another split: the champion is rescored on this one, as the
    # challenger was scored. The weights are the same, so the scores are, and a tie keeps it.
    second = cli(*args, "--source", str(packed), env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "model: smoke v2 (champion kept: val_bits_per_byte" in second.stdout, second.stdout
    assert "ties (within 0.01%)" in second.stdout and "both on this run's validation split" in second.stdout
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert str(client.get_model_version_by_alias("smoke", "champion").version) == "1"
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id], order_by=["start_time"])
    assert [r.data.tags["decision"] for r in runs] == ["promoted", "kept"]
