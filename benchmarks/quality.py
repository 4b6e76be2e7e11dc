"""Which CPU recipe learns War and Peace best in a fixed wall time, with nanoGPT as the reference.

    python -m benchmarks.quality [--minutes 10] [--threads 2] [--only NAME ...] [--seed N]

Every candidate (GPT and LSTM variants, trained by `python -m mllm.train --config` with a paths
section) and nanoGPT's CPU configuration (anchors README, trained by nanoGPT's own train.py) get
the same training time, one after the other, on the same ids: War and Peace with the reference
char normalisation, 90/10. A cosine schedule must know its end: each mllm contender is given the
budget as `train.max_minutes` alone, so its schedule follows the clock and ends with the budget
(docs/speed.md); nanoGPT is first timed for a few iterations and its count set to fill the
budget, which is also its hard stop.
Then every model is scored on the whole validation split by `mllm.lm.evaluate.evaluate` (nanoGPT's
checkpoint through a thin adapter), so the figures compare like with like: validation loss and
bits per character (the normalised text is ASCII, so a character is a byte of it), and a sample.
Without ../shared/anchors/nanoGPT the reference row is left out.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import corpus, header, load, parse_args, run_config, save, table, token_ids
from benchmarks.nanogpt import ANCHOR, run_mllm_train, train_for_minutes

GPT_BASE = {
    "model.arch": "gpt",
    "model.bias": False,
    "model.dropout": 0.0,
    "train.sampling": "random",
    "train.optimizer": "adamw",
    "train.weight_decay": 0.1,
    "train.beta2": 0.99,
    "train.grad_clip": 1.0,
    "train.lr_schedule": "cosine",
}
LSTM_BASE = {
    "model.arch": "lstm",
    "model.n_embd": 32,
    "model.dropout": 0.0,
    "train.sampling": "random",
    "train.optimizer": "adam",
    "train.grad_clip": 1.0,
    "train.lr_schedule": "cosine",
}

CANDIDATES = {
    # What `make run` trains now (mllm/recipes/default.yaml): GPT 4x4x128 reading 256 characters
    # (8 windows a step), rotary positions and a ReLU² MLP, Muon (0.01, weight decay 0.05) for the
    # blocks' matrices and AdamW (2e-3) for the rest, both rates decayed linearly to 0 (issue 47).
    "the default recipe": {"recipe": "default"},
    # The default before its rates decayed linearly to zero and its context went to 256: a cosine
    # to a tenth of each rate, block 128, 16 windows a step (the same tokens).
    "the default before linear decay and block 256 (cosine, 16x128)": {
        "recipe": "default",
        "train.lr_schedule": "cosine",
        "train.min_lr": 2.0e-4,
        "model.block_size": 128,
        "train.window": 128,
        "train.batch_size": 16,
    },
    # Each of the two alone: the cosine to a tenth, not "Straight to Zero"'s linear decay (Bergsma
    # et al., 2025: linear to zero was best at fixed compute); block 128.
    "the default, cosine to a tenth": {"recipe": "default", "train.lr_schedule": "cosine", "train.min_lr": 2.0e-4},
    "the default at block 128, batch 16x128": {
        "recipe": "default",
        "model.block_size": 128,
        "train.window": 128,
        "train.batch_size": 16,
    },
    # The default before its Muon matrices were decayed too.
    "the default, no muon weight decay": {"recipe": "default", "train.muon_weight_decay": 0.0},
    # The default before its context went to 128: block 64, 32 windows a step (the same tokens).
    "the default at block 64, batch 32x64": {
        "recipe": "default",
        "model.block_size": 64,
        "train.window": 64,
        "train.batch_size": 32,
    },
    # The default before issue 47: learned positions, GELU, AdamW alone, block 64, a cosine to a tenth.
    "the default before issue 47 (adamw, learned positions, gelu)": {
        "recipe": "default",
        "train.optimizer": "adamw",
        "model.positions": "learned",
        "model.mlp": "gelu",
        "model.block_size": 64,
        "train.window": 64,
        "train.batch_size": 32,
        "train.lr_schedule": "cosine",
        "train.min_lr": 2.0e-4,
    },
    # The default with Muon's rate at train.muon_lr's default, 0.02 (chosen at 600 steps, docs/benchmarks/quality.md).
    "the default, muon lr 0.02": {"recipe": "default", "train.muon_lr": 0.02},
    # The default 192 wide: a model that learns more per step may want to be larger.
    "the default, 192 wide": {"recipe": "default", "model.n_embd": 192},
    # The default with dropout: on a machine where ten minutes are 8-13 passes over the text, its
    # loss on the training text's tail ran 0.12-0.15 below validation. (Zen 5: 8,104 steps, 1.2541.)
    "the default, dropout 0.1": {"recipe": "default", "model.dropout": 0.1},
    # The default with twice the windows a step: larger products, fewer steps.
    "the default, batch 16": {"recipe": "default", "train.batch_size": 16},
    # The default with value embeddings (model.value_embeds), per-layer residual scalars
    # (model.residual_scalars), and both: nanochat's pieces that issue 47 left to measure.
    "the default + value embeddings": {"recipe": "default", "model.value_embeds": True},
    "the default + residual scalars": {"recipe": "default", "model.residual_scalars": True},
    "the default + value embeddings, residual scalars": {
        "recipe": "default",
        "model.value_embeds": True,
        "model.residual_scalars": True,
    },
    # The recipe `make run` trained before this benchmark existed.
    "lstm 2x256, batch 64x64, lr 3e-3": {
        **LSTM_BASE,
        "model.n_layer": 2,
        "model.hidden_size": 256,
        "train.batch_size": 64,
        "train.window": 64,
        "train.lr": 3e-3,
        "train.min_lr": 3e-4,
        "train.warmup_steps": 50,
    },
    "lstm 1x512, batch 64x64, lr 3e-3": {
        **LSTM_BASE,
        "model.n_layer": 1,
        "model.hidden_size": 512,
        "train.batch_size": 64,
        "train.window": 64,
        "train.lr": 3e-3,
        "train.min_lr": 3e-4,
        "train.warmup_steps": 50,
    },
    # nanoGPT's CPU size, trained by mllm with nanoGPT's hyperparameters.
    "gpt 4x4x128, batch 12x64, lr 1e-3": {
        **GPT_BASE,
        "model.n_layer": 4,
        "model.n_head": 4,
        "model.n_embd": 128,
        "model.block_size": 64,
        "train.batch_size": 12,
        "train.window": 64,
        "train.lr": 1e-3,
        "train.min_lr": 1e-4,
        "train.warmup_steps": 100,
    },
    # The same network with more tokens per step and a higher rate: a CPU does a batch of 32
    # in well under 3x the time of 12, so a fixed wall time sees more text (the default recipe).
    "gpt 4x4x128, batch 32x64, lr 2e-3": {
        **GPT_BASE,
        "model.n_layer": 4,
        "model.n_head": 4,
        "model.n_embd": 128,
        "model.block_size": 64,
        "train.batch_size": 32,
        "train.window": 64,
        "train.lr": 2e-3,
        "train.min_lr": 2e-4,
        "train.warmup_steps": 100,
    },
    # The default's network with twice the context, the same tokens per step: each prediction sees
    # 128 characters back, for about 8% more FLOPs a token (attention).
    "gpt 4x4x128, block 128, batch 16x128, lr 2e-3": {
        **GPT_BASE,
        "model.n_layer": 4,
        "model.n_head": 4,
        "model.n_embd": 128,
        "model.block_size": 128,
        "train.batch_size": 16,
        "train.window": 128,
        "train.lr": 2e-3,
        "train.min_lr": 2e-4,
        "train.warmup_steps": 100,
    },
    # Wider and with twice the context, the same tokens per step: fewer steps in the budget, each
    # worth more if the 128-wide network is what limits the loss.
    "gpt 4x4x192, block 128, batch 16x128, lr 2e-3": {
        **GPT_BASE,
        "model.n_layer": 4,
        "model.n_head": 4,
        "model.n_embd": 192,
        "model.block_size": 128,
        "train.batch_size": 16,
        "train.window": 128,
        "train.lr": 2e-3,
        "train.min_lr": 2e-4,
        "train.warmup_steps": 100,
    },
}


def _mllm_run(paths: dict, folder: Path, name: str, overrides: dict, threads: int) -> tuple[str, Path]:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    folder.mkdir(parents=True, exist_ok=True)
    recipe = overrides.get("recipe")
    overrides = {k: v for k, v in overrides.items() if k != "recipe"}
    cfg = run_config(recipe, paths, folder / slug, {**overrides, "train.device": "cpu"})
    return run_mllm_train(cfg, folder / f"{slug}.yaml", threads, f"{name}: mllm.train"), folder / slug


def _tokens_per_step(overrides: dict) -> int:
    train = {}
    if "recipe" in overrides:
        from mllm.resolve import resolve

        train = resolve(overrides["recipe"]).train.model_dump()
    return overrides.get("train.batch_size", train.get("batch_size")) * overrides.get(
        "train.window", train.get("window")
    )


def train_mllm(paths: dict, folder: Path, name: str, overrides: dict, minutes: float, threads: int) -> dict:
    """A contender trained for `minutes` as a time budget: its schedule follows the clock and ends
    with the budget (docs/speed.md), evaluations included."""
    t0 = time.perf_counter()
    stdout, ckpt = _mllm_run(
        paths,
        folder,
        name,
        {
            **overrides,
            "train.max_steps": None,
            "train.epochs": None,
            "train.max_minutes": minutes,
            "train.log_interval": 50,
            "train.eval_interval": 1000,
            "train.eval_batches": 20,
            "train.checkpoint_interval": 10**6,
            "train.checkpoint_minutes": None,
        },
        threads,
    )
    done = re.search(r"^done: (\d+) steps \((\w+).*?, ([\d.]+)s; checkpoint", stdout, re.M)
    from mllm.runtime.checkpoint import load_checkpoint

    return {
        "model": load_checkpoint(str(ckpt / "last.pt")).model,
        "steps": int(done.group(1)),
        "stop": done.group(2),
        "train_s": float(done.group(3)),
        "wall_s": time.perf_counter() - t0,
        "tokens_per_step": _tokens_per_step(overrides),
    }


def _args():
    return parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--minutes", type=float, default=10.0, help="training time per contender"),
            p.add_argument("--only", nargs="+", choices=[*CANDIDATES, "nanoGPT"], help="run only these"),
            p.add_argument("--val-tokens", type=int, help="score only the first N validation tokens"),
            p.add_argument("--seed", type=int, help="train.seed of every mllm contender [each recipe's own]"),
        ),
    )


def score(name: str, got: dict, val, train_tail, vocab, prompt: list[int]) -> dict:
    """A trained contender's row: validation and training-tail loss, and a sample."""
    from mllm.lm.evaluate import evaluate
    from mllm.lm.generate import generate

    model = got.pop("model")
    window = getattr(model.config, "block_size", 64) if model.config.arch == "gpt" else 64
    t0 = time.perf_counter()
    val_score = evaluate(model, val, window, 64)
    train_score = evaluate(model, train_tail, window, 64)
    text = "".join(
        vocab.decode(
            generate(
                model,
                prompt,
                200,
                method="top-p",
                top_p=0.9,
                temperature=0.8,
                seed=1,
                use_cache=name != "nanoGPT",
            )
        )
    )
    return {
        "contender": name,
        **got,
        "tokens_seen": got["steps"] * got["tokens_per_step"],
        "val_loss": val_score["loss"],
        "bits_per_char": val_score["bits_per_token"],
        "train_loss": train_score["loss"],
        "eval_s": time.perf_counter() - t0,
        "load": load(),
        "sample": "The " + text,
    }


