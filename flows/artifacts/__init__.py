"""The Prefect artifacts of the flows' runs: what a run shows in the UI beside its logs."""
