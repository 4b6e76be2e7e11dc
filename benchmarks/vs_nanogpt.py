"""mllm against nanoGPT, side by side in one run: training tokens/s and generation tokens/s.

    python -m benchmarks.vs_nanogpt [--quick] [--threads N] [--only train|generate] [--shapes ...] [--variants ...]

The anchor is karpathy/nanoGPT as kept in ../shared/anchors/nanoGPT (see its README); without it
this benchmark says so and exits 0. On a shared machine an absolute speed means little, so every
figure here is a ratio of two measurements taken in the same run, alternating the contenders
(A B A B ...) at the same torch thread count, with the load average next to it.

Training: War and Peace with the reference char normalisation, 90/10, dropout 0, at two shapes:
nanoGPT's CPU size (GPT 4 layers, 4 heads, 128 wide, block 64, batch 12; anchors README) and the
shakespeare-gpt recipe's network (6/6/384, block 256) at batch 16. nanoGPT runs as a subprocess of
its own train.py on the same ids written as it expects them (data/<dataset>/train.bin, val.bin as
uint16 and meta.pkl), in float32 (its CPU path has no autocast); mllm as a subprocess of `python -m
mllm.train` with its default precision (`train.dtype: auto`, which the precision column shows) and
any --variants. Both print one line per step; the figure is the median step time after a warm-up
(first steps, and for train.compile the compilation). MFU is tokens/s times nanoGPT's FLOPs per
token over this CPU's measured matrix-multiply peak in the precision used (mllm.runtime.speed), at the
same thread count. The last column compares the mean training loss of the last steps (50 at
most), which should agree within seed noise (the two do not draw the same batches).

Generation: `generate` of nanoGPT's model.py (imported by path, here only), which recomputes the
whole context per token, against `mllm.lm.generate.generate` with its KV cache: 500 new tokens after
a 4-token prompt, top-k 200, temperature 0.8, random weights (the same weights in both), at
4/4/128 block 64 and 6/6/384 block 256.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    corpus,
    header,
    load,
    median,
    parse_args,
    run_config,
    save,
    table,
    threads,
    token_ids,
)
from benchmarks.nanogpt import anchor_or_exit, model_module, nanogpt_data, run_mllm_train, train_nanogpt

# name: (shape, steps, quick steps, warm-up steps)
TRAIN_SHAPES = {
    "nanogpt-cpu": (dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12), 300, 120, 20),
    "shakespeare-gpt": (dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=16), 40, 25, 5),
}
GENERATE_SHAPES = {
    "4/4/128 block 64": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "6/6/384 block 256": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
}


def train_mllm(
    paths: dict, folder: Path, shape: dict, steps: int, threads: int, extra: dict
) -> tuple[list[float], list[float], str]:
    """Per-step seconds and losses of `python -m mllm.train` at the same shape and schedule, and
    the precision it trained in."""
    n = len(list(folder.glob("mllm-*")))
    cfg = run_config(
        None,
        paths,
        folder / f"mllm-{n}",
        {
            "model.arch": "gpt",
            "model.n_layer": shape["n_layer"],
            "model.n_head": shape["n_head"],
            "model.n_embd": shape["n_embd"],
            "model.block_size": shape["block_size"],
            "model.dropout": 0.0,
            "model.bias": False,
            "train.batch_size": shape["batch_size"],
            "train.window": shape["block_size"],
            "train.sampling": "random",
            "train.optimizer": "adamw",
            "train.lr": 1e-3,
            "train.min_lr": 1e-4,
            "train.lr_schedule": "cosine",
            "train.warmup_steps": 100,
            "train.weight_decay": 0.1,
            "train.beta2": 0.99,
            "train.grad_clip": 1.0,
            "train.max_steps": steps,
            "train.log_interval": 1,
            "train.eval_interval": 10 * steps,
            "train.checkpoint_interval": 10 * steps,
            "train.eval_batches": 2,
            "train.device": "cpu",
            **extra,
        },
    )
    stdout = run_mllm_train(cfg, folder / f"mllm-{n}.yaml", threads)
    rows = re.findall(r"^step (\d+): loss ([\d.]+), .*?, ([\d,]+) tok/s", stdout, re.M)
    tokens = shape["batch_size"] * shape["block_size"]
    precision = re.search(
        r"^done: .*, (float32|bfloat16)(?:, compiled)?, (?:\d+ threads, )?[\d.]+s;", stdout, re.M
    ).group(1)
    return [tokens / float(r.replace(",", "")) for _, _, r in rows], [float(loss) for _, loss, _ in rows], precision


# Options of mllm's trainer measured as contenders of their own (--variants).
VARIANTS = {
    "float32": {"train.dtype": "float32"},
    "bf16": {"train.dtype": "bfloat16"},
    "compile": {"train.compile": True},
    "compile+bf16": {"train.compile": True, "train.dtype": "bfloat16"},
}


def bench_train(
    paths: dict,
    folder: Path,
    threads_list: list[int],
    shapes: list[str],
    quick: bool,
    steps: int | None,
    repeats: int,
    variants: list[str],
) -> list[dict]:
    workdir = nanogpt_data(paths, folder / "nanogpt")
    rows = []
    for shape_name in shapes:
        shape, full, short, warmup = TRAIN_SHAPES[shape_name]
        n_steps = steps or (short if quick else full)
        contenders = {
            "nanoGPT": lambda n: train_nanogpt(workdir, shape, n_steps, n),
            "mllm": lambda n: train_mllm(paths, folder, shape, n_steps, n, {}),
        }
        for v in variants:
            contenders[f"mllm {v}"] = lambda n, v=v: train_mllm(paths, folder, shape, n_steps, n, VARIANTS[v])
        for n_threads in threads_list:
            rows += _train_rounds(shape_name, shape, contenders, n_threads, warmup, repeats)
    return rows


def _train_rounds(
    shape_name: str, shape: dict, contenders: dict, n_threads: int, warmup: int, repeats: int
) -> list[dict]:
    tokens = shape["batch_size"] * shape["block_size"]
    shape_name = (
        f"{shape_name} ({shape['n_layer']}/{shape['n_head']}/{shape['n_embd']}, block "
        f"{shape['block_size']}, batch {shape['batch_size']})"
    )
    got = {name: {"step_s": [], "loss": [], "first_s": [], "load": [], "precision": set()} for name in contenders}
    for rep in range(repeats):
        for name, run in contenders.items():  # A B A B: a burst of load hits both
            step_s, losses, precision = run(n_threads)
            g = got[name]
            g["step_s"].append(median(step_s[warmup:]))
            g["first_s"].append(sum(step_s[:warmup]))
            g["loss"].append(float(np.mean(losses[-50:])))
            g["load"].append(load())
            g["precision"].add(precision)
            print(
                f"  train {shape_name}, {n_threads} threads, {name} ({precision}, run {rep + 1}): "
                f"{tokens / g['step_s'][-1]:,.0f} tokens/s, loss (last steps) {g['loss'][-1]:.3f}, "
                f"load {g['load'][-1]}",
                flush=True,
            )
    rows = []
    for name, g in got.items():
        s = median(g["step_s"])
        # Ratio within each round, then the median: the load drifts between rounds far more
        # than within one, so pooling the rounds first would mix loads into the ratio.
        ratios = [a / b for a, b in zip(got["nanoGPT"]["step_s"], g["step_s"])]
        precision = "/".join(sorted(g["precision"]))
        rows.append(
            {
                "what": f"train {shape_name}",
                "contender": name,
                "threads": n_threads,
                "precision": precision,
                "s_per_step": s,
                "tokens_per_s": tokens / s,
                "mfu": _mfu(shape, tokens / s, precision, n_threads),
                "ratio": median(ratios),
                "ratios": ratios,
                "warmup_s": median(g["first_s"]),
                "loss_last50": median(g["loss"]),
                "load": max(g["load"]),
            }
        )
    return rows


def _mfu(shape: dict, tokens_per_s: float, precision: str, n_threads: int) -> float | None:
    """nanoGPT's FLOPs per token at `shape` times tokens/s, over this CPU's measured peak."""
    from mllm.config import GPTConfig
    from mllm.families.base import build_model
    from mllm.runtime import speed

    if "/" in precision:
        return None  # the rounds trained in different precisions
    model = build_model(
        GPTConfig(vocab_size=80, dropout=0.0, bias=False, **{k: v for k, v in shape.items() if k != "batch_size"})
    )
    with threads(n_threads):
        peak, _ = speed.peak_flops(torch.device("cpu"), precision)
    return tokens_per_s * model.flops_per_token(shape["block_size"]) / peak


def bench_generate(
    vocab_size: int, prompt: list[int], threads_list: list[int], new_tokens: int, repeats: int
) -> list[dict]:
    from mllm.config import GPTConfig
    from mllm.families.base import build_model
    from mllm.lm.decode import decode_precision
    from mllm.lm.generate import generate

    nano = model_module()
    rows = []
    for shape_name, shape in GENERATE_SHAPES.items():
        torch.manual_seed(1337)
        ours = build_model(GPTConfig(vocab_size=vocab_size, dropout=0.0, bias=False, **shape)).eval()
        theirs = nano.GPT(nano.GPTConfig(vocab_size=vocab_size, dropout=0.0, bias=False, **shape)).eval()
        # The same weights, so both run the same arithmetic; nanoGPT's causal-mask buffer (only
        # present without SDPA) is its own.
        missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
        assert not unexpected and all(k.endswith("attn.bias") for k in missing), (missing, unexpected)
        idx = torch.tensor([prompt])

        def run_theirs():
            torch.manual_seed(1)
            theirs.generate(idx, new_tokens, temperature=0.8, top_k=200)

        def run_ours():
            generate(ours, prompt, new_tokens, method="top-k", temperature=0.8, top_k=200, seed=1)

        for n_threads in threads_list:
            with threads(n_threads):
                generate(ours, prompt, 16, method="top-k", temperature=0.8, top_k=200, seed=1)  # warm-up
                theirs.generate(idx, 16, temperature=0.8, top_k=200)
                times = {"nanoGPT": [], "mllm": []}
                loads = []
                for _ in range(repeats):
                    for name, fn in (("nanoGPT", run_theirs), ("mllm", run_ours)):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
                        loads.append(load())
            with threads(1):  # what generate decoded in: the cached path runs on one thread
                precision = decode_precision(ours).dtype
            base = median(times["nanoGPT"])
            ratio = median([a / b for a, b in zip(times["nanoGPT"], times["mllm"])])  # per round, as in training
            for name, ts in times.items():
                rows.append(
                    {
                        "what": f"generate {shape_name}",
                        "contender": name,
                        "threads": n_threads,
                        "precision": "float32" if name == "nanoGPT" else precision,
                        "tokens_per_s": new_tokens / median(ts),
                        "ratio": 1.0 if name == "nanoGPT" else ratio,
                        "load": max(loads),
                    }
                )
            print(
                f"  generate {shape_name}, {n_threads} threads: nanoGPT {new_tokens / base:,.0f} tokens/s, "
                f"mllm {new_tokens / median(times['mllm']):,.0f} in {precision} ({ratio:.1f}x), load {max(loads)}",
                flush=True,
            )
    return rows


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--only", choices=("train", "generate")),
            p.add_argument(
                "--variants",
                nargs="*",
                default=[],
                choices=list(VARIANTS),
                help="also train mllm with these options (float32/bf16: train.dtype forced, "
                "compile: train.compile=true)",
            ),
            p.add_argument(
                "--shapes",
                nargs="*",
                default=list(TRAIN_SHAPES),
                choices=list(TRAIN_SHAPES),
                metavar="SHAPE",
                help=f"training shapes (default all: {', '.join(TRAIN_SHAPES)})",
            ),
            p.add_argument(
                "--steps",
                type=int,
                help="training steps per run (default 300 for nanogpt-cpu, 40 for shakespeare-gpt; quick 120 and 25)",
            ),
            p.add_argument("--repeats", type=int, help="runs of each contender (default 2, quick 1)"),
        ),
    )
    m = header("vs_nanogpt", args.quick)
    anchor_or_exit()
    wp = corpus("warandpeace")
    q = args.quick
    threads_list = [args.threads] if args.threads else sorted({torch.get_num_threads(), 1}, reverse=True)
    repeats = args.repeats or (1 if q else 2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mllm-bench-nanogpt-") as tmp:
        folder = Path(tmp)
        paths = token_ids(wp, folder / "wp")
        if args.only in (None, "train"):
            rows += bench_train(paths, folder, threads_list, args.shapes, q, args.steps, repeats, args.variants)
        if args.only in (None, "generate"):
            ids = np.load(paths["train_ids"])
            prompt = [int(i) for i in ids[1000:1004]]
            rows += bench_generate(paths["vocab_size"], prompt, threads_list, 200 if q else 500, repeats)
    print()
    print(
        table(
            rows,
            [
                ("what", "what"),
                ("contender", "contender"),
                ("threads", "threads"),
                ("precision", "precision"),
                ("tokens_per_s", "tokens/s"),
                ("mfu", "MFU"),
                ("ratio", "x nanoGPT"),
                ("warmup_s", "warm-up s"),
                ("loss_last50", "loss, last steps"),
                ("load", "load avg (max)"),
            ],
        )
    )
    save("vs_nanogpt", {"machine": m, "quick": q, "rows": rows})


if __name__ == "__main__":
    main()
