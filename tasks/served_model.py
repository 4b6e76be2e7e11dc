"""The registered model as MLflow serves it: an mllm checkpoint behind the pyfunc interface.

This module and the `mllm` package are the only code packaged with a registered model, so it
imports nothing but mlflow, pandas and mllm: `models:/NAME@champion` loads, and `mlflow models
serve` answers, where neither Prefect nor the rest of this project is installed.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import pandas as pd


class TextGenerator(mlflow.pyfunc.PythonModel):
    """A checkpoint as an MLflow model: prompts in, prompt + continuation out.

    `mlflow.pyfunc.load_model("models:/NAME@champion").predict(["The "], params={...})`.
    """

    def load_context(self, context) -> None:
        import torch

        from mllm.checkpoint import load_checkpoint

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.loaded = load_checkpoint(context.artifacts["checkpoint"], device=device)

    def predict(self, context, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list[str]:
        from mllm.sample import sample_text

        p = dict(params or {})
        method = p.pop("method", None) or self.loaded.config.sample.methods[0]
        return [sample_text(self.loaded, prompt, method, **p) for prompt in prompts(model_input)]


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


class NearestWords(mlflow.pyfunc.PythonModel):
    """A CBOW checkpoint as an MLflow model: words in, a line of nearest neighbours out.

    `mlflow.pyfunc.load_model("models:/cbow@champion").predict(["king"], params={"k": 5})`.
    """

    def load_context(self, context) -> None:
        from mllm.checkpoint import load_checkpoint
        from mllm.wordsim import WordVectors

        loaded = load_checkpoint(context.artifacts["checkpoint"])
        self.k = loaded.config.sample.neighbours
        self.words = WordVectors(loaded.vocab.itos, loaded.model.context_vectors().detach().numpy())

    def predict(self, context, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list[str]:
        from mllm import UserError
        from mllm.wordsim import missing_word

        k = int((params or {}).get("k") or self.k)
        out = []
        for word in prompts(model_input):
            if word not in self.words:
                raise UserError(missing_word(word, (t for t in self.words.tokens if t in self.words)))
            out.append(" ".join(t for t, _ in self.words.neighbours(word, k)))
        return out


class Translator(mlflow.pyfunc.PythonModel):
    """A sequence-to-sequence checkpoint as an MLflow model: sentences in, translations out.

    `mlflow.pyfunc.load_model("models:/NAME@champion").predict(["twenty-one"], params={"method": "beam"})`.
    """

    def load_context(self, context) -> None:
        import torch

        from mllm.checkpoint import load_checkpoint

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.loaded = load_checkpoint(context.artifacts["checkpoint"], device=device)

    def predict(self, context, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list[str]:
        from mllm.translate import translate_texts

        return translate_texts(self.loaded, prompts(model_input), **(params or {}))


def script(cls: type) -> str:
    """The file MLflow runs to build the model on load ("models from code"): no pickle."""
    return (f"# An mllm checkpoint behind MLflow's pyfunc: see tasks/served_model.py.\n"
            f"import mlflow\n\nfrom tasks.served_model import {cls.__name__}\n\n"
            f"mlflow.models.set_model({cls.__name__}())\n")
