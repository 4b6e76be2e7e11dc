"""The same exported model decoding 500 tokens in mllm's own decoder, onnxruntime and llama.cpp.

    python -m benchmarks.export_decode [--quick] [--threads N] [--llama-path DIR] [--repeats N]

Three networks with random weights (std 0.2: confident, so greedy decoding varies): the default
recipe's pieces (4 layers, 4 heads, 128 wide, rotary, ReLU², no bias; llama.cpp as `nemotron`),
the same with GELU (`gptneox`) and nanoGPT's at the same size (learned positions, GELU; `gpt2`),
each with a 512-position context so that a 4-token prompt and 500 new tokens fit without a refill. Each is
exported with `mllm.export` (onnx, gguf) and decoded greedily, one token per step with a KV cache:
mllm's `generate` (float32), onnxruntime on the exported `model.onnx` (its cache fed back as
inputs), llama.cpp through llama-cpp-python on `model.gguf`, token ids in and out. Every runtime
gets the same thread count (mllm's cached decoding takes one thread whatever it is given: see
mllm.lm.generate). The figure is tokens/s of the whole decode (prompt included), median of the
repeats, contenders alternating; the tokens are compared with mllm's, and the logits of 64
positions fed at once (the largest gap to mllm's forward).

llama-cpp-python is no dependency of the project: it builds from its source distribution (about
half an hour on 2 cores), e.g. `pip install --target /tmp/llama llama-cpp-python==0.3.36`, and
--llama-path names that folder. Without it the llama.cpp column says why.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import header, median, parse_args, save, table

NEW, PROMPT = 500, [5, 6, 7, 8]
SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 512, "dropout": 0.0}
PIECES = {
    "default (rotary, ReLU², no bias)": {"positions": "rotary", "mlp": "relu2", "bias": False},
    "rotary, GELU, no bias": {"positions": "rotary", "mlp": "gelu", "bias": False},
    "nanoGPT (learned, GELU, bias)": {"positions": "learned", "mlp": "gelu", "bias": True},
}


def _loaded(pieces: dict):
    from mllm.config import RunConfig
    from mllm.data.text import CharTokenizer
    from mllm.data.vocab import Vocab
    from mllm.families.base import build_model
    from mllm.runtime.checkpoint import Loaded

    vocab = Vocab(["<unk>", *" !,-.;?0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"])
    cfg = RunConfig.model_validate({"model": {"arch": "gpt", "vocab_size": len(vocab), **SHAPE, **pieces}})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return Loaded(model, cfg, vocab, CharTokenizer(), step=0)


def _mllm(loaded, threads: int) -> list[int]:
    from mllm.lm.generate import generate

    torch.set_num_threads(threads)
    return generate(loaded.model, PROMPT, NEW, method="greedy", dtype="float32")


def _onnx(folder: Path, loaded, threads: int) -> list[int]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    s = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    c = loaded.model.config
    keys = values = np.zeros((c.n_layer, 1, c.n_head, 0, c.n_embd // c.n_head), np.float32)
    ids, out = np.array([PROMPT], np.int64), []
    for _ in range(NEW):
        logits, keys, values = s.run(None, {"input_ids": ids, "past_keys": keys, "past_values": values})
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids = np.array([[token]], np.int64)
    return out


def _llama(folder: Path, threads: int) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(
        str(folder / "model.gguf"),
        n_ctx=SHAPE["block_size"],
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=64,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
        flash_attn=False,
    )  # float32 KV cache
    llm.eval(PROMPT)
    out = []
    for _ in range(NEW):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def _logit_gaps(folder: Path, loaded, llama: bool) -> dict[str, float]:
    """Max |logit - mllm's| over 64 positions of random ids, fed at once: how exact each runtime is."""
    import onnxruntime as ort

    ids = torch.randint(1, len(loaded.vocab), (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = loaded.model(ids)[0][0].numpy()
    c = loaded.model.config
    empty = np.zeros((c.n_layer, 1, c.n_head, 0, c.n_embd // c.n_head), np.float32)
    s = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    gaps = {
        "onnx gap": float(
            np.abs(s.run(None, {"input_ids": ids.numpy(), "past_keys": empty, "past_values": empty})[0][0] - ours).max()
        )
    }
    if llama:
        from llama_cpp import Llama

        llm = Llama(
            str(folder / "gguf" / "model.gguf"),
            n_ctx=SHAPE["block_size"],
            n_threads=1,
            logits_all=True,
            verbose=False,
            type_k=0,
            type_v=0,
            flash_attn=False,
        )
        llm.eval(ids[0].tolist())
        gaps["llama gap"] = float(np.abs(np.array(llm.scores[:64]) - ours).max())
    return gaps


def _timed(fn, *args) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = fn(*args)
    return NEW / (time.perf_counter() - start), tokens


def _same(a: list[int], b: list[int] | None) -> str:
    if b is None:
        return "-"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return "all 500" if first is None else f"first {first}"


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--llama-path", help="a folder holding llama_cpp (pip install --target)"),
            p.add_argument("--repeats", type=int, default=3),
        ),
    )
    threads = args.threads or 1
    torch.set_num_threads(threads)
    m = header("export_decode", args.quick)
    llama_note = None
    if args.llama_path:
        sys.path.insert(0, args.llama_path)
    try:
        import llama_cpp

        llama_note = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError as e:
        llama_note = f"llama.cpp not run: {e}"
    print(llama_note, flush=True)
    from mllm.export import export

    rows = []
    for name, pieces in PIECES.items():
        loaded = _loaded(pieces)
        with tempfile.TemporaryDirectory() as tmp:
            export(loaded, "onnx", f"{tmp}/onnx")
            export(loaded, "gguf", f"{tmp}/gguf")
            runs: dict[str, list[float]] = {"mllm": [], "onnxruntime": [], "llama.cpp": []}
            tokens: dict[str, list[int]] = {}
            for _ in range(1 if args.quick else args.repeats):
                for who, fn, a in (
                    ("mllm", _mllm, (loaded, threads)),
                    ("onnxruntime", _onnx, (Path(tmp) / "onnx", loaded, threads)),
                    ("llama.cpp", _llama, (Path(tmp) / "gguf", threads)),
                ):
                    if who == "llama.cpp" and not llama_note.startswith("llama-cpp"):
                        continue
                    rate, tokens[who] = _timed(fn, *a)
                    runs[who].append(rate)
            gaps = _logit_gaps(Path(tmp), loaded, llama_note.startswith("llama-cpp"))
        row = {"model": name, **{who: median(r) for who, r in runs.items() if r}, **gaps}
        row["onnx tokens"] = _same(tokens["mllm"], tokens.get("onnxruntime"))
        row["llama.cpp tokens"] = _same(tokens["mllm"], tokens.get("llama.cpp"))
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{who} {median(r):.0f} tok/s" for who, r in runs.items() if r), flush=True)
    print()
    print(
        table(
            rows,
            [
                ("model", "model"),
                ("mllm", "mllm tok/s"),
                ("onnxruntime", "onnxruntime tok/s"),
                ("llama.cpp", "llama.cpp tok/s"),
                ("onnx tokens", "onnxruntime = mllm"),
                ("llama.cpp tokens", "llama.cpp = mllm"),
                ("onnx gap", "onnxruntime max logit gap"),
                ("llama gap", "llama.cpp max logit gap"),
            ],
        )
    )
    save("export_decode", {"machine": m, "threads": threads, "llama": llama_note, "rows": rows})


if __name__ == "__main__":
    main()
