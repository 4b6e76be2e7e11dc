"""`python -m flows.cli`: the same as the `mllm-pipeline` console script."""

from flows.cli import main

main()
