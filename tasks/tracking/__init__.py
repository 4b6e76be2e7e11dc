"""MLflow writes: the run tracker, the registry and champion, datasets, provenance, the served model.

No module here imports a stage module (tasks.data, tasks.model): tests/test_layers.py keeps it so."""
