"""A sweep's grid: `--grid FIELD=v1,v2,...` parsed, its points expanded and each resolved to a
config before anything runs, so a bad field or value stops the sweep with one line."""

from __future__ import annotations

import itertools
from typing import Annotated, Any

from pydantic import BeforeValidator

from flows.sweep.table import label
from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.resolve import NO_OVERRIDES, Overrides, field_value, resolve

NO_GRID = "give at least one --grid FIELD=v1,v2,... (e.g. --grid train.lr=1e-3,3e-3)"


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`--grid FIELD=v1,v2,...` options -> {field: [raw value, ...]}, in the order given. The
    values stay as written: each becomes a `--set FIELD=value`, which parses it as YAML."""
    if not items:
        raise UserError(NO_GRID)
    grid: dict[str, list[str]] = {}
    for item in items:
        field, text = field_value(item, "--grid", "FIELD=v1,v2,... (e.g. train.lr=1e-3,3e-3)")
        if field in grid:
            raise UserError(f"--grid {field} is given twice: give each field once, with all its values")
        values = split_values(text)
        if not text.strip() or any(not v for v in values):
            raise UserError(f"--grid {item!r} has an empty value: give values separated by commas, e.g. {field}=1,2")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise UserError(f"--grid {field} lists {repeated[0]!r} twice: give each value once")
        grid[field] = values
    return grid


def split_values(text: str) -> list[str]:
    """Split on the commas outside brackets and quotes, so a value may be a YAML list
    (`sample.methods=[greedy],[top-p, greedy]`)."""
    values, depth, quote, current = [], 0, "", []
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(c)
    values.append("".join(current).strip())
    return values


def expand(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every point of the grid, the first field varying slowest."""
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def _grid_of(value: Any) -> Any:
    return parse_grid(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value


# A flow's grid parameter: the parsed grid; `--grid` texts (a script's, a test's) are parsed on the way in.
Grid = Annotated[dict[str, list[str]], BeforeValidator(_grid_of)]


def without_credentials(grid: dict[str, list[str]]) -> dict[str, list[str]]:
    """A URL among the values (several sources, say) with its password kept in memory only, as --source's."""
    return {field: [storage.hide_credentials(v) for v in values] for field, values in grid.items()}


def resolve_points(
    recipe: str, grid: dict[str, list[str]], overrides: Overrides = NO_OVERRIDES, source: str | list[str] | None = None
) -> list[RunConfig]:
    """The config of every point, or a UserError naming the first point that does not validate,
    a field that is in both --set and --grid, or two points that are the same config."""
    for field in grid:
        if field in overrides.fields:
            raise UserError(f"{field} is in both --set and --grid: give it in one of them")
    cfgs, seen = [], {}
    for point in expand(grid):
        try:
            cfg = resolve(recipe, overrides=overrides.with_values(point), source=source)
        except UserError as e:
            raise UserError(f"--grid point {label(point)}: {e}") from None
        same = seen.setdefault(cfg.to_yaml(paths=False), label(point))
        if same != label(point):
            raise UserError(f"--grid points {same} and {label(point)} are the same config: give values that differ")
        cfgs.append(cfg)
    return cfgs
