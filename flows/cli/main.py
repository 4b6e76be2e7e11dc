"""The app with every command registered on it (the console script, `flows.cli:main`, imports it
once the process's environment is set up)."""

from flows.cli import exporting, pipeline, runs, search, servers, stack_auth  # noqa: F401  (importing a command module registers its commands)
from flows.cli.app import app

__all__ = ["app"]
