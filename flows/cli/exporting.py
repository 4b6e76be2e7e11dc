"""`mllm-pipeline export`: a registered model (or a run's) to a transformers folder, ONNX or GGUF,
recorded in MLflow beside the model it came from. Registered on the CLI's app."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.app import Storage, app
from flows.cli.terminal import user_errors
from flows.launch import storage_root
from mllm import UserError


@app.command("export")
def export_model(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="MODEL@ALIAS, MODEL/VERSION or an MLflow run id.", show_default=False)
    ],
    format_: Annotated[
        str,
        typer.Option(
            "--format", metavar="FORMAT", help="hf (a transformers folder), onnx (onnxruntime) or gguf (llama.cpp)."
        ),
    ],
    out: Annotated[
        str, typer.Option("--out", metavar="DIR|URL", help="A new or empty folder, local or in object storage.")
    ],
    storage: Storage = None,
) -> None:
    """Export a model for another runtime, each format proven equal to the model (docs/export.md).

    The export is kept with the model in MLflow (its run's artifacts exports/FORMAT, tags naming
    the folder, the format and the library versions), and `lineage OUT` follows it back to the corpus."""
    with user_errors():
        from mllm.export.pieces import FORMATS

        if format_ not in FORMATS:
            raise UserError(f"unknown --format {format_!r}: choose {', '.join(FORMATS)}")
        from flows.launch import check_tracked

        root = storage_root(storage)
        check_tracked(root)
        from mllm.export import export
        from mllm.runtime.checkpoint import load_checkpoint
        from mllm.storage import hide_credentials
        from tasks.tracking import exports

        src = exports.source(root, model)
        manifest = export(load_checkpoint(src["checkpoint"]), format_, out, src["card"])
        artifact = exports.record(root, src, manifest, out)
        typer.echo(f"exported {model} as {format_} to {hide_credentials(out)}: {', '.join(manifest['files'])}")
        typer.echo(
            f"recorded on run {src['run_id']}"
            + (f" as {artifact}" if artifact else "")
            + (f" and model {src['card']['model']}" if src["card"]["model"] else "")
        )
