"""A checkpoint written on a GPU, read on a CPU: tests/data/gpu/ holds what tests/test_gpu.py left on
an NVIDIA H200 (benchmarks/gpu.py, 2026-11-27; torch 2.11, CUDA 13): a small GPT with the default
recipe's pieces (rotary, ReLU², Muon beside AdamW) trained 300 steps in bf16 autocast, its
tensors saved where they were, on the GPU, and what the GPU computed from it in float32 (no TF32):
the logits after a prompt and a greedy continuation of 60 characters."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mllm.lm.generate import generate
from mllm.runtime.checkpoint import load_checkpoint

GPU = Path(__file__).parent / "data" / "gpu"


def test_a_checkpoint_a_gpu_wrote_loads_on_a_cpu_and_decodes_as_the_gpu_did():
    there = json.loads((GPU / "computed.json").read_text())
    assert there["device"].startswith("NVIDIA") and there["dtype_used"] == "bfloat16"
    loaded = load_checkpoint(str(GPU / "written-on-a-gpu.pt"), device="cpu")
    assert loaded.step == there["steps"] and next(loaded.model.parameters()).device.type == "cpu"
    assert loaded.config.train.device == "cuda" and loaded.config.train.optimizer == "muon"
    ids = loaded.vocab.encode(loaded.tokenizer.split(there["prompt"]))
    assert ids == there["prompt_ids"]
    with torch.no_grad():
        logits, _, _ = loaded.model(torch.tensor([ids]))
    # The same float32 arithmetic in another order (CUDA kernels against a CPU's).
    torch.testing.assert_close(logits[0, -1], torch.tensor(there["last_logits"]), atol=1e-3, rtol=1e-4)
    assert generate(loaded.model, ids, 60, dtype="float32") == there["greedy_ids"]
