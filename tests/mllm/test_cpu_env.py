"""The variables that change what the CPU computes with (issue 64, item 3): Muon's Newton-Schulz
precision follows what is measured under them, the speed cache keys them, and so does a training's
key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mllm import layout
from mllm.config import RunConfig
from mllm.runtime import machine

REPO = Path(__file__).resolve().parents[2]
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

# Muon's choice for a GPT of the default recipe's shape, one thread, as JSON: the dtype, the reason,
# and the speed cache's entries.
SCRIPT = """
import json, torch
torch.set_num_threads(1)
from mllm.config import TrainConfig, model_config
from mllm.families.base import build_model
from mllm.runtime import optim, speed
model = build_model(model_config(arch="gpt", n_embd=128, n_head=4, n_layer=1, block_size=32, vocab_size=40))
opt = optim.build_optimizer(model, TrainConfig(max_steps=1, optimizer="muon"), torch.device("cpu"))
print(json.dumps({"dtype": str(opt.parts["muon"].ns_dtype), "why": opt.parts["muon"].ns_reason,
                  "entries": len(speed._read(speed.cache_file()))}))
"""


def _muon(tmp_path: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in machine.CPU_ENV}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, "MLLM_CACHE_DIR": str(tmp_path), **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not machine.fast_bf16(), reason="this CPU has no bf16 hardware: Muon takes float32 unprobed")
@pytest.mark.slow
def test_muon_follows_the_measured_speed_under_the_avx2_variables(tmp_path):
    plain = _muon(tmp_path)
    limited = _muon(tmp_path, **AVX2)
    # The probe measured again under the variables (a cache entry of its own, not the plain one)
    # and found bf16 emulated: float32, the figures saying why.
    assert limited["entries"] == plain["entries"] + 1
    assert limited["dtype"] == "torch.float32", limited
    assert limited["why"].startswith("float32: bf16 probed no faster (an iteration: bfloat16 "), limited
    ms = {
        k: float(v.split()[0])
        for k, v in (p.split(" ", 1) for p in limited["why"][:-1].split("(an iteration: ")[1].split(", "))
    }
    assert ms["bfloat16"] > ms["float32"], limited
    # Without them, the choice follows what was measured there too (bf16 only where it won).
    assert plain["why"].startswith(
        "bfloat16: bf16 probed faster" if plain["dtype"] == "torch.bfloat16" else "float32: bf16 probed no faster"
    ), plain


def test_the_variables_are_part_of_a_trainings_key(monkeypatch):
    cfg = RunConfig.model_validate({"model": {"arch": "gpt"}, "train": {"max_steps": 1}})
    for name in machine.CPU_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = layout.train_key("splits", "vocab", cfg, "code", machine.cpu_env())
    # Without the variables the key is what it was before they entered it: no training is repeated.
    from mllm import storage

    assert plain == storage.digest(["train", "splits", "vocab", cfg.model.model_dump(), cfg.train.model_dump(), "code"])
    for name, value in AVX2.items():
        monkeypatch.setenv(name, value)
    assert machine.cpu_env() == AVX2
    limited = layout.train_key("splits", "vocab", cfg, "code", machine.cpu_env())
    assert limited != plain
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert layout.train_key("splits", "vocab", cfg, "code", machine.cpu_env()) not in (plain, limited)
