"""Muon's optimizer step alone: torch.optim.Muon, mllm's Muon one matrix at a time, and mllm's Muon
with each shape's matrices stacked into one batched Newton-Schulz iteration (what trainings use).

    python -m benchmarks.muon_step [--threads N] [--device cuda] [--shape LAYERS,WIDTH]

The matrices are a GPT's block weights at the shape (default: the `default` recipe's 4 layers of
128, and shakespeare-gpt's 6 of 384): per layer the attention's (3W, W) and (W, W), the MLP's
(4W, W) and (W, 4W). Gradients are random; the figure is the median of 25 steps after 5 warm-up
steps, with the device synchronised around each. mllm's iteration runs in the precision a training
on this device would choose (`newton_schulz_dtype`); torch.optim.Muon always in bf16, so it is
skipped on a CPU without bf16 hardware (seconds a step there: see docs/speed.md).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import header, median, parse_args, save, table
from mllm.runtime.optim import Muon, newton_schulz_dtype

HYPER = {"lr": 0.01, "momentum": 0.95, "weight_decay": 0.1}


def step_ms(make, shapes: list[tuple[int, int]], device: str) -> float:
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt, times = make(params), []
    for _ in range(30):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times[5:]) * 1e3


def main() -> None:
    args = parse_args(
        __doc__.split("\n\n")[0],
        lambda p: (
            p.add_argument("--device", default="cpu", help="cpu or cuda"),
            p.add_argument(
                "--shape",
                action="append",
                default=None,
                metavar="LAYERS,WIDTH",
                help="a GPT's layers and width (repeatable; default 4,128 and 6,384)",
            ),
        ),
    )
    m = header("muon_step", args.quick)
    dtype, why = newton_schulz_dtype(torch.device(args.device))
    print(f"device {args.device}; mllm's Newton-Schulz in {why}\n")
    rows = []
    for shape in args.shape or ["4,128", "6,384"]:
        layers, width = (int(x) for x in shape.split(","))
        shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers
        row = {"shape": f"{layers} x {width}", "matrices": len(shapes)}
        if dtype == torch.bfloat16:
            row["torch"] = step_ms(lambda ps: torch.optim.Muon(ps, **HYPER), shapes, args.device)
        # One parameter group per matrix: the same code, one matrix a stack.
        row["one"] = step_ms(
            lambda ps: Muon([{"params": [p]} for p in ps], ns_dtype=dtype, **HYPER), shapes, args.device
        )
        row["stacked"] = step_ms(lambda ps: Muon(ps, ns_dtype=dtype, **HYPER), shapes, args.device)
        rows.append(row)
    print(
        table(
            rows,
            [
                ("shape", "layers x width"),
                ("matrices", "matrices"),
                ("torch", "torch.optim.Muon, ms"),
                ("one", "mllm, one matrix at a time, ms"),
                ("stacked", "mllm, stacked by shape, ms"),
            ],
        )
    )
    save("muon_step", {"machine": m, "device": args.device, "ns_dtype": str(dtype), "rows": rows})


if __name__ == "__main__":
    main()
