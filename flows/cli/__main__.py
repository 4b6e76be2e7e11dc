"""`python -m flows.cli`: the same as the `mllm-pipeline` console script."""

from flows.cli.main import main

main()
