"""Where a GPT training step's time goes on this CPU: torch.profiler over a few steps.

    python -m benchmarks.profile_step [--threads N] [--dtype bfloat16|float32] [--shape 6/6/384] [--block 256] [--batch 8]

The step is the training loop's own (mllm.train): the attention kernel it would choose, forward
under the precision's autocast, backward, fused AdamW. It prints the operators by their share of the step's CPU time, which is
what to attack to bring a step closer to the matrix-multiply peak (issue #29): `aten::mm` is the
matrix work; `aten::copy_` under bf16 is autocast's casts; the rest is attention, layer norm,
GELU, the optimizer.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import header, parse_args, save, table
from mllm.config import GPTConfig
from mllm.families.base import build_model
from mllm.runtime.speed import Precision, choose_attention


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16"),
            p.add_argument("--shape", default="6/6/384", help="layers/heads/width"),
            p.add_argument("--block", type=int, default=256),
            p.add_argument("--batch", type=int, default=8),
            p.add_argument("--steps", type=int, default=3),
        ),
    )
    m = header("profile_step", args.quick)
    n_layer, n_head, n_embd = (int(x) for x in args.shape.split("/"))
    model = build_model(
        GPTConfig(
            vocab_size=80, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=args.block, dropout=0.0, bias=False
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = (torch.randint(0, 80, (args.batch, args.block)) for _ in range(2))
    attention = choose_attention(model, torch.device("cpu"), (x, y))  # as the training chooses it
    autocast = Precision(args.dtype, "").autocast(torch.device("cpu"))

    def step() -> None:
        with autocast():
            _, loss, _ = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # allocator and thread pool warm-up
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [
        {
            "op": e.key,
            "share": f"{e.self_cpu_time_total / total:.1%}",
            "calls": e.count,
            "ms_per_step": e.self_cpu_time_total / 1000 / args.steps,
        }
        for e in events[:12]
    ]
    print(
        f"GPT {args.shape}, block {args.block}, batch {args.batch}, {args.dtype}: "
        f"{total / 1000 / args.steps:,.0f} ms a step (CPU time)\nattention: {attention}\n"
    )
    print(
        table(
            rows,
            [
                ("op", "operator"),
                ("share", "share of CPU time"),
                ("ms_per_step", "ms a step"),
                ("calls", f"calls ({args.steps} steps)"),
            ],
        )
    )
    save(
        "profile_step",
        {
            "machine": m,
            "shape": args.shape,
            "block": args.block,
            "batch": args.batch,
            "dtype": args.dtype,
            "attention": attention,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
