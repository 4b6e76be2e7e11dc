"""The training loop of every family, in parts: its state, set-up, resume, step, evaluation, checkpoints, reports.

`mllm.train` is the entry point (`train()` and `python -m mllm.train`); docs/training.md walks the loop.
"""
