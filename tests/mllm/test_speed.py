"""Precision by measurement and utilisation (mllm.runtime.speed): what train.dtype resolves to, that a
forced choice is kept and recorded, that bf16 learns what float32 learns, and that MFU is a
fraction of a peak this machine reaches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from textdata import write_char_ids

from mllm.config import CbowConfig, RunConfig
from mllm.families.base import build_model
from mllm.runtime import compiling, speed
from mllm.runtime.checkpoint import read_checkpoint
from mllm.train import train

GPT = {"arch": "gpt", "n_embd": 32, "n_head": 2, "n_layer": 2, "block_size": 32, "dropout": 0.0}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    write_char_ids(d, 3000)
    return d


def config(data_dir: Path, ckpt: Path, **train) -> RunConfig:
    t = {
        "batch_size": 16,
        "window": 32,
        "max_steps": 60,
        "log_interval": 10,
        "eval_interval": 60,
        "eval_batches": 4,
        "optimizer": "adamw",
        "lr": 3e-3,
        "sampling": "random",
        "device": "cpu",
    }
    return RunConfig.model_validate(
        {
            "model": GPT,
            "train": {**t, **train},
            "paths": {
                "train_ids": str(data_dir / "train.npy"),
                "val_ids": str(data_dir / "val.npy"),
                "vocab": str(data_dir / "vocab.json"),
                "checkpoint_dir": str(ckpt),
            },
        }
    )


# Where bf16 is emulated (no AVX512-BF16 or AMX), its 60 steps take 14 s (Zen 3, 2026-12-02):
# the full suite runs it there, `make test-fast` only where the hardware has bf16.
@(pytest.mark.slow if not speed.fast_bf16(speed.cpu_flags()) else lambda test: test)
def test_bf16_and_float32_learn_the_same_within_rounding(data_dir, tmp_path):
    # Forced either way, each run reports the precision it was told and no probe; bf16 rounds
    # (the losses are not equal, so it did run in bf16) yet ends where float32 does: 60 steps
    # take the loss down by more than half a nat, and the two end within 0.15 of each other.
    # On a Xeon with AMX, oneDNN's bf16 kernels end this run up to 0.1 nats from float32 (0.011 to
    # 0.098 at two threads, 0.075 at one, measured 2026-11-29; docs/speed.md, "bf16 on an AMX
    # Xeon"); AVX512-BF16 ends within 0.015. Either way far from a bf16 path that does not learn.
    records = {}
    results = {}
    for dtype in ("float32", "bfloat16"):
        records[dtype] = []
        results[dtype] = train(config(data_dir, tmp_path / dtype, dtype=dtype), on_metrics=records[dtype].extend)
        r = results[dtype]
        assert (r.dtype_used, r.dtype_reason, r.dtype_probe_ms) == (dtype, "forced by train.dtype", None)
        assert read_checkpoint(r.checkpoint, "cpu")["metrics"]["bf16"] == float(dtype == "bfloat16")
    losses = {k: [x["train_loss"] for x in v if "train_loss" in x] for k, v in records.items()}
    assert losses["float32"] != losses["bfloat16"]
    assert losses["float32"][-1] < losses["float32"][0] - 0.5
    assert abs(results["float32"].val_loss - results["bfloat16"].val_loss) < 0.15
    assert abs(losses["float32"][-1] - losses["bfloat16"][-1]) < 0.15


def test_mfu_is_a_fraction_of_the_measured_peak(data_dir, tmp_path):
    records = []
    r = train(config(data_dir, tmp_path, max_steps=20), on_metrics=records.extend)
    per_step = [x["mfu"] for x in records if "train_loss" in x]
    assert len(per_step) == 2 and all(0 < m <= 1 for m in per_step)
    assert 0 < r.mfu <= 1
    # The peak is this CPU's own matrix multiply, in the precision the run used.
    assert r.peak_source.startswith("measured") and r.peak_flops > 1e8
    assert r.attention.startswith("float32: ")  # the attention kernel it measured, recorded
    assert r.mfu == pytest.approx(r.tokens_per_s * 6 * _matmul_weights(r) / r.peak_flops, rel=1e-9)


def _matmul_weights(r) -> float:
    # The GPT's estimate: 6 per weight but the position table, and attention over the window.
    cfg = read_checkpoint(r.checkpoint, "cpu")["config"]["model"]
    model = build_model(RunConfig.model_validate({"model": {**cfg}, "train": {"max_steps": 1, "window": 32}}).model)
    return model.num_params(non_embedding=True) + 2 * GPT["n_layer"] * GPT["n_embd"] * 32


def test_flops_per_target_counts_multiplied_weights_for_every_family():
    lstm = build_model(
        RunConfig.model_validate(
            {
                "model": {"arch": "lstm", "n_embd": 8, "hidden_size": 16, "n_layer": 2, "vocab_size": 40},
                "train": {"max_steps": 1},
            }
        ).model
    )
    looked_up = sum(m.weight.numel() for m in lstm.modules() if isinstance(m, torch.nn.Embedding))
    assert looked_up == 40 * 8
    x = torch.zeros(2, 16, dtype=torch.long)
    assert speed.flops_per_target(lstm, (x, x)) == 6 * (sum(p.numel() for p in lstm.parameters()) - looked_up)

    def cbow(objective: str):
        return build_model(CbowConfig(arch="cbow", n_embd=10, vocab_size=500, objective=objective, n_negative=4))

    # Negative sampling scores 5 words of the 500 a softmax scores.
    assert speed.flops_per_target(cbow("softmax"), ()) == 6 * 10 * 500
    assert speed.flops_per_target(cbow("negative"), ()) == 6 * 10 * 5


def test_auto_is_float32_without_fast_bf16_and_otherwise_probes_once(tmp_path, monkeypatch):
    assert not speed.fast_bf16({"avx2", "avx512f"})
    assert speed.fast_bf16({"avx512f", "avx512_bf16"}) and speed.fast_bf16({"amx_bf16", "amx_tile"})
    monkeypatch.setenv("MLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = build_model(
        RunConfig.model_validate(
            {
                "model": {"arch": "gpt", "n_embd": 256, "n_head": 4, "n_layer": 2, "block_size": 128, "vocab_size": 65},
                "train": {"max_steps": 1, "window": 128},
            }
        ).model
    )
    x = torch.randint(0, 65, (8, 128))
    before = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    first = speed.choose_precision("auto", torch.device("cpu"), model, (x, x))
    # The probe leaves the model, its gradients and the RNG as they were.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and torch.equal(state, torch.get_rng_state())
    if not speed.fast_bf16():
        assert first == speed.Precision("float32", "this CPU has neither AMX nor AVX512-BF16")
        return
    assert set(first.probe_ms) == {"float32", "bfloat16"}
    faster = first.probe_ms["bfloat16"] <= (1 - speed.MARGIN) * first.probe_ms["float32"]
    assert first.dtype == ("bfloat16" if faster else "float32")
    # Cached for this machine and shape: the second run takes the first one's figures (once they
    # count as measured on a quiet machine; a busy one's are measured again when it is quiet).
    cache = tmp_path / "cache" / "speed.json"
    [(key, entry)] = json.loads(cache.read_text()).items()
    assert entry["value"] == first.probe_ms
    cache.write_text(json.dumps({key: {**entry, "busy": False}}))
    assert speed.choose_precision("auto", torch.device("cpu"), model, (x, x)) == first
    assert speed.choose_precision("float32", torch.device("cpu"), model, (x, x)).dtype == "float32"
    # A tiny model (2 layers of 32) is never timed: it stays float32 whatever the load.
    tiny = build_model(
        RunConfig.model_validate({"model": {**GPT, "vocab_size": 65}, "train": {"max_steps": 1, "window": 32}}).model
    )
    small = speed.choose_precision("auto", torch.device("cpu"), tiny, (x[:, :32], x[:, :32]))
    assert small.dtype == "float32" and small.probe_ms is None and "small" in small.reason


def test_a_gpus_peak_comes_from_its_spec_sheet_by_name():
    assert speed.spec_peak("NVIDIA H100 80GB HBM3", "bfloat16") == (989e12, "H100 spec sheet")
    assert speed.spec_peak("NVIDIA H100 PCIe", "bfloat16")[0] == 756e12
    assert speed.spec_peak("NVIDIA A100-SXM4-40GB", "float32") == (19.5e12, "A100 spec sheet")
    assert speed.spec_peak("NVIDIA A100-SXM4-40GB", "float32", tf32=True)[0] == 156e12
    assert speed.spec_peak("NVIDIA L40S", "bfloat16")[0] == 362e12  # not the L4's
    # No bf16 on a V100, and a GPU the table lacks: measured instead.
    assert speed.spec_peak("Tesla V100-SXM2-16GB", "bfloat16") is None
    assert speed.spec_peak("Quadro RTX 4000", "float32") is None


def test_a_gpt_on_a_cpu_attends_with_the_kernel_this_machine_measured_faster(tmp_path, monkeypatch):
    # The choice is timed once per machine and shape, per precision; a seeded cache stands for a
    # machine where either kernel won. Both give the same logits and gradients (float32), and the
    # same loss within bf16's rounding, so the choice changes the speed and nothing a user sees.
    monkeypatch.setenv("MLLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = {"model": {**GPT, "vocab_size": 65}, "train": {"max_steps": 1, "window": 32}}
    model = build_model(RunConfig.model_validate(cfg).model)
    x, y = torch.randint(0, 65, (4, 32)), torch.randint(0, 65, (4, 32))
    said = speed.choose_attention(model, torch.device("cpu"), (x, y))
    dtypes = ["float32"] + (["bfloat16"] if speed.fast_bf16() else [])
    assert [part.split(":")[0] for part in said.split("; ")] == dtypes
    assert set(model.attention_kernels) == {speed.DTYPES[d] for d in dtypes}

    def run(kernel: str, dtype: str):
        for d in dtypes:
            fast = {"matmul": 1.0, "sdpa": 2.0} if kernel == "matmul" else {"matmul": 2.0, "sdpa": 1.0}
            speed._remember(
                ["attention", "causal_attention", d, 4, GPT["n_head"], 32, GPT["n_embd"] // GPT["n_head"]],
                fast,
                busy=False,
            )
        assert ("written out" if kernel == "matmul" else "sdpa") in speed.choose_attention(
            model, torch.device("cpu"), (x, y)
        )
        assert model.attention_kernels[torch.float32] == kernel
        model.zero_grad(set_to_none=True)
        with speed.Precision(dtype, "").autocast(torch.device("cpu"))():
            logits, loss, _ = model(x, y)
        nodes, seen = [loss.grad_fn], {}  # the ops the loss came through: which kernel ran
        while nodes:
            node = nodes.pop()
            if node is not None and id(node) not in seen:
                seen[id(node)] = node.name()
                nodes.extend(f for f, _ in node.next_functions)
        assert any("Baddbmm" in n for n in seen.values()) == (kernel == "matmul")
        loss.backward()
        return logits.float(), loss.item(), [p.grad.clone() for p in model.parameters()]

    written, sdpa = run("matmul", "float32"), run("sdpa", "float32")
    assert torch.allclose(written[0], sdpa[0], atol=1e-5) and written[1] == pytest.approx(sdpa[1], abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(written[2], sdpa[2]))
    if speed.fast_bf16():
        assert run("matmul", "bfloat16")[1] == pytest.approx(run("sdpa", "bfloat16")[1], abs=0.02)
    # Attention written out by the config is not the machine's to choose.
    explicit = build_model(RunConfig.model_validate({**cfg, "model": {**cfg["model"], "attention": "explicit"}}).model)
    assert speed.choose_attention(explicit, torch.device("cpu"), (x, y)) == "" and explicit.attention_kernels == {}


def test_compile_pays_when_the_training_left_wins_back_the_compilation():
    # Before this machine has measured the model: a guessed 1.15x for a 60 s compilation.
    assert not compiling.compile_pays(120, None) and compiling.compile_pays(600, None)
    assert compiling.compile_pays(60, {"gain": 2.0, "compile_s": 20.0})
    assert not compiling.compile_pays(1e9, {"gain": 1.01, "compile_s": 1.0})  # measured no faster: never


def test_compile_auto_leaves_a_short_training_eager_and_says_why(data_dir, tmp_path):
    r = train(config(data_dir, tmp_path, max_steps=30))
    assert not r.compile_used and r.compile_s is None
    assert r.compile_reason.startswith("about ") and "too short to win back a compilation" in r.compile_reason


@pytest.mark.slow
def test_compile_auto_compiles_where_it_measured_a_gain_and_keeps_it_only_if_faster(data_dir, tmp_path):
    # A gain this machine measured before (seeded in the cache) makes even a short training
    # compile after its first eager steps; the compiled steps are then timed for real, the verdict
    # says which was faster, and the cache now holds what was measured here.
    from mllm.families.base import family_of, load_inputs

    cfg = config(data_dir, tmp_path / "ckpt", max_steps=20)
    built, _, _, _, val, _ = load_inputs(cfg)  # the key is of the model and batch the training builds
    model, batch = build_model(built.model), family_of(built).val_batches(built, val)[0]
    speed.choose_attention(model, torch.device("cpu"), batch)  # as the training does, before the key
    key = compiling.compile_key(model, batch, "float32")
    speed._remember(key, {"gain": 10.0, "compile_s": 0.001}, busy=False)
    records = []
    r = train(cfg, on_metrics=records.extend)
    assert r.compile_s is not None and r.compile_s > 0
    if r.compile_used:
        assert "x faster compiled" in r.compile_reason
    else:
        assert r.compile_reason.endswith("back to eager")
    # Inductor's errors were suppressed for the compiled model's calls only, not for the process.
    assert torch._dynamo.config.suppress_errors is False
    measured = compiling.compile_known(key)
    assert measured["gain"] != 10.0 and measured["compile_s"] == pytest.approx(r.compile_s, abs=0.1)
    losses = [x["train_loss"] for x in records if "train_loss" in x]
    assert losses[-1] < losses[0]  # the compiled model trains the same weights on


def test_a_cpu_peak_measured_low_is_measured_again_and_the_highest_figure_kept(monkeypatch):
    # A peak timed while another process had the cores is too low: an hour on, a run times it
    # again, and the cache keeps the higher of the two; a recent figure is used as it is.
    key = ["matmul", "cpu", "float32", 1024]
    timed = []
    real = speed.matmul_flops
    monkeypatch.setattr(speed, "matmul_flops", lambda *a, **k: timed.append(1) or real(*a, **k))

    def cached(flops: float, age_s: float) -> None:
        speed._remember(key, {"flops": flops}, busy=False)
        entries = json.loads(speed.cache_file().read_text())
        entries[speed._digest(key)]["at"] -= age_s
        speed.cache_file().write_text(json.dumps(entries))

    cached(1e6, speed.PEAK_FRESH_S + 1)
    measured, _ = speed.peak_flops(torch.device("cpu"), "float32")
    assert timed == [1] and measured > 1e8 and speed._recall(key)["value"]["flops"] == measured
    cached(1e15, speed.PEAK_FRESH_S + 1)  # higher than this CPU reaches
    assert speed.peak_flops(torch.device("cpu"), "float32")[0] == 1e15 and timed == [1, 1]
    assert speed.peak_flops(torch.device("cpu"), "float32")[0] == 1e15 and timed == [1, 1]  # recent: not timed
