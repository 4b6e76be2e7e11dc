"""What `python -m mllm.train` shows: its records as lines at a terminal, and as JSON lines in a
file (`--events`), which is how the pipeline follows a torchrun job."""

from __future__ import annotations

import contextlib
import json

from mllm.settings import settings


def print_records(records: list[dict]) -> None:
    """A training's log and evaluation records as lines at a terminal."""
    for r in records:
        if "train_loss" in r:
            print(
                f"step {r['step']}: loss {r['train_loss']:.4f}, lr {r['lr']:.2e}, "
                f"grad norm {r['grad_norm']:.3f}, {r['tokens_per_s']:,.0f} tok/s, mfu {r['mfu']:.1%}",
                flush=True,
            )
        if "val_loss" in r:
            print(
                f"step {r['step']}: val loss {r['val_loss']:.4f}, perplexity {r['val_perplexity']:.2f}, "
                f"{r['val_bits_per_token']:.3f} bits/token",
                flush=True,
            )


@contextlib.contextmanager
def event_log(path: str | None):
    """A function writing one JSON line per call to `path` (rank 0 only), or doing nothing."""
    if not path or settings().rank != 0:
        yield lambda event: None
        return
    with open(path, "a", encoding="utf-8") as f:

        def emit(event: dict) -> None:
            f.write(json.dumps(event) + "\n")
            f.flush()

        yield emit
