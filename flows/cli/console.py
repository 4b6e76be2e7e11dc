"""The `mllm-pipeline` console script: the process's environment set up, then the app run."""

import gc

from flows.settings import process_defaults


def main() -> None:
    """Set up the environment before the commands, and Prefect with them, are imported (Prefect
    reads DO_NOT_TRACK and its settings when imported), then run the app.

    The garbage collector is told to leave alone what exists once the imports are done, and again
    what exists once the command is done: a command holds about 400 000 objects after its
    imports and 800 000 after a training, each full collection of them took 0.7-1.5 s here, and
    the interpreter's collections at exit kept a command that had finished (or been sent SIGTERM)
    alive 14-38 s longer (docs/benchmarks/orchestration.md, "Ctrl-C")."""
    process_defaults()
    from flows.cli.main import app

    gc.freeze()
    try:
        app()
    finally:
        gc.freeze()
