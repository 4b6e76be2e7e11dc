"""The CUDA paths of mllm, on a GPU: bf16 autocast and fused AdamW, torch.compile, the KV cache,
exact resume, and a checkpoint written there for a CPU to read.

Marked `gpu` and skipped where torch sees no CUDA device (CI, this project's CPU machines). Only
mllm and torch are imported, so the module runs on a GPU machine without the pipeline installed:

    python -m pytest -m gpu tests/mllm/test_gpu.py --noconftest

(benchmarks/gpu.py does, as its first step). The last test reads the checkpoint it wrote there in
a process that sees no GPU, as a CPU machine would.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# cuBLAS picks a reduction order per workspace; a fixed workspace makes its float32 products
# repeat bit for bit (read once, when the first handle is made: before any CUDA work).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from textdata import write_char_ids

from mllm.config import RunConfig
from mllm.data.vocab import Vocab
from mllm.lm.generate import generate
from mllm.runtime.checkpoint import load_checkpoint
from mllm.runtime.optim import Muon, build_optimizer
from mllm.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: these tests need a GPU"),
]

GPT = {"arch": "gpt", "n_embd": 64, "n_head": 4, "n_layer": 2, "block_size": 64, "dropout": 0.0, "bias": False}
# The default recipe's pieces (rotary, ReLU², Muon beside AdamW), at a size whose checkpoint is small.
DEFAULT_PIECES = {**GPT, "n_embd": 48, "positions": "rotary", "mlp": "relu2"}
PROMPT = "The prince "


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gpu-data")
    write_char_ids(d, 30000)
    return d


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 as float32: no TF32 in matrix products or convolutions inside a test."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def config(data_dir: Path, ckpt: Path, model=GPT, **train_fields) -> RunConfig:
    t = {
        "batch_size": 32,
        "window": 64,
        "max_steps": 200,
        "log_interval": 1,
        "eval_interval": 100,
        "eval_batches": 8,
        "checkpoint_interval": 100,
        "optimizer": "adamw",
        "lr": 3e-3,
        "min_lr": 3e-4,
        "lr_schedule": "cosine",
        "warmup_steps": 20,
        "grad_clip": 1.0,
        "device": "cuda",
        "compile": False,
        "dtype": "float32",
        "checkpoint_minutes": None,
    }
    t.update(train_fields)
    return RunConfig.model_validate(
        {
            "model": model,
            "train": t,
            "paths": {
                "train_ids": str(data_dir / "train.npy"),
                "val_ids": str(data_dir / "val.npy"),
                "vocab": str(data_dir / "vocab.json"),
                "checkpoint_dir": str(ckpt),
            },
        }
    )


def losses(records: list[dict]) -> list[float]:
    return [r["train_loss"] for r in records if "train_loss" in r]


def test_bf16_autocast_and_fused_adamw_follow_float32(data_dir, tmp_path):
    runs = {}
    for dtype in ("float32", "bfloat16", "auto"):
        records: list[dict] = []
        runs[dtype] = (train(config(data_dir, tmp_path / dtype, dtype=dtype), on_metrics=records.extend), records)
    f32, bf16 = runs["float32"][0], runs["bfloat16"][0]
    assert (f32.dtype_used, bf16.dtype_used) == ("float32", "bfloat16")
    assert runs["auto"][0].dtype_used == "bfloat16" and runs["auto"][0].dtype_reason == "CUDA"
    for _, records in runs.values():
        assert all(math.isfinite(x) for x in losses(records)) and len(losses(records)) == 200
    # Learned well past a uniform guess, and bf16 within 3% of float32's validation loss.
    assert f32.val_loss < 0.5 * math.log(len(Vocab.load(str(data_dir / "vocab.json"))))
    assert abs(bf16.val_loss - f32.val_loss) < 0.03 * f32.val_loss, (bf16.val_loss, f32.val_loss)
    assert f32.peak_source and f32.mfu is not None and 0 < bf16.mfu < 1
    model = torch.nn.Linear(4, 4).cuda()
    opt = build_optimizer(model, config(data_dir, tmp_path).train, torch.device("cuda"))
    assert opt.defaults["fused"] is True


def test_compiled_steps_equal_eager_steps(data_dir, tmp_path):
    got = {}
    for compiled in (False, True):
        records: list[dict] = []
        result = train(
            config(data_dir, tmp_path / str(compiled), max_steps=40, compile=compiled), on_metrics=records.extend
        )
        assert result.compile_used is compiled
        got[compiled] = losses(records)
    # Inductor fuses and reorders float32 arithmetic: the same steps, within rounding.
    diffs = [abs(a - b) for a, b in zip(got[False], got[True])]
    assert len(diffs) == 40 and max(diffs) < 5e-3, diffs


@pytest.mark.parametrize("pieces", [GPT, DEFAULT_PIECES], ids=["nanogpt", "default-recipe"])
def test_cached_greedy_decoding_equals_recomputation(pieces):
    from mllm.config import model_config
    from mllm.families.base import build_model

    torch.manual_seed(0)
    model = build_model(model_config(**{**pieces, "vocab_size": 40})).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():  # off the small init, where any computation would agree
            p.add_(0.3 * torch.randn_like(p))
    prompt = [1, 2, 3, 4, 5]
    cached = generate(model, prompt, 50, use_cache=True)
    assert len(cached) == 50 and len(set(cached)) > 3
    assert cached == generate(model, prompt, 50, use_cache=False)
    assert generate(model, prompt, 50, method="top-p", top_p=0.9, seed=3) == generate(
        model, prompt, 50, method="top-p", top_p=0.9, seed=3, use_cache=False
    )


def test_muon_stacked_by_shape_follows_torchs_muon():
    # shakespeare-gpt's four matrix shapes, two of each: mllm's Muon orthogonalises each shape's
    # matrices as one batched bf16 iteration, torch's one matrix at a time.
    torch.manual_seed(0)
    start = [torch.randn(s, device="cuda") for s in ((1152, 384), (384, 384), (1536, 384), (384, 1536)) * 2]

    def steps(make):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt, grads = make(params), torch.Generator(device="cuda").manual_seed(1)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads, device="cuda")
            opt.step()
        return params

    kw = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95}
    theirs, ours = steps(lambda ps: torch.optim.Muon(ps, **kw)), steps(lambda ps: Muon(ps, **kw))
    for a, b, w in zip(theirs, ours, start):
        moved = (a - w).norm()
        assert moved > 1e-3 * w.norm()  # five steps of lr 0.02 moved the weights (by about 0.3%)
        # bf16 products in another kernel round differently: the moves agree to a few percent
        assert (a - b).norm() < 0.05 * moved, ((a - b).norm() / moved).item()


def test_resume_after_a_crash_on_the_gpu_reaches_the_same_weights(data_dir, tmp_path):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # bf16 autocast (the CUDA default), dropout, accumulation, clipping: the state a GPU run holds.
        kw = dict(max_steps=30, dtype="auto", grad_accum=2, eval_interval=10, checkpoint_interval=10)
        model = {**GPT, "dropout": 0.1}
        straight = train(config(data_dir, tmp_path / "a", model, **kw))

        class Crash(Exception):
            pass

        def crash_at_20(progress):
            if progress["step"] == 20:
                raise Crash

        cfg = config(data_dir, tmp_path / "b", model, **kw)
        with pytest.raises(Crash):
            train(cfg, on_progress=crash_at_20)
        resumed = train(cfg)
    finally:
        torch.use_deterministic_algorithms(False)
    assert resumed.resumed_from_step == 20 and resumed.steps == straight.steps == 30
    a = torch.load(straight.checkpoint, weights_only=True, map_location="cpu")["model"]
    b = torch.load(resumed.checkpoint, weights_only=True, map_location="cpu")["model"]
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst == 0.0, f"resumed weights differ by up to {worst:.3g}"
    assert resumed.val_loss == straight.val_loss


def test_a_checkpoint_written_on_the_gpu_loads_and_samples(data_dir, tmp_path):
    result = train(
        config(
            data_dir,
            tmp_path / "ck",
            DEFAULT_PIECES,
            max_steps=300,
            optimizer="muon",
            muon_lr=0.01,
            lr=2e-3,
            dtype="auto",
            checkpoint_interval=300,
        )
    )
    raw = torch.load(result.checkpoint, weights_only=True)  # where its tensors were: the GPU
    assert next(iter(raw["model"].values())).device.type == "cuda"
    loaded = load_checkpoint(result.checkpoint, device="cuda")
    ids = loaded.vocab.encode(loaded.tokenizer.split(PROMPT))
    with torch.no_grad():
        logits, _, _ = loaded.model(torch.tensor([ids], device="cuda"))
    greedy = generate(loaded.model, ids, 60, dtype="float32")
    text = loaded.tokenizer.detokenize(loaded.tokenizer.split(PROMPT) + loaded.vocab.decode(greedy))
    assert result.val_loss < 2.0 and text.startswith(PROMPT) and len(text) > len(PROMPT) + 40
    # Read where no GPU is visible (a CPU machine's view): the same weights, the same float32
    # arithmetic in another order, the same greedy continuation.
    there = subprocess.run(
        [sys.executable, "-c", ON_A_CPU, str(result.checkpoint), json.dumps(ids)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert there.returncode == 0, there.stderr[-3000:]
    cpu = json.loads(there.stdout.splitlines()[-1])
    assert cpu["cuda"] is False and cpu["step"] == result.steps and cpu["device"] == "cpu"
    torch.testing.assert_close(torch.tensor(cpu["last_logits"]), logits[0, -1].float().cpu(), atol=1e-3, rtol=1e-4)
    assert cpu["greedy_ids"] == greedy


ON_A_CPU = """
import json, sys
import torch
from mllm.lm.generate import generate
from mllm.runtime.checkpoint import load_checkpoint
loaded = load_checkpoint(sys.argv[1], device="cpu")
ids = json.loads(sys.argv[2])
with torch.no_grad():
    logits, _, _ = loaded.model(torch.tensor([ids]))
print(json.dumps({"cuda": torch.cuda.is_available(), "step": loaded.step,
                  "device": next(loaded.model.parameters()).device.type, "last_logits": logits[0, -1].tolist(),
                  "greedy_ids": generate(loaded.model, ids, 60, dtype="float32")}))
"""
