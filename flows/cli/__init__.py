"""The `mllm-pipeline` command: the typer app, its commands, and what it shows on the terminal."""

from flows.settings import process_defaults


def main() -> None:
    """The console script: the process's environment set up before the commands, and Prefect
    with them, are imported (Prefect reads DO_NOT_TRACK and its settings when imported)."""
    process_defaults()
    from flows.cli.main import app

    app()
