"""The registered model as MLflow serves it: an mllm checkpoint behind the pyfunc interface."""

from __future__ import annotations

import ast
import logging
import re
import sys
from typing import Any

# This module and `mllm` are the only code packaged with a registered model, so it imports nothing
# but mlflow, pandas and mllm: `models:/NAME@champion` loads, and `mlflow models serve` answers,
# where neither Prefect nor the rest of this project is installed.
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
        plain_refusals(self.max_new_tokens)

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        from mllm import UserError
        from mllm.sample import answer, prompt_losses

        params = dict(params or {})
        drop = params.pop(DROP, False)
        try:
            check_params(self.loaded, params, self.max_new_tokens)
            texts = prompts(model_input)
            # The answer has no room for a warning beside the texts: a prompt that would lose
            # characters is refused, unless the request says to sample from what is left.
            if not drop and (lost := prompt_losses(self.loaded, texts)):
                raise UserError(
                    f"{lost[0]}: leave them out, or send the parameter {DROP}: true to sample from what is left"
                )
            return answer(self.loaded, texts, **params)
        except UserError as e:
            # MLflow's scoring server answers an MlflowException with its message and code alone
            # (400 for this one); any other exception it answers with the traceback beside.
            raise MlflowException.invalid_parameter_value(str(e)) from None


# The parameter that lets a prompt lose the characters its model's corpus was normalised without.
DROP = "drop_unsupported"


def max_new_tokens_bound(own: int) -> int:
    """The served model's bound on max_new_tokens: the setting (or its default), or the run's own
    sample.max_new_tokens when that is larger, so that a request without the parameter passes."""
    from mllm import UserError
    from mllm.settings import settings

    try:
        given = settings().serve_max_new_tokens
    except UserError as e:
        raise MlflowException.invalid_parameter_value(str(e)) from None
    return max(MAX_NEW_TOKENS if given is None else given, own)


def check_params(loaded: Any, params: dict[str, Any], max_new_tokens: int) -> None:
    """Refuse a request's parameter outside what it may be, by its name in the request. (MLflow
    has checked their types and filled in the defaults from the signature.)"""
    from mllm import UserError
    from mllm.families.base import family_of

    family = family_of(loaded)
    method = params.get("method")
    if method is not None and family.methods and method not in family.methods:
        raise UserError(f"parameter method {method!r}: {family.a_model} samples with {', '.join(family.methods)}")
    for name, (ok, what) in bounds(max_new_tokens).items():
        if params.get(name) is not None and ok is not None and not ok(params[name]):
            raise UserError(f"parameter {name} {params[name]!r}: give {what}")


def bounds(max_new_tokens: int) -> dict[str, tuple[Any, str]]:
    """Each parameter's test (None: its type says all) and what it may be, in a user's words."""
    return {
        "max_new_tokens": (
            lambda v: 1 <= v <= max_new_tokens,
            (f"a whole number from 1 to {max_new_tokens} (this server's bound: {MAX_NEW_TOKENS_VAR} sets it)"),
        ),
        "temperature": (lambda v: v > 0, "a number above 0"),
        "top_k": (lambda v: v >= 1, "a whole number, 1 or more"),
        "top_p": (lambda v: 0 < v <= 1, "a number above 0 and at most 1"),
        "beam_width": (lambda v: v >= 1, "a whole number, 1 or more"),
        "neighbours": (lambda v: v >= 1, "a whole number, 1 or more"),
        "seed": (None, "a whole number"),
        "method": (None, "a sampling method's name"),
        "use_cache": (None, "true or false"),
        DROP: (None, "true or false"),
    }


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
                f"{', '.join(takes) or 'none'}"
            )
        return True


def refuse_unknown_params() -> None:
    """An unknown parameter refused rather than ignored, in this process (once)."""
    log = logging.getLogger("mlflow.models.utils")
    if not any(type(f).__name__ == _UnknownParams.__name__ for f in log.filters):
        log.addFilter(_UnknownParams())


def prompts(model_input: Any) -> list[str]:
    """Prompts from a DataFrame (its "prompt" column, else the first), a Series, a list, a
    dict or a str. MLflow turns {"prompt": [a, b]} into one row holding the list: unpack it.
    Anything but text is refused (`5` is no prompt "5", None no prompt "None")."""
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
    from mllm import UserError

    raise UserError(not_text(x))


def not_text(value: Any) -> str:
    return (
        f"the prompt {value!r} is not text ({type(value).__name__}): send each prompt as a string, "
        'e.g. {"inputs": ["The "]}'
    )


def _not_text(x: Any) -> list[Any]:
    """The values of a request's input that are not strings (a JSON null among them)."""
    if isinstance(x, str):
        return []
    if isinstance(x, dict):
        x = list(x.values())
    elif hasattr(x, "columns"):  # pandas.DataFrame
        x = x.to_numpy().ravel().tolist()
    elif hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [bad for item in x for bad in _not_text(item)]
    return [x]


def plain_refusals(max_new_tokens: int) -> None:
    """In this process, a request's input that is not text, and a parameter of the wrong type,
    answered by name in a user's words rather than MLflow's own (`Can not safely convert <class
    'str'> to DataType.long`, or the prompt 5 taken as "5"). MLflow checks both before the model
    sees the request (mlflow.pyfunc `_validate_prediction_input`; the scoring server converts the
    JSON's values to the signature's string first): those steps are wrapped, once.
    tests/tasks/test_tracking.py fails if MLflow renames them."""
    import mlflow.pyfunc as pyfunc
    from mlflow.types import ParamSpec

    _bounds.update(bounds(max_new_tokens))
    if getattr(pyfunc._validate_prediction_input, "_plain", False):
        return
    validate = pyfunc._validate_prediction_input

    def checked(data, params, input_schema, params_schema, flavor=None):
        if bad := _not_text(data):
            raise MlflowException.invalid_parameter_value(not_text(bad[0]))
        try:
            return validate(data, params, input_schema, params_schema, flavor)
        except MlflowException:
            for spec in params_schema.params if params_schema is not None and isinstance(params, dict) else []:
                if spec.name in params:
                    try:
                        ParamSpec.validate_param_spec(params[spec.name], spec)
                    except MlflowException:
                        what = _bounds.get(spec.name, (None, f"a value of type {spec.dtype}"))[1]
                        raise MlflowException.invalid_parameter_value(
                            f"parameter {spec.name} {params[spec.name]!r}: give {what}"
                        ) from None
            raise

    checked._plain = True
    pyfunc._validate_prediction_input = checked
    server = sys.modules.get("mlflow.pyfunc.scoring_server")
    if server is not None:  # `mlflow models serve`: the JSON's values, before they become strings
        parse = server.infer_and_parse_data

        def parsed(data, schema=None):
            if isinstance(data, dict):
                given = [data[k] for k in ("inputs", "instances", "dataframe_records") if k in data]
                if isinstance(data.get("dataframe_split"), dict):
                    given.append(data["dataframe_split"].get("data", []))
                if bad := _not_text(given):
                    raise MlflowException.invalid_parameter_value(not_text(bad[0]))
            return parse(data, schema)

        server.infer_and_parse_data = parsed


_bounds: dict[str, tuple[Any, str]] = {}


def script() -> str:
    """The file MLflow runs to build the model on load ("models from code"): no pickle."""
    return (
        "# An mllm checkpoint behind MLflow's pyfunc: see tasks/tracking/served_model.py.\n"
        "import mlflow\n\nfrom tasks.tracking.served_model import ServedModel\n\n"
        "mlflow.models.set_model(ServedModel())\n"
    )
