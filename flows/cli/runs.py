"""`mllm-pipeline runs`, `reproduce` and `lineage`: the commands that read the tracked runs
(MLflow, and storage behind it). Registered on the CLI's app."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from flows.cli.app import Storage, app
from flows.cli.terminal import user_errors
from flows.launch import storage_root
from mllm import UserError


@app.command("runs")
def list_runs(
    limit: Annotated[int, typer.Option(metavar="N", help="How many runs, newest first.")] = 20,
    recipe: Annotated[Optional[str], typer.Option(metavar="NAME", help="Only this recipe's runs.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    storage: Storage = None,
) -> None:
    """Recent training runs in MLflow: id, recipe, commit, val loss, MFU, precision, status."""
    with user_errors():
        from flows.launch import check_tracked

        root = storage_root(storage)
        check_tracked(root)
        from flows.history import runs

        rows = runs.list_runs(root, limit, recipe)
        if json_:
            typer.echo(runs.as_json(rows))
            return
        typer.echo(
            f"{'run id':32}  {'recipe':18} {'commit':16} {'val loss':>9} {'mfu':>6} {'dtype':8}  {'status':9} "
            f"{'decision':12} {'started':16}  {'model':35}  reproduces"
        )
        for r in rows:
            loss = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
            typer.echo(
                f"{r['run_id']:32}  {r['recipe']:18} {r['commit'] or '-':16} {loss:>9} {mfu:>6} "
                f"{r['dtype'] or '-':8}  {r['status']:9} "
                f"{r['decision'] or '-':12} {r['started']:16}  {r['model_id'] or '-':35}  "
                f"{(r['reproduces'] or '-')[:8]}".rstrip()
            )


@app.command()
def reproduce(
    run_id: Annotated[str, typer.Argument(metavar="RUN_ID", help="The MLflow run to reproduce.")],
    storage: Storage = None,
) -> None:
    """Re-run a run at its git commit with its recorded config and data, and compare metrics."""
    with user_errors():
        from flows.launch import check_tracked

        root = storage_root(storage)
        check_tracked(root)
        from flows.history import runs

        result = runs.reproduce(root, run_id)
        typer.echo(
            f"reproduced {run_id} at commit {result['commit'][:12]} as run {result['reproduction']} "
            "(registered nothing)"
        )
        if result["compared_with"] != run_id:
            typer.echo(
                f"run {run_id} skipped training (it reused run {result['compared_with']}'s): "
                f"compared with run {result['compared_with']}"
            )
        if all(a is None for a, _ in result["metrics"].values()):
            typer.echo(
                f"nothing to compare: run {result['compared_with']} recorded none of {', '.join(result['metrics'])}"
            )
        else:
            typer.echo(runs.comparison_table(result))


@app.command()
def lineage(
    model: Annotated[
        Optional[str],
        typer.Argument(
            metavar="MODEL",
            help="MODEL@ALIAS, MODEL/VERSION, an MLflow run id or an export's folder.",
            show_default=False,
        ),
    ] = None,
    corpus: Annotated[
        Optional[str],
        typer.Option(
            "--corpus",
            metavar="SHA256-PREFIX",
            help="List the runs and models trained on this corpus (or on a corpus holding a file of this digest) instead.",
        ),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    files: Annotated[bool, typer.Option("--files", help="List every file of a many-file corpus.")] = False,
    storage: Storage = None,
) -> None:
    """Where a model came from, each link checked; or, with --corpus, what was trained on a corpus.

    The chain: the model version, its run and Prefect flow run, the code, the training key, the
    split, the vocabulary, the tokens and the corpus, each checked against storage (exit 1 when a
    link is broken)."""
    with user_errors():
        if (model is None) == (corpus is None):
            raise UserError("give a model (MODEL@ALIAS, MODEL/VERSION or a run id) or --corpus SHA256-PREFIX, not both")
        from flows.launch import check_tracked

        root = storage_root(storage)
        check_tracked(root)
        from flows.history import lineage as trail

        if corpus is not None:
            from flows.history import lineage_corpus

            rows = lineage_corpus.by_corpus(root, corpus)
            typer.echo(trail.as_json(rows) if json_ else lineage_corpus.render_corpus(corpus, rows))
            return
        chain = trail.trace(root, model, files=files)
        typer.echo(trail.as_json(chain) if json_ else trail.render(chain))
    if not chain["ok"]:
        raise typer.Exit(1)
