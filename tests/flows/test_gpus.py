"""Each training a worker runs at once gets GPUs of its own (flows/gpus.py): checked with a
made-up device list, as the training process's environment shows it; no GPU needed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows import gpus
from mllm import UserError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker(monkeypatch, tmp_path: Path) -> None:
    """This process as a worker's flow run, on a machine with four (made-up) GPUs."""
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "00000000-0000-0000-0000-000000000000")
    monkeypatch.setenv("MLLM_GPUS", "4,5,6,7")
    monkeypatch.setenv("MLLM_GPU_LOCKS", str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_trainings_side_by_side_each_see_gpus_of_their_own(worker) -> None:
    with gpus.own_devices(1, "auto") as a, gpus.own_devices(2, "cuda") as b:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(b)
        assert a == ["4"] and b == ["5", "6"]
        # A training in another process (the worker's next flow run) sees the one left, in its environment.
        code = (
            "from flows import gpus; import os\n"
            "with gpus.own_devices(1, 'auto'): print(os.environ['CUDA_VISIBLE_DEVICES'])"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=120,
        )
        assert out.stdout.strip() == "7", out.stderr
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # given back as it was
    with gpus.own_devices(1, "auto") as again:
        assert again == ["4"]  # released: the first is free again


def test_a_training_waits_for_a_gpu_when_all_are_taken(worker) -> None:
    got: list[list[str]] = []
    with gpus.own_devices(4, "auto"):
        waiter = threading.Thread(target=lambda: got.append(gpus.own_devices(1, "auto").__enter__()))
        waiter.start()
        time.sleep(1.5)
        assert not got  # still waiting
    waiter.join(10)
    assert got == [["4"]]


@pytest.mark.parametrize("device", ["cpu", "cuda:1", "mps"])
def test_a_training_that_names_its_device_or_runs_outside_a_worker_is_left_alone(worker, device, monkeypatch) -> None:
    with gpus.own_devices(1, device) as held:
        assert held == [] and "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID")
    with gpus.own_devices(1, "auto") as held:
        assert held == []


def test_more_ranks_than_the_worker_has_gpus_is_refused(worker) -> None:
    with pytest.raises(UserError, match="asks for 5 GPUs .train.nproc_per_node.; this worker has 4"):
        with gpus.own_devices(5, "auto"):
            pass
