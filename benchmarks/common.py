"""What every benchmark shares: the machine header, corpora, War and Peace ids, tables, JSON, a
Prefect of its own, and runs of several modes in turn.

Figures are only comparable with the machine they ran on, so each benchmark prints (and saves)
the torch version, its thread count, the CPU count and the load average next to its numbers:
another job on the same two cores halves a throughput without anything else changing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
OUT = REPO / "benchmarks" / "out"
CORPORA = {"warandpeace": DATA / "warandpeace.txt", "tinyshakespeare": DATA / "tinyshakespeare.txt"}


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a shorter pass (fewer steps, smaller inputs)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice, one per core)"
    )
    if extra:
        extra(p)
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return args


def one_thread_unless_told(args) -> None:
    """One torch thread where --threads is not given: for benchmarks whose figure is a ratio of a few
    percent, which two threads on two cores that anything else touches would drown."""
    if args.threads is None:
        import torch

        torch.set_num_threads(1)


def alternating(modes, once: Callable[[str, int], dict], steps: int, repeats: int, said) -> dict[str, list[dict]]:
    """One 20-step warm-up run of each mode, then `repeats` rounds of every mode in turn (A B A B:
    a burst of load hits them all): each run's result, by mode. `said(result)` is its progress line."""
    for mode in modes:  # warm-up: allocator, the server's first requests, the experiment
        once(mode, 20)
    got: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i in range(repeats):
        for mode in modes:
            r = once(mode, steps)
            got[mode].append(r)
            print(f"  {i + 1}/{repeats} {mode}: {said(r)}", flush=True)
    return got


def corpus(name: str) -> Path:
    """The corpus file, or exit with a message saying where it was looked for."""
    path = CORPORA[name]
    if not path.is_file():
        print(f"skipped: {name} corpus not found at {path} (benchmarks read ../shared/data beside the repo)")
        raise SystemExit(0)
    return path


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads set to `n` inside the block, the caller's count restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prefect_env(home: Path) -> dict[str, str]:
    """The environment for a Prefect of our own: its database and settings under `home`.

    PREFECT_API_URL is left out, not set empty: Prefect then runs its temporary server, while an
    empty URL starves its events client, and task runs never reach the API.
    """
    (home / "prefect").mkdir(parents=True, exist_ok=True)  # Prefect's database cannot open in a missing folder
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE")}
    return {
        **env,
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "XDG_CACHE_HOME": str(home / "cache"),
    }


def load() -> float:
    return round(os.getloadavg()[0], 2)


def machine() -> dict[str, Any]:
    import torch

    from mllm.runtime import speed

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": speed.cpu_model(),
        "cpu_flags": speed.matmul_flags(),
        "loadavg_start": list(os.getloadavg()),
    }


def header(name: str, quick: bool) -> dict[str, Any]:
    m = machine()
    print(f"# {name}{' (quick)' if quick else ''}\n")
    print(
        f"{m['cpu']} ({' '.join(m['cpu_flags']) or 'no AVX2'}), torch {m['torch']}, {m['threads']} torch "
        f"threads, {m['cpus']} CPUs, python {m['python']}, load average {m['loadavg_start'][0]:.2f}\n",
        flush=True,
    )
    return m


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A markdown table of `rows`; columns are (key, title) pairs."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            # Below 10, five significant digits: a loss of 1.1976 read as "1.2" hides what was measured.
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.5g}" if abs(v) < 10 else f"{v:.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(t for _, t in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(name: str, payload: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nfigures saved to {path.relative_to(REPO)}", flush=True)
    return path


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def hms(seconds: float) -> str:
    """A long duration the way a person reads it: 37 min, 5.4 h, 2.1 days."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def token_ids(
    corpus_path: Path,
    folder: Path,
    kind: str = "char",
    normalize: bool = True,
    strip_gutenberg: bool = True,
    val_fraction: float = 0.1,
) -> dict[str, Any]:
    """Tokenize a corpus with mllm.data.text and mllm.data.vocab into train/val .npy and vocab.json in
    `folder`: the inputs `mllm.train` reads, without the pipeline around them."""
    import numpy as np
    import pyarrow as pa

    from mllm.config import TokenizerConfig
    from mllm.data.text import build_tokenizer, read_chunks
    from mllm.data.text import strip_gutenberg as strip
    from mllm.data.vocab import Vocab

    folder.mkdir(parents=True, exist_ok=True)
    chunks = read_chunks(str(corpus_path))
    if strip_gutenberg:
        chunks = strip(chunks)
    tok = build_tokenizer(TokenizerConfig(kind=kind, normalize=normalize, strip_gutenberg=strip_gutenberg))
    tokens = pa.chunked_array([pa.array(t, pa.string()) for t in tok.tokenize(chunks)])
    counts = {v: c for v, c in zip(*(f.to_pylist() for f in tokens.value_counts().flatten()))}
    vocab = Vocab.build(counts)
    ids = vocab.encode_array(tokens)
    n_val = int(len(ids) * val_fraction)
    np.save(folder / "train.npy", ids[: len(ids) - n_val])
    np.save(folder / "val.npy", ids[len(ids) - n_val :])
    vocab.save(str(folder / "vocab.json"))
    return {
        "train_ids": str(folder / "train.npy"),
        "val_ids": str(folder / "val.npy"),
        "vocab": str(folder / "vocab.json"),
        "vocab_size": len(vocab),
        "n_train": len(ids) - n_val,
        "n_val": n_val,
    }


def run_config(recipe: str | None, paths: dict[str, Any], checkpoint_dir: Path, overrides: dict[str, Any]):
    """A recipe (or the default tree) with `overrides` ({"train.max_steps": 10}) and paths filled in."""
    from mllm.config import RunConfig, TrainPaths
    from mllm.resolve import apply_overrides, recipe_dict, validate

    data = recipe_dict(recipe) if recipe else RunConfig().to_dict()
    if overrides.get("model.arch", data["model"]["arch"]) != data["model"]["arch"]:
        data["model"] = {}  # another family: none of the recipe's model fields apply
    data = apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    data["paths"] = TrainPaths(
        train_ids=paths["train_ids"], val_ids=paths["val_ids"], vocab=paths["vocab"], checkpoint_dir=str(checkpoint_dir)
    ).model_dump()
    return validate(data, f"benchmark config ({recipe or 'default tree'})")


@contextlib.contextmanager
def tracked_war_and_peace(prefix: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A temporary folder, War and Peace as char ids in it (`token_ids`), and a real MLflow server
    on loopback (tests/servers.py) as MLFLOW_TRACKING_URI: every tracking call is HTTP, as it
    would be to a remote server. The set-up of the benchmarks that time tracking."""
    wp = corpus("warandpeace")
    sys.path.insert(0, str(REPO / "tests"))
    from servers import run_mlflow_server

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp_name:
        tmp = Path(tmp_name)
        paths = token_ids(wp, tmp / "wp")
        given = os.environ.get("MLLM_BENCH_TRACKING_URI")
        if given:  # a server of one's own (a secured stack: its MLFLOW_TRACKING_* variables set)
            print(f"mlflow server at {given} (MLLM_BENCH_TRACKING_URI)", flush=True)
            os.environ["MLFLOW_TRACKING_URI"] = given
            yield tmp, paths
            return
        t0 = time.perf_counter()
        with run_mlflow_server(tmp / "mlflow") as server:
            print(f"mlflow server at {server.url}, ready in {time.perf_counter() - t0:.1f} s", flush=True)
            os.environ["MLFLOW_TRACKING_URI"] = server.url
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            yield tmp, paths
