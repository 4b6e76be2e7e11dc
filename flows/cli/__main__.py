"""`python -m flows.cli`: the same as the `mllm-pipeline` console script."""

from flows.cli.console import main

main()
