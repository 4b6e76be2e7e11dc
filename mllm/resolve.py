"""From a recipe or a config file, plus `--source` and `--set key=value`, to the RunConfig.

Recipes are the YAML files in `mllm/recipes/`; a config file is the same tree (a run's own
`config.yaml`). Overrides are parsed as YAML except in text fields, so a value is what a user
means: `train.lr=3e-4` a float, `data.sha256=0123...` text.
"""

from __future__ import annotations

import json
import os
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ValidationError

from mllm import UserError, storage
from mllm.config import DEFAULT_ARCH, SECTIONS, RunConfig, archs, section_of

# A recipe's section for the orchestration layer (flows/): read there, never by mllm.
LAUNCH_SECTION = "pipeline"


def recipe_names() -> list[str]:
    folder = resources.files("mllm") / "recipes"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def recipe_dict(name: str) -> dict[str, Any]:
    path = resources.files("mllm") / "recipes" / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown recipe {name!r}: choose one of {', '.join(recipe_names())}")
    data = yaml.safe_load(path.read_text()) or {}
    data.setdefault("recipe", name)
    return data


def load_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path} not found: give the path of a YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of sections (data, model, train)")
    return data


def _text_fields(model: type[BaseModel] = None, prefix: str = "") -> set[str]:
    """Dotted names of the fields that hold free text (a source URL, a sha256, a device)."""
    model = model or RunConfig
    names = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        if typing.get_origin(ann) is Annotated:
            ann = typing.get_args(ann)[0]
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        inner = [a for a in typing.get_args(ann) if a is not type(None)] if union else []
        if ann is str or inner == [str]:
            names.add(prefix + name)
        for t in [ann, *inner]:
            if isinstance(t, type) and issubclass(t, BaseModel):
                names |= _text_fields(t, f"{prefix}{name}.")
    return names


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides. Values are parsed as YAML (3e-4, true, [a, b], null),
    except for text fields, which take the value as written (a sha256 of digits stays text)."""
    text = _text_fields()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserError(f"malformed override {item!r}: write it as section.field=value, e.g. train.lr=3e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if key in text and not isinstance(value, str) and value is not None:
            value = raw.strip()
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"override {item!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def resolve(
    recipe: str | None = None,
    config_file: str | None = None,
    overrides: list[str] = (),
    source: str | list[str] | None = None,
) -> RunConfig:
    """The resolved tree: a recipe or a file, then `--source`, then `--set` overrides."""
    if config_file:
        data, where = load_file(config_file), str(config_file)
    else:
        data, where = recipe_dict(recipe or "default"), f"recipe {recipe or 'default'}"
    # How the pipeline launches a recipe (its default work pool) is not what the run is.
    data.pop(LAUNCH_SECTION, None)
    if isinstance(source, list) and len(source) < 2:  # one --source is a source, as it always was
        source = source[0] if source else None
    if source:
        data.setdefault("data", {})["source"] = source
        if isinstance(data["data"].get("pairs"), dict):
            data["data"]["pairs"].pop("numbers", None)  # a TSV source replaces the numbers corpus
    data = apply_overrides(data, list(overrides))
    cfg = validate(data, where if not overrides else f"{where} with --set")
    # A password in the source URL stays in this process's memory, out of the config that is
    # logged, stored with every checkpoint and sent to MLflow.
    src = cfg.data.source
    cfg.data.source = (
        absolute_source(storage.hide_credentials(src))
        if isinstance(src, str)
        else [absolute_source(storage.hide_credentials(x)) for x in src]
    )
    return cfg


def absolute_source(source: str) -> str:
    """A local path as an absolute one (a URL as it is): the config is the run's record (its
    config.yaml, MLflow's params), and `reproduce` runs it from another folder. No stage's key
    holds the path: the data is keyed by the digests of its bytes."""
    if not source or "://" in source:
        return source
    return os.path.abspath(source)


def validate(data: dict[str, Any], where: str) -> RunConfig:
    """Build a RunConfig and check that its sections fit its model's family, turning what is wrong
    into one line that names the field."""
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = list(first["loc"])
        tag = None
        if loc[:1] == ["model"] and len(loc) > 2 and section_of(str(loc[1])):
            tag = str(loc.pop(1))  # pydantic names the union member by its tag: not a field
        model = data.get("model") if isinstance(data, dict) else None
        arch = model.get("arch", DEFAULT_ARCH) if isinstance(model, dict) else DEFAULT_ARCH
        field = ".".join(str(p) for p in loc) or "config"
        msg = first["msg"]
        if first["type"] == "extra_forbidden" and tag:
            family, section = tag, section_of(tag)
            others = [name for name, s in SECTIONS.items() if loc[-1] in s.model_fields]
            fields = ", ".join(f for f in section.model_fields if f not in ("arch", "family"))
            kinds = f"{' and '.join(others)} famil{'ies' if len(others) > 1 else 'y'}"
            msg = (
                f"a field of the {kinds}, not of arch {arch}" if others else f"unknown field for arch {arch}"
            ) + f" (the {family} family's fields: {fields})"
        elif first["type"] == "extra_forbidden":
            msg = "unknown field (check its spelling against a recipe)"
        elif first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            field, msg = "model.arch", f"choose one of {', '.join(archs())}"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise UserError(f"{where}: {field}: {msg}{more}") from None
    # Imported here: mllm.families.base brings torch (2.4 s measured), which `mllm-pipeline --help` and
    # a recipe's listing have no use for.
    from mllm.families.base import check_run

    try:
        check_run(cfg)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    return cfg


# --- a recipe file ---------------------------------------------------------------------------------


def is_recipe_file(recipe: str) -> bool:
    return recipe not in recipe_names() and (recipe.endswith((".yaml", ".yml")) or os.path.isfile(recipe))


def flat_fields(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as its dotted fields: {"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat_fields(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def recipe_file_overrides(recipe: str, sets: list[str]) -> tuple[str, list[str]]:
    """(recipe name, overrides) for a recipe argument that may be a file (a search's `best.yaml`, a
    run's `config.yaml`): the shipped recipe it names plus a --set for each field where it
    differs, so that its run is the run of `--recipe NAME --set ...` (the same experiment, config,
    training key and Prefect parameters). --set still wins."""
    if not is_recipe_file(recipe):
        return recipe, sets
    data = load_file(recipe)
    name = data.get("recipe")
    if name not in recipe_names():
        raise UserError(
            f"recipe file {recipe} names recipe {name!r}, not a shipped one: set its `recipe:` to one of "
            f"{', '.join(recipe_names())}"
        )
    data.pop("recipe")
    base = flat_fields(resolve(name).to_dict())
    fixed = {s.partition("=")[0].strip() for s in sets}
    diff = [
        f"{k}={json.dumps(v)}" for k, v in flat_fields(data).items() if base.get(k, object()) != v and k not in fixed
    ]
    return name, [*diff, *sets]
