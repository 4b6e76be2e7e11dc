"""train.optimizer muon: which parameters Muon takes, that it learns, and exact resume with its
state from a checkpoint (loaded with weights_only=True, as every checkpoint is)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from textdata import write_char_ids

from mllm import UserError
from mllm.config import RunConfig, TrainConfig, model_config
from mllm.families.base import build_model
from mllm.runtime import optim
from mllm.runtime.optim import Combined, Muon, build_optimizer, muon_split, newton_schulz_dtype
from mllm.train import train

REPO = Path(__file__).resolve().parents[2]
GPT = {"arch": "gpt", "n_embd": 16, "n_head": 2, "n_layer": 2, "block_size": 16, "dropout": 0.0}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("tie", [True, False])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(tie):
    model = build_model(model_config(**GPT, vocab_size=11, tie_weights=tie, bias=True))
    hidden, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in hidden) == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    others = {names[id(p)] for p in rest}
    assert {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.h.0.ln_1.bias",
        "transformer.h.1.mlp.c_fc.bias",
    } <= others
    assert ("lm_head.weight" in others) != tie  # tied: the one tensor is wte's, listed once
    assert len(hidden) + len(rest) == len(list(model.parameters()))

    opt = build_optimizer(
        model, TrainConfig(max_steps=1, optimizer="muon", lr=1e-3, muon_lr=0.05, weight_decay=0.1), torch.device("cpu")
    )
    assert isinstance(opt, Combined) and isinstance(opt.parts["muon"], torch.optim.Muon)
    assert [len(g["params"]) for g in opt.parts["muon"].param_groups] == [8]
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[1]["lr"] == 1e-3
    # AdamW decays the embeddings (and an untied head), never the norms and biases.
    decayed, free = opt.parts["adamw"].param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert free["weight_decay"] == 0.0 and all(p.dim() == 1 for p in free["params"])
    # One scheduler sets every part's rate, each from its own peak.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert sched.get_last_lr()[:2] == [0.025, 5e-4]
    assert opt.parts["muon"].param_groups[0]["lr"] == 0.025


def test_muon_orthogonalises_in_float32_where_bf16_is_emulated_and_is_torchs_muon_in_bf16(monkeypatch, tmp_path):
    # Tall, wide and square matrices: Muon transposes the tall ones and scales their rate, and
    # orthogonalises the matrices of one shape as one stack.
    start = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(16, 16), torch.randn(48, 16), torch.randn(16, 16)]

    def steps(make):
        params = [nn.Parameter(w.clone()) for w in start]
        opt = make(params)
        grads = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            opt.step()
        return params, opt

    kw = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95}
    theirs, _ = steps(lambda ps: torch.optim.Muon(ps, **kw))
    ours, opt = steps(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
    wide, _ = steps(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    assert all(not torch.equal(a, b) and torch.allclose(a, b, atol=2e-3) for a, b in zip(theirs, wide))
    # The same state as torch's: a checkpoint of either loads into the other.
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}

    monkeypatch.setattr(optim, "fast_bf16", lambda: False)
    assert newton_schulz_dtype(torch.device("cpu"))[0] == torch.float32
    assert "neither AMX nor AVX512-BF16" in newton_schulz_dtype(torch.device("cpu"))[1]
    model = build_model(model_config(**GPT, vocab_size=11))
    built = build_optimizer(model, TrainConfig(max_steps=1, optimizer="muon"), torch.device("cpu"))
    assert built.parts["muon"].ns_dtype == torch.float32
    # With bf16 hardware in /proc/cpuinfo, what the probe measured decides (tests/mllm/test_cpu_env.py
    # measures it under variables that make this CPU emulate bf16).
    monkeypatch.setattr(optim, "fast_bf16", lambda: True)
    monkeypatch.setenv("MLLM_CACHE_DIR", str(tmp_path))
    for bf16_ms, chosen in ((1.0, torch.bfloat16), (2.0, torch.float32)):
        monkeypatch.setattr(optim, "_newton_schulz_probe", lambda shapes, ms=bf16_ms: {"float32": 2.0, "bfloat16": ms})
        dtype, why = newton_schulz_dtype(torch.device("cpu"), [(int(bf16_ms), 16)])  # a cache entry each
        assert dtype == chosen and f"bfloat16 {bf16_ms:.1f} ms, float32 2.0 ms" in why
    assert newton_schulz_dtype(torch.device("cuda"))[0] == torch.bfloat16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    write_char_ids(d, 1200)
    return d


def make_config(data_dir: Path, ckpt: Path, **train) -> RunConfig:
    t = {
        "batch_size": 8,
        "window": 16,
        "max_steps": 8,
        "log_interval": 2,
        "eval_interval": 3,
        "eval_batches": 2,
        "checkpoint_interval": 4,
        "optimizer": "muon",
        "lr": 3e-3,
        "muon_lr": 0.02,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "grad_clip": 0.5,
        "muon_weight_decay": 0.01,
    }
    t.update(train)
    return RunConfig.model_validate(
        {
            "model": {**GPT, "dropout": 0.2},
            "train": t,
            "paths": {
                "train_ids": str(data_dir / "train.npy"),
                "val_ids": str(data_dir / "val.npy"),
                "vocab": str(data_dir / "vocab.json"),
                "checkpoint_dir": str(ckpt),
            },
        }
    )


def test_resume_with_muon_state_reaches_the_same_weights(data_dir, tmp_path):
    straight = train(make_config(data_dir, tmp_path / "a"))

    class Crash(Exception):
        pass

    def crash_at_4(progress):
        if progress["step"] == 4:
            raise Crash

    cfg = make_config(data_dir, tmp_path / "b")
    with pytest.raises(Crash):
        train(cfg, on_progress=crash_at_4)
    saved = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    assert saved["step"] == 4 and set(saved["optimizer"]["parts"]) == {"muon", "adamw"}
    assert all("momentum_buffer" in s for s in saved["optimizer"]["parts"]["muon"]["state"].values())
    resumed = train(cfg)
    assert resumed.resumed_from_step == 4 and resumed.steps == straight.steps == 8
    a = torch.load(straight.checkpoint, weights_only=True)
    b = torch.load(resumed.checkpoint, weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    muon_a, muon_b = a["optimizer"]["parts"]["muon"]["state"], b["optimizer"]["parts"]["muon"]["state"]
    assert all(torch.equal(muon_a[i]["momentum_buffer"], muon_b[i]["momentum_buffer"]) for i in muon_a)
    assert resumed.val_loss == straight.val_loss


def test_an_adamw_checkpoint_does_not_resume_under_muon(data_dir, tmp_path):
    train(make_config(data_dir, tmp_path, optimizer="adamw", max_steps=2))
    with pytest.raises(UserError, match="trained with train.optimizer adamw, this config muon"):
        train(make_config(data_dir, tmp_path, max_steps=4))


def test_muon_learns(data_dir, tmp_path):
    result = train(make_config(data_dir, tmp_path, max_steps=30, eval_interval=30, muon_lr=0.05))
    first = train(make_config(data_dir, tmp_path / "one", max_steps=1, eval_interval=1))
    assert result.val_loss < first.val_loss - 0.3, (first.val_loss, result.val_loss)
    muon_shapes = [tuple(p.shape) for p in muon_split(build_model(model_config(**GPT, vocab_size=11)))[0]]
    # (The figures may be measured again between the two: a busy machine's are, at a quiet moment.)
    assert result.muon_precision.split(":")[0] == str(newton_schulz_dtype(torch.device("cpu"), muon_shapes)[0])[6:]


@pytest.mark.slow
def test_ddp_on_two_cpu_ranks_resumes_exactly_with_muon(data_dir, tmp_path):
    from test_train import DDP_SCRIPT  # the script of the AdamW test: straight, stopped, resumed

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    # A constant rate: the script's stopped run is a 3-step training of its own, whose schedule
    # would end where the 6-step one is halfway.
    cfg = make_config(
        data_dir,
        tmp_path,
        sampling="epoch",
        grad_accum=2,
        eval_interval=2,
        checkpoint_interval=3,
        lr_schedule="constant",
        warmup_steps=0,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            cfg.model_dump_json(),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks 2 resumed_from 3 same True" in out.stdout
