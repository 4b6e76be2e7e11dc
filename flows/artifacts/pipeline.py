"""A pipeline run's result, and the Prefect markdown artifacts that show it in the UI: the decision
about the champion, and for a trained model a summary of its data, training and samples."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from mllm.resolve import resolve
from tasks.model import Evaluation, Prepared, Trained
from tasks.model.evaluate import describe
from tasks.tracking.champion import Outcome
from tasks.tracking.store import run_url


class PipelineResult(BaseModel):
    recipe: str
    storage: str
    data: Prepared
    decision: Literal["promoted", "kept", "skipped", "reproduction"]
    reason: str
    trained: Trained | None  # None when skipped
    evaluation: Evaluation | None
    samples: dict[str, list[str]]
    mlflow_run_id: str
    champion: Outcome
    corpus_changes: dict[str, int] = {}  # a corpus of many files: files new, changed, removed, reused since last read


def publish(result: PipelineResult) -> None:
    """The decision, and for a trained model a summary, as Prefect markdown artifacts."""
    slug = "".join(c if c.isalnum() else "-" for c in result.recipe.lower())
    link = _mlflow_link(result.storage, result.mlflow_run_id)
    create_markdown_artifact(
        decision_table(result, link), key=f"decision-{slug}", description=f"{result.recipe}: {result.decision}"
    )
    if result.trained is not None:
        create_markdown_artifact(
            summary(result, link), key=f"pipeline-{slug}", description=f"{result.recipe}: data, training and samples"
        )


def _mlflow_link(root: str, run_id: str) -> str:
    """The MLflow run as a link into the MLflow UI when the runs go to a server, else its id."""
    with contextlib.suppress(Exception):  # an artifact is no reason to fail a finished run
        if url := run_url(root, run_id):
            return f"[{run_id}]({url})"
    return f"`{run_id}`"


# The artifacts' tables hold short cells only (Prefect's UI cuts a long one at the right edge);
# the reason and the paths go below them as text, which wraps. The first row is the header: a
# table with an empty header row shows as an empty first row.
def decision_table(r: PipelineResult, link: str | None = None) -> str:
    c = r.champion
    cfg = resolve(r.recipe)
    rows = [("corpus sha256", f"`{r.data.raw_sha256[:16]}`"), ("MLflow run", link or f"`{r.mlflow_run_id}`")]
    if r.corpus_changes:
        rows.insert(1, ("corpus files", files_line(r.corpus_changes)))
    if r.decision == "skipped":
        rows.append(("champion", f"{c.name} v{c.version}"))
    elif r.decision == "reproduction":
        rows.append(("evaluation", describe(r.evaluation, cfg)))
    else:
        rows.append(("this model", f"{c.name} v{c.version}"))
        rows.append(("evaluation", describe(r.evaluation, cfg)))
        if c.previous:
            cs = c.champion_score
            measured = (
                f"{c.previous.headline} {_f(c.previous.score)} on the same split"
                if cs is None
                else f"{cs.headline} {cs.value:.4f} on this split"
            )
            rows.append(("previous champion", f"v{c.previous.version}, {measured}"))
    return "\n".join(
        [
            f"# {r.recipe}: {r.decision}",
            "",
            f"| decision | **{r.decision}** |",
            "|---|---|",
            *[f"| {k} | {v} |" for k, v in rows],
            "",
            f"**Why:** {r.reason}",
            "",
        ]
    )


def summary(r: PipelineResult, link: str | None = None) -> str:
    d, t, e = r.data, r.trained, r.evaluation
    cfg = resolve(r.recipe)
    lines = [
        f"# {r.recipe}",
        "",
        f"| model | {_model_cell(r.champion)} |",
        "|---|---|",
        f"| corpus | {d.raw_bytes:,} bytes, sha256 `{d.raw_sha256[:12]}` |",
        *([f"| corpus files | {files_line(r.corpus_changes)} |"] if r.corpus_changes else []),
        f"| tokens | {d.tokens.n_tokens:,} |",
        f"| vocabulary | {d.vocab.size} entries |",
        f"| split | train {d.splits.train.n_tokens:,} / val {d.splits.val.n_tokens:,}"
        + (f" / test {d.splits.test.n_tokens:,}" if d.splits.test else "")
        + " tokens |",
        f"| steps | {t.steps} ({t.stop_reason}), {t.tokens_per_s:,.0f} tokens/s |",
        f"| precision | {t.precision()} |",
        f"| compiled | {'yes' if t.compile_used else 'no'} ({t.compile_reason}) |",
        *([f"| attention | {t.attention} |"] if t.attention else []),
        *([f"| Muon's Newton-Schulz | {t.muon_precision} |"] if t.muon_precision else []),
        f"| MFU | {_mfu(t)} |",
        *([f"| threads | {t.threads_reason} |"] if t.threads_reason else []),
        *([f"| busy machine | {t.busy_line()} |"] if t.busy else []),
        f"| train loss | {_f(t.train_loss)} |",
        f"| evaluation | {describe(e, cfg)} |",
        f"| MLflow run | {link or f'`{r.mlflow_run_id}`'} |",
        "",
        f"**Source:** {d.source}",
        "",
        f"**Outputs:** `{t.run_dir}`",
        "",
        "## Samples",
        "",
    ]
    for method, texts in r.samples.items():
        shown = "\n".join(t.strip() for t in texts) or "(no prompt fits the vocabulary)"
        lines += [f"**{method}**", "", "```", shown, "```", ""]
    return "\n".join(lines)


def files_line(c: dict[str, int]) -> str:
    """A corpus's files against the last read of its sources: '12 files: 1 new, 0 changed, 0 removed, 11 reused; 1 tokenized'."""
    line = (
        f"{c['files']} files: {c['new']} new, {c['changed']} changed, {c['removed']} removed, {c['reused']} reused; "
        f"{c['tokenized']} tokenized"
    )
    return (
        line
        + (f"; {c['duplicates']} the same bytes as another, read once" if c.get("duplicates") else "")
        + (f"; {c['skipped']} left out" if c.get("skipped") else "")
        + (f" ({c['empty']} empty)" if c.get("empty") else "")
    )


def _mfu(t: Any) -> str:
    if t.mfu is None or not t.peak_flops:
        return "n/a"
    return f"{t.mfu:.1%} of {t.peak_flops / 1e12:.3g} TFLOP/s ({t.peak_source})"


def _model_cell(c: Outcome) -> str:
    if c.decision == "reproduction":
        return "not registered (a reproduction)"
    return f"{c.name} v{c.version}, {'now champion' if c.promoted else 'champion kept'}"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
