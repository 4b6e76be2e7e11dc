"""Generation tokens/s: GPT with and without its KV cache, LSTM with carried state or recomputed.

    python -m benchmarks.generate_speed [--quick] [--threads N] [--new-tokens 500]
    python -m benchmarks.generate_speed --matvec     # why a second thread does not help decoding

`mllm.lm.generate.generate` continues a 4-token prompt by 500 tokens, greedy and top-p (p 0.9,
temperature 0.8), for:
- GPT at nanoGPT's CPU size (4 layers, 4 heads, 128 wide, block 64): 500 tokens run far past the
  block, so without the cache every step re-reads the last 64 tokens, and with it the cache is
  refilled from the last 32 tokens every 32 tokens (see mllm/lm/generate.py);
- the same GPT with block 512, so all 500 tokens fit: the cache is never refilled, and without it
  each step re-reads the whole growing context (the quadratic cost the cache removes);
- the reference LSTM (embedding 32, 4x128): carried hidden state, one step per token, against
  re-running the whole sequence from the start for every token.
Each model is trained for a few dozen steps on War and Peace first, so that greedy and top-p see
the peaked distributions of a real model rather than the near-uniform ones of random weights
(the nucleus of a uniform distribution is nearly the whole vocabulary). The "same" column says
whether greedy decoding gave the same tokens with and without the cache/state. Every case runs at
torch's thread count and again at one thread (see the comment in main).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import corpus, header, load, median, parse_args, save, table, threads, token_ids
from mllm.config import model_config
from mllm.families.base import build_model
from mllm.lm.generate import generate
from mllm.lm.windows import windows
from mllm.runtime.epochs import load_ids

MODELS = {
    "GPT 4x4x128, block 64": dict(arch="gpt", n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False),
    "GPT 4x4x128, block 512": dict(
        arch="gpt", n_layer=4, n_head=4, n_embd=128, block_size=512, dropout=0.0, bias=False
    ),
    "LSTM emb 32, 4x128": dict(arch="lstm", n_embd=32, n_layer=4, hidden_size=128, dropout=0.0),
}


def brief_training(model: torch.nn.Module, ids: np.ndarray, steps: int, window: int = 64, batch: int = 16) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    loss = None
    for _ in range(steps):
        x, y = windows(ids, torch.randint(len(ids) - window - 1, (batch,), generator=g).numpy(), window)
        _, loss, _ = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def timed(model, prompt: list[int], n: int, method: str, use_cache: bool, repeats: int) -> tuple[float, list[int]]:
    """Median seconds over up to `repeats` runs (fewer when one run is slow enough to be steady)."""
    times, out = [], []
    while len(times) < repeats and sum(times) < 5.0:
        t0 = time.perf_counter()
        out = generate(model, prompt, n, method=method, temperature=0.8, top_p=0.9, seed=1, use_cache=use_cache)
        times.append(time.perf_counter() - t0)
    return median(times), out


# The products one decoded token of the 6/6/384 GPT makes (rows x columns of the weight), and a
# 64 MB one well past the L3 cache, each times one vector.
MATVEC_SHAPES = [(1152, 384), (384, 384), (1536, 384), (384, 1536), (4096, 4096)]


def matvec(m: dict) -> None:
    """A batch of one, as cached decoding multiplies: one thread against two, and the product
    split in half across two Python threads by hand."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.nn.functional as F

    def per_call(fn, n: int) -> float:
        for _ in range(5):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    rows = []
    pool = ThreadPoolExecutor(2)
    with torch.inference_mode():
        for shape in MATVEC_SHAPES:
            w, x = torch.randn(*shape), torch.randn(1, shape[1])
            halves = [w[: shape[0] // 2].contiguous(), w[shape[0] // 2 :].contiguous()]
            n = 30 if w.numel() > 10**6 * 4 else 300
            row = {"shape": f"{shape[0]}x{shape[1]}", "mb": w.numel() * 4 / 1e6}
            for t in (1, 2):
                with threads(t):
                    row[f"us_{t}"] = per_call(lambda: F.linear(x, w), n)
            with threads(1):
                row["us_split"] = per_call(lambda: torch.cat(list(pool.map(lambda h: F.linear(x, h), halves)), 1), n)
            row["gb_s_1"] = row["mb"] / row["us_1"] * 1e3
            rows.append(row)
    print(
        table(
            rows,
            [
                ("shape", "weight"),
                ("mb", "MB"),
                ("us_1", "1 thread, us"),
                ("gb_s_1", "GB/s"),
                ("us_2", "2 threads, us"),
                ("us_split", "halves on 2 Python threads, us"),
            ],
        )
    )
    save("generate_matvec", {"machine": m, "rows": rows})


def decode_rows(name: str, model, cache_name: str, prompt: list[int], n: int, repeats: int) -> list[dict]:
    """`model` decoding `n` tokens greedy and top-p, with its cache or state and recomputing, at
    torch's thread count and at one thread: a row each."""
    # One sequence at a time is a stream of tiny ops: with every core's thread waiting on the
    # others at each op, a core taken by anything else stalls all of them. Hence a one-thread pass.
    thread_counts = sorted({torch.get_num_threads(), 1}, reverse=True)
    rows = []
    for n_threads in thread_counts:
        with threads(n_threads):
            for method in ("greedy", "top-p"):
                timed(model, prompt, 8, method, True, 1)  # warm-up
                s_cached, cached = timed(model, prompt, n, method, True, repeats)
                load_cached = load()
                s_full, full = timed(model, prompt, n, method, False, repeats)
                same = (cached == full) if method == "greedy" else None
                for mode, s, ld in ((cache_name, s_cached, load_cached), ("recompute", s_full, load())):
                    rows.append(
                        {
                            "model": name,
                            "threads": n_threads,
                            "method": method,
                            "mode": mode,
                            "new_tokens": n,
                            "seconds": s,
                            "tokens_per_s": n / s,
                            "speedup": s_full / s,
                            "same_tokens": same,
                            "load": ld,
                        }
                    )
                print(
                    f"  {n_threads} threads, {method}: {n / s_cached:,.0f} tokens/s with {cache_name}, "
                    f"{n / s_full:,.0f} recomputing ({s_full / s_cached:.1f}x)"
                    + (f", same tokens: {same}" if same is not None else ""),
                    flush=True,
                )
    return rows


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--new-tokens", type=int, default=500),
            p.add_argument("--matvec", action="store_true", help="only time the matrix-vector products of decoding"),
        ),
    )
    m = header("generate_speed", args.quick)
    if args.matvec:
        matvec(m)
        return
    wp = corpus("warandpeace")
    q, n = args.quick, args.new_tokens
    repeats, train_steps = (1, 20) if q else (3, 60)
    with tempfile.TemporaryDirectory(prefix="mllm-bench-generate-") as tmp:
        paths = token_ids(wp, Path(tmp) / "wp")
        ids = np.array(load_ids(paths["train_ids"]))  # a copy: the folder goes before the models do
    prompt = [int(i) for i in ids[1000:1004]]

    rows = []
    for name, spec in MODELS.items():
        torch.manual_seed(1337)
        model = build_model(model_config(vocab_size=paths["vocab_size"], **spec))
        t0 = time.perf_counter()
        with threads(1):
            loss = brief_training(model, ids, train_steps)
        print(f"{name}: {train_steps} training steps in {time.perf_counter() - t0:.1f} s, loss {loss:.2f}", flush=True)
        model.eval()
        rows += decode_rows(name, model, "KV cache" if spec["arch"] == "gpt" else "carried state", prompt, n, repeats)

    print()
    print(
        table(
            rows,
            [
                ("model", "model"),
                ("threads", "threads"),
                ("method", "method"),
                ("mode", "context"),
                ("seconds", f"s / {n} tokens"),
                ("tokens_per_s", "tokens/s"),
                ("speedup", "vs recompute"),
                ("same_tokens", "greedy same"),
                ("load", "load avg"),
            ],
        )
    )
    save(
        "generate_speed",
        {"machine": m, "quick": q, "new_tokens": n, "repeats": repeats, "training_steps": train_steps, "rows": rows},
    )


if __name__ == "__main__":
    main()
