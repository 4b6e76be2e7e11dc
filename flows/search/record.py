"""What a study leaves: the table (markdown, CSV, JSON), the history and parameter plots, the best
trial's recipe, under `searches/<study>/` in storage and on the study's MLflow parent run, and the
search's result."""

from __future__ import annotations

import io
import json
import warnings
from typing import Any

from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from flows.search import report as search_report
from flows.search.report import TrialOutcome
from flows.search.space import Dim
from flows.search.study import optuna_module
from flows.sweep.table import csv_text
from mllm import UserError, storage
from mllm.resolve import Overrides, resolve
from tasks.tracking.tracker import MAX_TAG_VALUE


class SearchResult(BaseModel):
    recipe: str
    study: str
    study_file: str
    headline: str
    higher_is_better: bool
    mlflow_run_id: str
    outcomes: list[TrialOutcome]
    best: TrialOutcome | None
    best_recipe: str | None  # the best trial's config, a recipe file for `run --recipe FILE`
    outputs: str
    artifact_uri: str
    revived: list[int] = []

    @property
    def failed(self) -> list[TrialOutcome]:
        return [o for o in self.outcomes if o.state == "failed" and o.resumed_by is None]


class TrialsFailed(UserError):
    """Some trials of the study failed; the others ran, and the table and plots are recorded. The
    search's flow run fails, as a sweep's does when a point failed (flows/sweep/flow.py PointsFailed),
    and the command exits 1 after its table."""

    def __init__(self, result: SearchResult):
        self.result = result
        counted = [o for o in result.outcomes if o.resumed_by is None and o.state in ("complete", "pruned", "failed")]
        failed = "; ".join(f"trial {o.number} ({o.error})" for o in result.failed)
        logs = ", ".join(f"{result.study}-trial-{o.number}" for o in result.failed[:3])
        more = f" and {len(result.failed) - 3} more" if len(result.failed) > 3 else ""
        super().__init__(
            f"{len(result.failed)} of {len(counted)} trials failed: {failed}; their logs: the Prefect "
            f"flow runs {logs}{more}"
        )


def record(
    parent: Any,
    st: Any,
    recipe: str,
    space: dict[str, Dim],
    overrides: Overrides,
    source: str | list[str] | None,
    outcomes: list[TrialOutcome],
    fam: Any,
    path: str,
    revived: list[int],
) -> SearchResult:
    """The table (markdown, CSV, JSON), the history and parameter plots and the best trial's
    recipe, under `searches/<study>/` in storage and as the study run's artifacts (`parent`:
    flows.search.flow.StudyRun)."""
    folder = storage.join(parent.root, "searches", parent.study)
    complete = [o for o in outcomes if o.state == "complete"]
    best = None
    if complete:
        pick = max if fam.higher_is_better else min
        best = pick(complete, key=lambda o: o.value)
    rows = search_report.table_rows(space, outcomes)
    md = search_report.markdown_table(
        recipe, parent.study, fam.headline, fam.higher_is_better, space, outcomes, best, parent.run_id
    )
    texts = {"search.md": md, "search.csv": csv_text(rows), "search.json": json.dumps(rows, indent=2) + "\n"}
    best_recipe = None
    if best is not None:
        cfg = resolve(recipe, overrides=overrides.with_values(best.params), source=source)
        texts["best.yaml"] = search_report.best_recipe(cfg, parent.study, best, fam.headline)
        best_recipe = storage.join(folder, "best.yaml")
    for name_, text in texts.items():
        storage.write_text(storage.join(folder, name_), text)
        parent.client.log_text(parent.run_id, text, name_)
    for name_, fig in (
        ("history.png", search_report.history_figure(recipe, fam.headline, fam.higher_is_better, outcomes)),
        ("params.png", search_report.params_figure(fam.headline, space, outcomes)),
    ):
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        storage.write_bytes(storage.join(folder, name_), png.getvalue())
        parent.client.log_figure(parent.run_id, fig, name_)
    client, run_id = parent.client, parent.run_id
    counts = {s: sum(o.state == s and o.resumed_by is None for o in outcomes) for s in ("complete", "pruned", "failed")}
    for s, n in counts.items():
        client.set_tag(run_id, f"search.{s}", str(n))
    if best is not None:
        client.set_tag(run_id, "search.best_trial", str(best.number))
        client.set_tag(run_id, "search.best_run", best.mlflow_run_id or "")
        client.log_metric(run_id, f"best_{fam.headline}", best.value, step=len(outcomes))
        for f, v in best.params.items():
            client.set_tag(run_id, f"search.best.{f}", v[:MAX_TAG_VALUE])
    for f, value in importances(st).items():
        client.log_metric(run_id, f"importance.{f}", value)
    slug = "".join(c if c.isalnum() else "-" for c in parent.study.lower())
    create_markdown_artifact(md, key=f"search-{slug}", description=f"{recipe}: search of {', '.join(space)}")
    return SearchResult(
        recipe=recipe,
        study=parent.study,
        study_file=path,
        headline=fam.headline,
        higher_is_better=fam.higher_is_better,
        mlflow_run_id=run_id,
        outcomes=outcomes,
        best=best,
        best_recipe=best_recipe,
        outputs=folder,
        artifact_uri=parent.artifact_uri,
        revived=revived,
    )


def importances(st: Any) -> dict[str, float]:
    """Optuna's parameter importances (fANOVA) over the complete trials; none while too few."""
    optuna = optuna_module()
    complete = st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {k: float(v) for k, v in optuna.importance.get_param_importances(st).items()}
    except (ValueError, RuntimeError):  # a parameter that never varied, a single value
        return {}