def report(rows: list[dict]) -> None:
    """Each row's distance to nanoGPT's validation loss, the table and the samples."""
    ref = next((r["val_loss"] for r in rows if r["contender"] == "nanoGPT"), None)
    for r in rows:
        r["vs_nanogpt"] = None if ref is None else r["val_loss"] - ref
    print()
    print(
        table(
            rows,
            [
                ("contender", "contender"),
                ("steps", "steps"),
                ("tokens_seen", "tokens seen"),
                ("train_s", "training s"),
                ("val_loss", "val loss"),
                ("bits_per_char", "bits/char"),
                ("train_loss", "train loss (its last tokens, as many)"),
                ("vs_nanogpt", "val loss - nanoGPT's"),
                ("load", "load avg"),
            ],
        )
    )
    print("\nsamples (top-p 0.9, temperature 0.8, seed 1):")
    for r in rows:
        print(f"- {r['contender']}: {r['sample']!r}")


def main() -> None:
    args = _args()
    m = header("quality", args.quick)
    wp = corpus("warandpeace")
    threads = args.threads or torch.get_num_threads()
    names = args.only or [*CANDIDATES, "nanoGPT"]
    if "nanoGPT" in names and not (ANCHOR / "train.py").is_file():
        print(f"nanoGPT not found at {ANCHOR}: its reference row is left out")
        names = [n for n in names if n != "nanoGPT"]
    from mllm.data.vocab import Vocab

    rows = []
    with tempfile.TemporaryDirectory(prefix="mllm-bench-quality-") as tmp:
        folder = Path(tmp)
        paths = token_ids(wp, folder / "wp")
        vocab = Vocab.load(paths["vocab"])
        val = np.load(paths["val_ids"])[: args.val_tokens]
        # As many training tokens, the split's last: the gap to the validation loss says whether a
        # contender has begun to learn its training text rather than the language (overfitting).
        train_tail = np.load(paths["train_ids"])[-len(val) :]
        prompt = vocab.encode(list("The "))
        for name in names:
            print(f"{name}: training for {args.minutes} min on {threads} threads", flush=True)
            if name == "nanoGPT":
                got = train_for_minutes(paths, folder, args.minutes, threads)
            else:
                seed = {} if args.seed is None else {"train.seed": args.seed}
                got = train_mllm(paths, folder, name, {**CANDIDATES[name], **seed}, args.minutes, threads)
            row = score(name, got, val, train_tail, vocab, prompt)
            rows.append(row)
            print(
                f"  {row['steps']} steps in {row['train_s']:.0f} s of training ({row['stop']}), "
                f"val loss {row['val_loss']:.4f}, {row['bits_per_char']:.3f} bits/char, train loss {row['train_loss']:.4f}, "
                f"load {row['load']}\n"
                f"  sample: {row['sample']!r}",
                flush=True,
            )
    report(rows)
    save(
        "quality",
        {
            "machine": m,
            "minutes": args.minutes,
            "threads": threads,
            "seed": args.seed,
            "val_tokens": len(val),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
