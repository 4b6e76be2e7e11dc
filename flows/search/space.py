"""A search's space: `--space FIELD=SPEC` options parsed and checked against the recipe, before
anything runs (`flows/search/flow.py` samples it with Optuna)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import BeforeValidator

from flows.sweep.points import split_values
from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.resolve import NO_OVERRIDES, Overrides, field_value, resolve

EXAMPLE = "e.g. --space train.lr=log:1e-4..1e-2 or --space model.n_layer=1,2,3"
NO_SPACE = f"give at least one --space FIELD=SPEC ({EXAMPLE})"


@dataclass(frozen=True)
class Dim:
    """One field's values: a list (`choices`), or a range from `low` to `high`."""

    field: str
    choices: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    integer: bool = False

    @property
    def spec(self) -> str:
        """The SPEC as the user would write it, in one canonical form (the study's name digests it)."""
        if self.choices:
            return ",".join(self.choices)
        prefix = ("int:" if self.integer else "") + ("log:" if self.log else "")
        return f"{prefix}{self._num(self.low)}..{self._num(self.high)}"

    def _num(self, x: float) -> str:
        return str(int(x)) if self.integer else repr(float(x))

    def edges(self) -> list[str]:
        """The values that check the field against the recipe: every choice, or both ends."""
        return list(self.choices) or [self._num(self.low), self._num(self.high)]

    def suggest(self, trial: Any) -> str:
        """This field's value for an Optuna trial, as the text of a `--set FIELD=value`."""
        if self.choices:
            return trial.suggest_categorical(self.field, list(self.choices))
        if self.integer:
            return str(trial.suggest_int(self.field, int(self.low), int(self.high), log=self.log))
        return repr(trial.suggest_float(self.field, self.low, self.high, log=self.log))


def parse_space(items: list[str]) -> dict[str, Dim]:
    if not items:
        raise UserError(NO_SPACE)
    texts: dict[str, str] = {}
    for item in items:
        field, text = field_value(item, "--space", f"FIELD=SPEC ({EXAMPLE})")
        if field in texts:  # first: each of two one-value --space of a field is no mistake of its own
            raise UserError(f"--space {field} is given twice: give each field once")
        texts[field] = text.strip()
    return {field: parse_spec(field, text) for field, text in texts.items()}


def parse_spec(field: str, text: str) -> Dim:
    where = f"--space {field}={text}"
    if ".." not in text:
        values = split_values(text)
        if not text or any(not v for v in values):
            raise UserError(f"{where} has an empty value: give values separated by commas, or a range LOW..HIGH")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise UserError(f"{where} lists {repeated[0]!r} twice: give each value once")
        if len(values) == 1:  # every trial would be the same: one training, counted --trials times
            raise UserError(
                f"{where} has one value: nothing to search; give two or more ({field}={text},...) or a "
                f"range (LOW..HIGH), or fix the field with --set {field}={text}"
            )
        return Dim(field, choices=tuple(values))
    kinds, _, bounds = text.rpartition(":")
    words = [w.strip() for w in kinds.split(":")] if kinds else []
    unknown = [w for w in words if w not in ("log", "int")]
    if unknown:
        raise UserError(f"{where}: unknown range kind {unknown[0]!r}: write LOW..HIGH, log:LOW..HIGH or int:LOW..HIGH")
    integer, log = "int" in words, "log" in words
    low_text, _, high_text = (b.strip() for b in bounds.partition(".."))
    number = int if integer else float
    try:
        low, high = number(low_text), number(high_text)
    except ValueError:
        kind = "integers" if integer else "numbers"
        raise UserError(
            f"{where}: the ends of a range must be {kind}: write LOW..HIGH, e.g. "
            f"{'int:64..512' if integer else '1e-4..1e-2'}"
        ) from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise UserError(f"{where}: the ends of a range must be finite numbers")
    if low >= high:
        raise UserError(f"{where}: the low end {low_text} is not below the high end {high_text}: write LOW..HIGH")
    if log and low <= 0:
        raise UserError(f"{where}: a log: range needs both ends above 0 (the low end is {low_text})")
    return Dim(field, low=low, high=high, log=log, integer=integer)


def _space_of(value: Any) -> Any:
    return parse_space(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value


# A flow's space parameter: the parsed space; `--space` texts (a script's, a test's) are parsed on the way in.
Space = Annotated[dict[str, Dim], BeforeValidator(_space_of)]


def without_credentials(space: dict[str, Dim]) -> dict[str, Dim]:
    """A URL among a field's choices with its password kept in memory only, as --source's."""
    return {
        field: replace(dim, choices=tuple(storage.hide_credentials(c) for c in dim.choices))
        for field, dim in space.items()
    }


def check_space(
    recipe: str, space: dict[str, Dim], overrides: Overrides = NO_OVERRIDES, source: str | list[str] | None = None
) -> RunConfig:
    """The recipe's config with the fixed overrides, after checking every choice and both ends of
    every range against it: an unknown field, a value of the wrong type, a field of another
    family, a field fixed by --set too: one line naming it."""
    base = resolve(recipe, overrides=overrides, source=source)
    for field, dim in space.items():
        if field in overrides.fields:
            raise UserError(f"{field} is in both --set and --space: give it in one of them")
        for value in dim.edges():
            try:
                resolve(recipe, overrides=overrides.with_values({field: value}), source=source)
            except UserError as e:
                raise UserError(f"--space {field}={dim.spec}: {e}") from None
    return base


def study_name(recipe: str, space: dict[str, Dim], overrides: Overrides, base: RunConfig) -> str:
    """Named by what it searches: the recipe, the space, the fixed fields and the data (the base
    config's data section names the source). The same command names the same study."""
    digest = storage.digest(
        [recipe, {f: d.spec for f, d in space.items()}, sorted(overrides.items()), base.data.model_dump(mode="json")]
    )
    return f"{recipe}-{digest[:10]}"


def space_text(space: dict[str, Dim]) -> str:
    """The space as one line, stored with the study: a study of the same name but another space is refused."""
    return " ".join(f"{f}={d.spec}" for f, d in sorted(space.items()))
