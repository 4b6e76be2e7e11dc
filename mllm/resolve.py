"""From a recipe or a config file, plus `--source` and `--set key=value`, to the RunConfig.

Recipes are the YAML files in `mllm/recipes/`; a config file is the same tree (a run's own
`config.yaml`). `--set` items are parsed once into `Overrides`; a value is parsed as YAML when
applied, except in text fields, so that it is what a user means: `train.lr=3e-4` a float,
`data.sha256=0123...` text.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, RootModel, ValidationError, model_serializer, model_validator

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


# --- overrides: FIELD=VALUE ------------------------------------------------------------------

SET_FORM = "section.field=value, e.g. train.lr=3e-4"


def field_value(item: str, option: str, form: str, dotted: bool = True) -> tuple[str, str]:
    """The one parser of FIELD=VALUE (`--set`, `--space`, `--grid`, `--tag`): the field, stripped,
    and the value's text as written; a malformed item is one line that names it and its form."""
    field, sep, text = item.partition("=")
    field = field.strip()
    if not sep or not field or (dotted and any(not part for part in field.split("."))):
        raise UserError(f"malformed {option} {item!r}: write it as {form}")
    return field, text


class Setting(BaseModel):
    """One override: a field's dotted name and its value as written, which is parsed as YAML when
    applied. Its JSON form is the `FIELD=VALUE` text (a Prefect deployment's form, a run's record)."""

    model_config = ConfigDict(frozen=True)

    field: str
    text: str

    @model_validator(mode="before")
    @classmethod
    def _from_item(cls, item: Any) -> Any:
        if isinstance(item, str):
            field, text = field_value(item, "override", SET_FORM)
            return {"field": field, "text": text}
        return item

    @model_serializer
    def _as_item(self) -> str:
        return self.item

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        return {"type": "string", "title": "FIELD=VALUE", "examples": ["train.lr=3e-4"]}

    @property
    def item(self) -> str:
        return f"{self.field}={self.text}"

    def value(self, text_field: bool) -> Any:
        """The value: YAML (3e-4, true, [a, b], null), or the text as written in a text field (a
        sha256 of digits stays text)."""
        try:
            value = yaml.safe_load(self.text) if self.text.strip() else ""
        except yaml.YAMLError:
            value = self.text
        if text_field and not isinstance(value, str) and value is not None:
            value = self.text.strip()
        return value


class Overrides(RootModel[tuple[Setting, ...]]):
    """The `--set` overrides in the order given (a later one of a field wins), parsed once where
    they come in (`parse`), and handed on typed down to `resolve`. Its JSON form is the list of
    `FIELD=VALUE` texts, which Prefect stores as a flow's parameter and validates back."""

    model_config = ConfigDict(frozen=True)

    # Not iterable: Prefect walks a parameter's model as dict(model), which an __iter__ of its own
    # would break; `root` holds the settings.
    root: tuple[Setting, ...] = ()

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        # A deployment's form: a list of texts, which the server checks a run's parameters against.
        return {"type": "array", "items": Setting.__get_pydantic_json_schema__(None, None), "default": []}

    @classmethod
    def parse(cls, items: Iterable[str] | Overrides | None, option: str = "--set") -> Overrides:
        """`FIELD=VALUE` texts as overrides; a malformed one names `option` and the form."""
        if isinstance(items, Overrides):
            return items
        return cls(tuple(Setting(field=f, text=t) for f, t in (field_value(i, option, SET_FORM) for i in items or ())))

    def __len__(self) -> int:
        return len(self.root)

    def __add__(self, other: Overrides) -> Overrides:
        return Overrides(self.root + other.root)

    def with_values(self, values: Mapping[str, str]) -> Overrides:
        """These overrides, then one for each field of `values` (a sweep's point, a trial's draw)."""
        return self + Overrides(tuple(Setting(field=f, text=str(v)) for f, v in values.items()))

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(s.field for s in self.root)

    def items(self) -> list[str]:
        """The `FIELD=VALUE` texts, in order."""
        return [s.item for s in self.root]

    def without_credentials(self) -> Overrides:
        """The values with any user:password taken out of URLs (kept in this process's memory for
        the download): what goes on to Prefect's parameters and the run's record holds none."""
        return Overrides(tuple(Setting(field=s.field, text=storage.hide_credentials(s.text)) for s in self.root))


# No overrides: the default of a parameter that takes some (immutable, so one for all).
NO_OVERRIDES = Overrides()


def apply_overrides(data: dict[str, Any], overrides: Overrides | Iterable[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides to a config tree (`Setting.value` says how a value is read)."""
    text = _text_fields()
    for s in Overrides.parse(overrides, "override").root:
        node = data
        parts = s.field.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"override {s.item!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = s.value(s.field in text)
    return data


def resolve(
    recipe: str | None = None,
    config_file: str | None = None,
    overrides: Overrides | Iterable[str] = (),
    source: str | list[str] | None = None,
) -> RunConfig:
    """The resolved tree: a recipe or a file, then `--source`, then `--set` overrides (`FIELD=VALUE`
    texts are parsed here for a caller that has them so, a test or a script)."""
    overrides = Overrides.parse(overrides, "override")
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
    data = apply_overrides(data, overrides)
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


def recipe_file_overrides(recipe: str, sets: Overrides) -> tuple[str, Overrides]:
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
    diff = {
        k: json.dumps(v) for k, v in flat_fields(data).items() if base.get(k, object()) != v and k not in sets.fields
    }
    return name, Overrides().with_values(diff) + sets
