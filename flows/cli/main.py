"""The app with every command registered on it (the console script, `flows.cli.console:main`, imports it
once the process's environment is set up)."""

# Importing a command module registers its commands, in the order `--help` lists them: the
# pipeline's, then the sweep's, then the others.
from flows.cli import exporting, pipeline, sweep  # noqa: F401  (registers commands)

# isort: split
from flows.cli import runs, search, servers, stack_auth  # noqa: F401  (registers commands)
from flows.cli.app import app

__all__ = ["app"]
