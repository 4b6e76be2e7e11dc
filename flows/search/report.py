"""A search's table, plots and best recipe: pure functions of its trials (`flows/search/flow.py`
records them in storage, MLflow and Prefect; the CLI prints `text_table`)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from flows.search.space import Dim
from flows.sweep.table import direction
from mllm.config import RunConfig


class TrialOutcome(BaseModel):
    number: int
    params: dict[str, str]
    state: str  # complete | pruned | failed | running | waiting
    value: float | None = None  # the headline, of a complete trial
    step: int | None = None  # the step its training reached
    val_loss: float | None = None  # the last val loss reported
    mlflow_run_id: str | None = None
    resumes: int | None = None  # the trial whose process died, resumed by this one
    resumed_by: int | None = None
    resumed_from_step: int | None = None
    error: str | None = None


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _state(o: TrialOutcome) -> str:
    return f"failed (resumed by trial {o.resumed_by})" if o.resumed_by is not None else o.state


def table_rows(space: dict[str, Dim], outcomes: list[TrialOutcome]) -> list[dict[str, Any]]:
    return [
        {
            "trial": o.number,
            **{f: o.params.get(f) for f in space},
            "state": _state(o),
            "value": o.value,
            "step": o.step,
            "val_loss": o.val_loss,
            "resumes": o.resumes,
            "resumed_from_step": o.resumed_from_step,
            "mlflow_run_id": o.mlflow_run_id,
            "error": o.error,
        }
        for o in outcomes
    ]


def markdown_table(
    recipe: str,
    study: str,
    headline: str,
    higher: bool,
    space: dict[str, Dim],
    outcomes: list[TrialOutcome],
    best: TrialOutcome | None,
    parent_id: str,
) -> str:
    lines = [
        f"# Search of {recipe}: {headline} ({direction(higher)})",
        "",
        f"Study `{study}`; parent MLflow run `{parent_id}`; plots `history.png`, `params.png`.",
        "",
        "Space: " + ", ".join(f"`{f}={d.spec}`" for f, d in space.items()),
        "",
    ]
    if best is not None:
        lines += [
            f"Best: trial {best.number}, {headline} {best.value:.4f} ("
            + ", ".join(f"{f}={v}" for f, v in best.params.items())
            + "); its recipe: `best.yaml`.",
            "",
        ]
    lines += [
        "| trial | " + " | ".join([*space, "state", headline, "step", "val loss", "MLflow run"]) + " |",
        "|" + "---|" * (len(space) + 6),
    ]
    for o in outcomes:
        state = _state(o) if o.state != "failed" or o.resumed_by is not None else f"**failed**: {o.error}"
        lines.append(
            "| "
            + " | ".join(
                [
                    str(o.number),
                    *(o.params.get(f, "-") for f in space),
                    state.replace("|", "/"),
                    _num(o.value),
                    "-" if o.step is None else str(o.step),
                    _num(o.val_loss),
                    f"`{o.mlflow_run_id}`" if o.mlflow_run_id else "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def text_table(headline: str, outcomes: list[TrialOutcome]) -> str:
    """For a terminal: trial, its values, state, headline, the step reached, MLflow run."""
    rows = [("trial", "values", "state", headline, "step", "mlflow run")]
    rows += [
        (
            str(o.number),
            " ".join(f"{f}={v}" for f, v in o.params.items()),
            _state(o),
            _num(o.value),
            "-" if o.step is None else str(o.step),
            o.mlflow_run_id or "-",
        )
        for o in outcomes
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def best_recipe(cfg: RunConfig, study: str, best: TrialOutcome, headline: str) -> str:
    """The best trial's whole config as a recipe file: `mllm-pipeline run --recipe best.yaml`."""
    head = (
        f"# The best trial ({best.number}) of study {study}: {headline} {best.value:.4f}.\n"
        f"# Its values: {', '.join(f'{f}={v}' for f, v in best.params.items())}.\n"
        "# Train it again: mllm-pipeline run --recipe best.yaml\n"
    )
    return head + cfg.to_yaml(paths=False)


def _number(text: str) -> float | None:
    value = yaml.safe_load(text)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def history_figure(recipe: str, headline: str, higher: bool, outcomes: list[TrialOutcome]) -> Any:
    """Each complete trial's headline by trial number, the best so far as a step line, and a mark
    on the axis for each pruned or failed trial."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no GUI

    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.subplots()
    done = [o for o in outcomes if o.state == "complete"]
    if done:
        xs, ys = [o.number for o in done], [o.value for o in done]
        ax.plot(xs, ys, "o", label="complete")
        best, line = None, []
        for y in ys:
            best = y if best is None or (y > best) == higher else best
            line.append(best)
        ax.step(xs, line, where="post", label="best so far")
    for state, marker in (("pruned", "x"), ("failed", "v")):
        stopped = [o.number for o in outcomes if o.state == state and o.resumed_by is None]
        if stopped:
            ax.plot(
                stopped,
                [0] * len(stopped),
                marker,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
                label=f"{state} (no {headline})",
            )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{headline} ({direction(higher)})")
    ax.set_title(f"{recipe}: optimisation history")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def params_figure(headline: str, space: dict[str, Dim], outcomes: list[TrialOutcome]) -> Any:
    """The headline against each field's value, one panel a field: complete trials as dots, pruned
    ones at the bottom of the panel where they stopped."""
    from matplotlib.figure import Figure

    fields = list(space)
    fig = Figure(figsize=(4 * len(fields), 4), dpi=100)
    axes = fig.subplots(1, len(fields), squeeze=False)[0]
    for ax, field in zip(axes, fields):
        dim = space[field]
        numeric = not dim.choices or all(_number(v) is not None for v in dim.choices)
        order = {v: i for i, v in enumerate(dim.choices)}

        def x(
            trials: list[TrialOutcome], field: str = field, numeric: bool = numeric, order: dict[str, int] = order
        ) -> list[float]:
            values = [o.params.get(field, "") for o in trials]
            return [_number(v) if numeric else float(order.get(v, -1)) for v in values]

        done = [o for o in outcomes if o.state == "complete" and field in o.params]
        ax.plot(x(done), [o.value for o in done], "o", label="complete")
        pruned = [o for o in outcomes if o.state == "pruned" and field in o.params]
        if pruned:
            ax.plot(
                x(pruned), [0] * len(pruned), "x", transform=ax.get_xaxis_transform(), clip_on=False, label="pruned"
            )
        if dim.log or (
            numeric
            and dim.choices
            and min(_number(v) for v in dim.choices) > 0
            and max(_number(v) for v in dim.choices) / min(_number(v) for v in dim.choices) >= 10
        ):
            from matplotlib.ticker import NullFormatter

            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # the decades only: minor labels overlap
        if not numeric:
            ax.set_xticks(range(len(dim.choices)), dim.choices)
        ax.set_xlabel(field)
        ax.set_ylabel(headline)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    return fig
