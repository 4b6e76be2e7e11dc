"""Train a model of any family: `train()`, and `python -m mllm.train --config run.yaml` without the pipeline.

The loop and its parts are in mllm.training; docs/training.md says what it does and guarantees.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable

import torch
import torch.distributed as tdist

from mllm import UserError
from mllm.config import RunConfig
from mllm.families.base import load_inputs
from mllm.resolve import apply_overrides, load_file, validate
from mllm.runtime.checkpoint import Signals
from mllm.runtime.devices import resolve_device
from mllm.runtime.distributed import join
from mllm.runtime.events import event_log, print_records
from mllm.runtime.results import TrainResult
from mllm.settings import settings
from mllm.training import loop
from mllm.training.resume import resume as resume_from
from mllm.training.setup import Hooks, Records, build, engine
from mllm.training.state import LoopState

__all__ = ["TrainResult", "main", "train"]


def train(
    cfg: RunConfig,
    on_metrics: Callable[[Records], None] | None = None,
    on_progress: Callable[[dict], None] | None = None,
    resume: bool = True,
    on_eval: Callable[[int, float], bool] | None = None,
    on_notice: Callable[[str], None] | None = None,
    signals: Signals | None = None,
) -> TrainResult:
    """Train per `cfg` (its paths section says where inputs and checkpoints are), from last.pt
    there unless `resume` is False.

    on_metrics gets one list of records per log or eval step; on_progress a dict per log step;
    on_notice a line for the terminal (a resume, a change of threads, a busy machine).
    on_eval gets (step, val loss) at each evaluation and answers whether to stop there: the
    training then ends with stop_reason "pruned", its checkpoint written (a search's pruner).
    Under DDP only rank 0 calls them and writes checkpoints. `signals`: a caller that runs the
    training in a thread of its own passes `Signals(install=False)` and calls its stop().
    """
    inputs = load_inputs(cfg)
    d, device = join(resolve_device(inputs[0].train.device))
    signals, threads_before = signals or Signals(), torch.get_num_threads()
    hooks = Hooks(on_metrics, on_progress, on_eval)
    if d.master and on_notice:
        hooks.notice = on_notice
    try:
        st = LoopState()
        tr = build(inputs, d, device, signals, hooks, st)
        resume_from(tr, st, wanted=resume)
        return loop.run(tr, engine(tr, st), st)
    finally:
        signals.restore()
        torch.set_num_threads(threads_before)  # what runs next in this process (evaluation) starts as it was
        if d.owns_group:
            tdist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mllm.train",
        description="Train a model of any family from its data on disk (no Prefect, no MLflow). Writes "
        "{paths.checkpoint_dir}/last.pt (full state, resumable) and best.pt (best validation loss).",
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE.yaml",
        help="a RunConfig as YAML (a recipe's sections plus a paths section: train_ids, "
        "val_ids, vocab, optional tokenizer, checkpoint_dir)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set train.lr=3e-4 (repeatable; values are YAML)",
    )
    parser.add_argument(
        "--no-resume",
        action="store_true",
        help="start from scratch even if checkpoint_dir holds a last.pt (it is overwritten)",
    )
    parser.add_argument(
        "--events",
        metavar="FILE.jsonl",
        help="also append metrics, progress and the result to this local file, one JSON "
        "object a line (how the pipeline follows a torchrun job)",
    )
    args = parser.parse_args(argv)
    try:
        data = apply_overrides(load_file(args.config), args.overrides)
        cfg = validate(data, args.config if not args.overrides else f"{args.config} with --set")
        if cfg.paths is None:
            raise UserError(
                f"{args.config} has no paths section: add paths with train_ids, val_ids, vocab and checkpoint_dir"
            )
        with event_log(args.events) as emit:

            def on_metrics(records: Records) -> None:
                print_records(records)
                emit({"metrics": records})

            result = train(
                cfg,
                on_metrics=on_metrics,
                on_progress=lambda p: emit({"progress": p}),
                resume=not args.no_resume,
                on_notice=lambda line: print(line, flush=True),
            )
            emit({"result": dataclasses.asdict(result)})
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "error: interrupted: last.pt holds the last finished step; run the same command to resume", file=sys.stderr
        )
        return 130
    if settings().rank == 0:
        print(result.done_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
