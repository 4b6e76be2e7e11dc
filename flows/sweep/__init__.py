"""`mllm-pipeline sweep`: the pipeline at every point of a grid of config fields."""
