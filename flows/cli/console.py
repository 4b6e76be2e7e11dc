"""The `mllm-pipeline` console script: the process's environment set up, then the app run."""

from flows.settings import process_defaults


def main() -> None:
    """Set up the environment before the commands, and Prefect with them, are imported (Prefect
    reads DO_NOT_TRACK and its settings when imported), then run the app."""
    process_defaults()
    from flows.cli.main import app

    app()
