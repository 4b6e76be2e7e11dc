"""`--recipe FILE`: a recipe file (a search's `best.yaml`, a run's `config.yaml`) as the shipped
recipe it names plus the fields where it differs, so that its run is the run of
`--recipe NAME --set FIELD=VALUE ...`: the same experiment, config, training key and Prefect
parameters (the pipeline flow takes a shipped recipe's name, which its UI form offers as a choice)."""

from __future__ import annotations

import json
import os
from typing import Any

from mllm import UserError
from mllm.resolve import load_file, recipe_names, resolve


def is_file(recipe: str) -> bool:
    return recipe not in recipe_names() and (recipe.endswith((".yaml", ".yml")) or os.path.isfile(recipe))


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def as_overrides(recipe: str, sets: list[str]) -> tuple[str, list[str]]:
    """(recipe name, overrides) for a recipe argument that may be a file; --set still wins."""
    if not is_file(recipe):
        return recipe, sets
    data = load_file(recipe)
    name = data.get("recipe")
    if name not in recipe_names():
        raise UserError(f"recipe file {recipe} names recipe {name!r}, not a shipped one: set its `recipe:` to one of "
                        f"{', '.join(recipe_names())}")
    data.pop("recipe")
    base = _leaves(resolve(name).to_dict())
    fixed = {s.partition("=")[0].strip() for s in sets}
    diff = [f"{k}={json.dumps(v)}" for k, v in _leaves(data).items() if base.get(k, object()) != v and k not in fixed]
    return name, [*diff, *sets]
