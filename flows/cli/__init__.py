"""The `mllm-pipeline` command: the typer app, its commands, and what it shows on the terminal."""
