"""The registered model as MLflow serves it: an mllm checkpoint behind the pyfunc interface.

This module and the `mllm` package are the only code packaged with a registered model, so it
imports nothing but mlflow, pandas and mllm: `models:/NAME@champion` loads, and `mlflow models
serve` answers, where neither Prefect nor the rest of this project is installed.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import pandas as pd


class ServedModel(mlflow.pyfunc.PythonModel):
    """A checkpoint of any family as an MLflow model: texts in, its family's answers out (a
    continuation, a word's neighbours, a translation, the next element), through
    `mllm.sample.answer`, as the CLI and `python -m mllm.sample` give them.

    `mlflow.pyfunc.load_model("models:/NAME@champion").predict(["The "], params={...})`; the
    parameters and their defaults (the run's own sample section) are in the model's signature.
    """

    def load_context(self, context) -> None:
        import torch

        from mllm.runtime.checkpoint import load_checkpoint

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.loaded = load_checkpoint(context.artifacts["checkpoint"], device=device)

    def predict(self, context, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list[str]:
        from mllm.sample import answer

        return answer(self.loaded, prompts(model_input), **(params or {}))


def prompts(model_input: Any) -> list[str]:
    """Prompts from a DataFrame (its "prompt" column, else the first), a Series, a list, a
    dict or a str. MLflow turns {"prompt": [a, b]} into one row holding the list: unpack it."""
    x = model_input
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return prompts(x.get("prompt", next(iter(x.values()), [])))
    if hasattr(x, "columns"):  # pandas.DataFrame
        x = x["prompt" if "prompt" in x.columns else x.columns[0]]
    if hasattr(x, "tolist"):  # Series, numpy array
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [p for item in x for p in prompts(item)]
    return [str(x)]


def script() -> str:
    """The file MLflow runs to build the model on load ("models from code"): no pickle."""
    return ("# An mllm checkpoint behind MLflow's pyfunc: see tasks/tracking/served_model.py.\n"
            "import mlflow\n\nfrom tasks.tracking.served_model import ServedModel\n\n"
            "mlflow.models.set_model(ServedModel())\n")
