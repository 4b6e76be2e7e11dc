"""The `mllm-pipeline` console script: the process's environment set up, then the app run."""

import gc

from flows.settings import process_defaults


def main() -> None:
    """Set up the environment before the commands, and Prefect with them, are imported (Prefect
    reads DO_NOT_TRACK and its settings when imported), then run the app.

    What the imports made (about 400 000 objects) is frozen out of the garbage collector's reach:
    it stays for the life of the process, and each full collection walked it again (0.7-1.5 s
    each here)."""
    process_defaults()
    from flows.cli.main import app

    gc.freeze()
    app()
