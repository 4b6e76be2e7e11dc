"""A sweep's table and plot: pure functions of its points' outcomes (`flows/sweep/flow.py` records
them in storage, MLflow and Prefect; the CLI prints `text_table`)."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

import yaml
from pydantic import BaseModel


def label(point: dict[str, str]) -> str:
    return " ".join(f"{field}={value}" for field, value in point.items())


class PointOutcome(BaseModel):
    point: dict[str, str]
    ok: bool
    headline: str | None = None
    score: float | None = None
    higher_is_better: bool | None = None
    val_loss: float | None = None
    decision: str | None = None
    mlflow_run_id: str | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return label(self.point)


def headline_of(outcomes: list[PointOutcome]) -> tuple[str, bool | None]:
    done = [o for o in outcomes if o.ok]
    return (done[0].headline, done[0].higher_is_better) if done else ("headline", None)


def direction(higher_is_better: bool | None) -> str:
    return "" if higher_is_better is None else "higher is better" if higher_is_better else "lower is better"


def table_rows(grid: dict[str, list[str]], outcomes: list[PointOutcome]) -> list[dict[str, Any]]:
    return [
        {
            **o.point,
            "status": "ok" if o.ok else "failed",
            "headline": o.headline,
            "score": o.score,
            "higher_is_better": o.higher_is_better,
            "val_loss": o.val_loss,
            "decision": o.decision,
            "mlflow_run_id": o.mlflow_run_id,
            "error": o.error,
        }
        for o in outcomes
    ]


def csv_text(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def markdown_table(recipe: str, grid: dict[str, list[str]], outcomes: list[PointOutcome], parent_id: str) -> str:
    name, higher = headline_of(outcomes)
    lines = [
        f"# Sweep of {recipe}: {name} ({direction(higher)})",
        "",
        f"Parent MLflow run `{parent_id}`; the plot is its artifact `sweep.png`.",
        "",
        "| " + " | ".join([*grid, name, "val loss", "MLflow run"]) + " |",
        "|" + "---|" * (len(grid) + 3),
    ]
    for o in outcomes:
        score = _num(o.score) if o.ok else f"**failed**: {o.error}".replace("|", "/")
        lines.append(
            "| "
            + " | ".join(
                [*o.point.values(), score, _num(o.val_loss), f"`{o.mlflow_run_id}`" if o.mlflow_run_id else "-"]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def text_table(outcomes: list[PointOutcome]) -> str:
    """The table for a terminal: point, headline, val loss, MLflow run."""
    rows = [("point", headline_of(outcomes)[0], "val loss", "mlflow run")]
    rows += [(o.label, _num(o.score) if o.ok else "FAILED", _num(o.val_loss), o.mlflow_run_id or "-") for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _axis_values(values: list[str]) -> tuple[list[float], bool]:
    """Positions on the x axis: the values themselves when all are numbers, else their order."""
    parsed = [yaml.safe_load(v) for v in values]
    if all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parsed):
        return [float(p) for p in parsed], True
    return [float(i) for i in range(len(values))], False


def figure(recipe: str, grid: dict[str, list[str]], outcomes: list[PointOutcome]) -> Any:
    """The headline against the first field, one line per value of the other fields (a failed
    point is a gap in its line). A first field of names (model.arch=rnn,lstm) against a second
    of numbers (a length) swaps: numbers read better along an axis, names as lines."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no GUI

    name, higher = headline_of(outcomes)
    fields = list(grid)
    if len(fields) > 1 and not _axis_values(grid[fields[0]])[1] and _axis_values(grid[fields[1]])[1]:
        fields[0], fields[1] = fields[1], fields[0]
    x_field, *others = fields
    xs, numeric = _axis_values(grid[x_field])
    at = dict(zip(grid[x_field], xs))
    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.subplots()
    lines: dict[str, list[tuple[float, float]]] = {}
    for o in outcomes:
        key = o.point[others[0]] if len(others) == 1 else ", ".join(f"{f}={o.point[f]}" for f in others) or name
        lines.setdefault(key, []).append((at[o.point[x_field]], o.score if o.ok else math.nan))
    for key, pts in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 10:
        ax.set_xscale("log")  # learning rates and the like: spread over decades
    ax.set_xticks(xs, grid[x_field])
    ax.set_xlabel(x_field)
    ax.set_ylabel(f"{name} ({direction(higher)})" if higher is not None else name)
    ax.set_title(f"{recipe}: {name} by {x_field}" + (f" and {', '.join(others)}" if others else ""))
    ax.grid(alpha=0.3)
    if others:
        ax.legend(title=", ".join(others))
    fig.tight_layout()
    return fig
