"""`python -m mllm.export`: a checkpoint to hf, onnx or gguf with torch and that format's library alone."""

from __future__ import annotations

import argparse
import sys

from mllm import UserError
from mllm.export import export
from mllm.export.pieces import FORMATS
from mllm.runtime.checkpoint import load_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mllm.export",
        description="Export a checkpoint for another runtime: hf (transformers), "
        "onnx (onnxruntime) or gguf (llama.cpp).",
    )
    p.add_argument("--checkpoint", required=True, help="URL or path of a checkpoint (best.pt / last.pt)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="a new or empty folder (path or URL)")
    args = p.parse_args(argv)
    try:
        loaded = load_checkpoint(args.checkpoint)
        done = export(loaded, args.format, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} as {args.format} to {args.out}: {', '.join(done['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
