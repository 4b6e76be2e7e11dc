"""The `mllm-pipeline` console script: the app with every command registered on it."""

from flows.cli import exporting, pipeline, runs, search, servers, stack_auth  # noqa: F401  (importing a command module registers its commands)
from flows.cli.app import app


def main() -> None:
    app()
