"""The registered model as MLflow serves it: an mllm checkpoint behind the pyfunc interface.

This module and the `mllm` package are the only code packaged with a registered model, so it
imports nothing but mlflow, pandas and mllm: `models:/NAME@champion` loads, and `mlflow models
serve` answers, where neither Prefect nor the rest of this project is installed.
"""

from __future__ import annotations

import ast
import logging
import os
import re
from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.exceptions import MlflowException

# The most new tokens one request may ask for, unless the server's environment sets another
# bound; a run whose own samples are longer allows those.
MAX_NEW_TOKENS = 1024
MAX_NEW_TOKENS_VAR = "MLLM_SERVE_MAX_NEW_TOKENS"


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
        self.max_new_tokens = max_new_tokens_bound(self.loaded.config.sample.max_new_tokens)
        refuse_unknown_params()

    def predict(self, context, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list[str]:
        from mllm import UserError
        from mllm.sample import answer

        try:
            check_params(self.loaded, params or {}, self.max_new_tokens)
            return answer(self.loaded, prompts(model_input), **(params or {}))
        except UserError as e:
            # MLflow's scoring server answers an MlflowException with its message and code alone
            # (400 for this one); any other exception it answers with the traceback beside.
            raise MlflowException.invalid_parameter_value(str(e)) from None


def max_new_tokens_bound(own: int) -> int:
    """The served model's bound on max_new_tokens: the setting (or its default), or the run's own
    sample.max_new_tokens when that is larger, so that a request without the parameter passes."""
    given = os.environ.get(MAX_NEW_TOKENS_VAR, "").strip()
    if not given:
        return max(MAX_NEW_TOKENS, own)
    if not given.isdigit() or int(given) < 1:
        raise MlflowException.invalid_parameter_value(f"{MAX_NEW_TOKENS_VAR}={given!r}: give a whole number of "
                                                      "tokens, 1 or more")
    return max(int(given), own)


def check_params(loaded: Any, params: dict[str, Any], max_new_tokens: int) -> None:
    """Refuse a request's parameter outside what it may be, by its name in the request. (MLflow
    has checked their types and filled in the defaults from the signature.)"""
    from mllm import UserError
    from mllm.families.base import family_of

    family = family_of(loaded)
    method = params.get("method")
    if method is not None and family.methods and method not in family.methods:
        raise UserError(f"parameter method {method!r}: {family.a_model} samples with {', '.join(family.methods)}")
    allowed = {"max_new_tokens": (lambda v: 1 <= v <= max_new_tokens,
                                  (f"a whole number from 1 to {max_new_tokens} (this server's bound: "
                                   f"{MAX_NEW_TOKENS_VAR} sets it)")),
               "temperature": (lambda v: v > 0, "a number above 0"),
               "top_k": (lambda v: v >= 1, "a whole number, 1 or more"),
               "top_p": (lambda v: 0 < v <= 1, "a number above 0 and at most 1"),
               "beam_width": (lambda v: v >= 1, "a whole number, 1 or more"),
               "neighbours": (lambda v: v >= 1, "a whole number, 1 or more")}
    for name, (ok, what) in allowed.items():
        if params.get(name) is not None and not ok(params[name]):
            raise UserError(f"parameter {name} {params[name]!r}: give {what}")


class _UnknownParams(logging.Filter):
    """MLflow drops a request's parameter that the model's signature lacks before the model sees
    the request, saying so only in the server's log (`_enforce_params_schema` in
    mlflow/models/utils.py, MLflow 3.17): that warning becomes the request's answer, a 400.
    (A server whose MLflow logging is set above WARNING never makes the record: there MLflow's
    silence stands. tests/tasks/test_tracking.py fails if MLflow changes the warning's words.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        unknown = re.match(r"Unrecognized params (\[.*?\]) are ignored", text)
        known = re.search(r"Supported params are: (\{.*?\}|set\(\))", text)
        if unknown and known:
            names = sorted(ast.literal_eval(unknown.group(1)))
            takes = sorted(ast.literal_eval(known.group(1))) if known.group(1) != "set()" else []
            raise MlflowException.invalid_parameter_value(
                f"unknown parameter{'s' if len(names) > 1 else ''} {', '.join(names)}: this model takes "
                f"{', '.join(takes) or 'none'}")
        return True


def refuse_unknown_params() -> None:
    """An unknown parameter refused rather than ignored, in this process (once)."""
    log = logging.getLogger("mlflow.models.utils")
    if not any(type(f).__name__ == _UnknownParams.__name__ for f in log.filters):
        log.addFilter(_UnknownParams())


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
