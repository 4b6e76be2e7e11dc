"""`mllm-pipeline search`: Optuna trials over a space of config fields, each a pipeline run."""
