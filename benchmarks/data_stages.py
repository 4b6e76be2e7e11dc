"""Wall time of the data stages through the real Prefect flow, and the memory they need at scale.

    python -m benchmarks.data_stages [--quick] [--scale-only] [--sizes 10,50,500] [--word-up-to 50] [--bpe-up-to 10]
    python -m benchmarks.data_stages --many-files [--mb 1000] [--files 2000]   (see benchmarks/many_files.py)

1. `flows.pipeline.prepare` on War and Peace (download from the local file, tokenize, vocabulary,
   split) for the char, word and BPE-2000 tokenizers, each into a fresh storage folder, in this
   process with a temporary PREFECT_HOME (Prefect starts its temporary server on the first flow).
   Stage times are the task runs' start-to-end times as the Prefect API recorded them; then the
   same flow again, every stage cached, timed in-process (Prefect's start-up already paid).
2. The whole `mllm-pipeline prepare` command as a user runs it, a subprocess each: the first run
   ever (fresh PREFECT_HOME: Prefect creates its database), a run on new data (Prefect's database
   there), and a fully cached re-run.
3. Scale: a text of War and Peace's body repeated to 10, 50 and 500 MB (10 and 50 with --quick;
   --sizes picks others), written to a temporary folder and deleted after. A worker process runs
   the tokenize task inside a Prefect flow, for the char tokenizer (the default recipe's) at every
   size, word up to --word-up-to MB and BPE 2000 up to --bpe-up-to MB (BPE's stage includes
   learning its merges: a second pass over the text), and reports each one's throughput (MB of text per second of wall time, and per CPU
   second of the process: on a shared machine the second is the steadier figure) and the
   process's peak memory (VmHWM, reset before each stage through /proc/self/clear_refs, and the
   largest anonymous and file-backed RSS, sampled; see `Peaks`), then the char text's vocabulary
   and split stages at up to 50 MB. A stage whose peak anonymous memory grows with the text does
   not stream: the growth per MB of text, between the sizes, is printed.

--scale-only skips parts 1 and 2 (Prefect's start-up and the CLI), which do not change with the
tokenizers' speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import corpus, header, load, parse_args, prefect_env, save, table
from benchmarks.text_scale import peak_growth, scale_runs, worker

KINDS = {
    "char": [],
    "word": ["data.tokenizer.kind=word"],
    "bpe 2000": ["data.tokenizer.kind=bpe", "data.tokenizer.bpe_vocab_size=2000"],
}
STAGES = ("download", "tokenize", "build-vocabulary", "split")


# --- 1. the flow in-process ----------------------------------------------------------------


def stage_times(flow_run_id) -> dict[str, object]:
    """Each task's start-to-end seconds (or "cached") as the Prefect API recorded them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    times: dict[str, object] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # task run states reach the API a moment after the flow returns
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        times = {}
        for r in runs:
            stage = r.name.rsplit("-", 1)[0]
            if r.state_name == "Cached":
                times[stage] = "cached"
            elif r.start_time and r.end_time:
                times[stage] = (r.end_time - r.start_time).total_seconds()
        if len(times) == len(STAGES):
            break
        time.sleep(0.5)
    return times


def in_process(source: Path, tmp: Path) -> tuple[list[dict], float]:
    from prefect import flow

    from flows.pipeline import prepare, with_results
    from mllm.resolve import resolve

    @flow(name="bench-warm-up")
    def warm_up() -> None:
        pass

    t0 = time.perf_counter()
    warm_up()  # starts Prefect's temporary server, which every later flow of this process uses
    server_s = time.perf_counter() - t0
    print(f"  Prefect start-up (an empty flow, the first of this process): {server_s:.1f} s", flush=True)
    rows = []
    for kind, overrides in KINDS.items():
        cfg = resolve("default", source=str(source), overrides=overrides)
        root = str(tmp / "storage" / kind.replace(" ", "-"))
        for run in ("cold", "cached"):
            t0 = time.perf_counter()
            state = with_results(prepare, root)(cfg, root, return_state=True)
            flow_s = time.perf_counter() - t0
            data = state.result()
            times = stage_times(state.state_details.flow_run_id)
            tok_s = times.get("tokenize")
            rows.append(
                {
                    "tokenizer": kind,
                    "run": run,
                    **{s: times.get(s) for s in STAGES},
                    "tokenize_mb_per_s": source.stat().st_size / 1e6 / tok_s if isinstance(tok_s, float) else None,
                    "flow_s": flow_s,
                    "tokens": data.tokens.n_tokens,
                    "vocab": data.vocab.size,
                    "load": load(),
                }
            )
            print(
                f"  prepare, {kind}, {run}: {flow_s:.1f} s; " + ", ".join(f"{s} {_fmt(times.get(s))}" for s in STAGES),
                flush=True,
            )
    return rows, server_s


def _fmt(v) -> str:
    return f"{v:.2f} s" if isinstance(v, float) else str(v)


# --- 2. the CLI ----------------------------------------------------------------------------


def cli_runs(source: Path, tmp: Path) -> list[dict]:
    exe = Path(sys.executable).with_name("mllm-pipeline")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    env = {**prefect_env(tmp / "cli-home"), "COLUMNS": "200"}
    rows = []
    for what, storage_name in (
        ("first run ever (new Prefect database)", "a"),
        ("new data", "b"),
        ("fully cached re-run", "b"),
    ):
        t0 = time.perf_counter()
        out = subprocess.run(
            [
                *cmd,
                "prepare",
                "--recipe",
                "default",
                "--source",
                str(source),
                "--storage",
                str(tmp / "cli-storage" / storage_name),
            ],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp,
            timeout=600,
        )
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"mllm-pipeline prepare failed ({out.returncode}):\n{out.stderr[-3000:]}")
        rows.append({"command": f"mllm-pipeline prepare: {what}", "wall_s": wall, "load": load()})
        print(f"  mllm-pipeline prepare, {what}: {wall:.1f} s", flush=True)
    return rows


def _options(p) -> None:
    p.add_argument("--scale-only", action="store_true", help="only part 3, the tokenizers at scale")
    p.add_argument("--sizes", help="text sizes in MB for part 3, e.g. 10,50,500")
    p.add_argument("--word-up-to", type=int, default=50, help="the word tokenizer only on texts up to this many MB")
    p.add_argument("--bpe-up-to", type=int, default=10, help="BPE only on texts up to this many MB")
    p.add_argument(
        "--many-files",
        action="store_true",
        help="instead: the stages on a corpus of many files (benchmarks/many_files.py)",
    )
    p.add_argument("--mb", type=int, default=1000, help="--many-files: the corpus's size in MB")
    p.add_argument("--files", type=int, default=2000, help="--many-files: how many files")


def report_flow(flow_rows: list[dict], cli_rows: list[dict], server_s: float | None) -> None:
    """Parts 1 and 2: the flow's stage times and the command's wall times."""
    print()
    print(
        table(
            flow_rows,
            [
                ("tokenizer", "tokenizer"),
                ("run", "run"),
                *[(s, f"{s} s") for s in STAGES],
                ("tokenize_mb_per_s", "tokenize MB/s"),
                ("flow_s", "flow s"),
                ("tokens", "tokens"),
                ("vocab", "vocab"),
                ("load", "load avg"),
            ],
        )
    )
    print(
        f"\nstage times: the Prefect task runs' start to end; flow: the whole call in this process, after "
        f"an empty flow had started Prefect's temporary server ({server_s:.1f} s)\n"
    )
    print(table(cli_rows, [("command", "command"), ("wall_s", "wall s"), ("load", "load avg")]))


def report_scale(scale_rows: list[dict]) -> dict[str, dict]:
    """Part 3: each stage's time and memory by size, and how its peak grew with the text."""
    print()
    print(
        table(
            scale_rows,
            [
                ("stage", "stage"),
                ("text_mb", "text MB"),
                ("seconds", "s"),
                ("mb_per_s", "MB/s"),
                ("cpu_s", "CPU s"),
                ("mb_per_cpu_s", "MB/CPU s"),
                ("peak_rss_mb", "peak RSS MB"),
                ("peak_anon_mb", "peak anonymous MB"),
                ("peak_file_mb", "peak file-backed MB"),
                ("start_rss_mb", "RSS at start MB"),
                ("added_anon_mb", "anonymous added MB"),
                ("load", "load avg"),
            ],
        )
    )
    growth = peak_growth(scale_rows)
    print()
    for stage, g in growth.items():
        # A stage that holds the ids of the whole text needs at least 4 bytes (int32) per token.
        verdict = "bounded" if g["anon_mb_per_text_mb"] < 1.0 else "NOT BOUNDED: grows with the text"
        print(
            f"{stage}: anonymous memory added at its peak {g['anon_from_mb']:,.0f} -> {g['anon_to_mb']:,.0f} MB for "
            f"{g['text_from']:.0f} -> {g['text_to']:.0f} MB of text: {g['anon_mb_per_text_mb']:+.2f} MB per MB "
            f"of text ({verdict}); whole RSS {g['rss_mb_per_text_mb']:+.2f} MB per MB"
        )
    return growth


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return

    args = parse_args(__doc__.splitlines()[0], _options)
    if args.many_files:
        from benchmarks import many_files

        many_files.main(100 if args.quick else args.mb, 200 if args.quick else args.files, list(many_files.KINDS))
        return
    m = header("data_stages", args.quick)
    source = corpus("warandpeace")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [10, 50] if args.quick else [10, 50, 500]
    more_up_to = 50
    flow_rows, cli_rows, server_s = [], [], None
    with tempfile.TemporaryDirectory(prefix="mllm-bench-data-") as tmp_name:
        tmp = Path(tmp_name)
        # Before the first import of prefect or mlflow: they read these once.
        env = {**prefect_env(tmp / "home"), "PREFECT_LOGGING_LEVEL": "WARNING"}
        os.environ.clear()
        os.environ.update(env)
        if not args.scale_only:
            print("1. the prepare flow in this process", flush=True)
            flow_rows, server_s = in_process(source, tmp)
            print("2. the mllm-pipeline prepare command", flush=True)
            cli_rows = cli_runs(source, tmp)
        print(
            f"3. tokenize on {' and '.join(f'{s} MB' for s in sizes)} (word up to {args.word_up_to} MB, BPE up to {args.bpe_up_to} MB; "
            f"char's vocabulary and split up to {more_up_to} MB)",
            flush=True,
        )
        from mllm.data.text import read_chunks, strip_gutenberg

        body = "".join(strip_gutenberg(read_chunks(str(source))))
        scale_rows = scale_runs(body, tmp, sizes, more_up_to, {"word": args.word_up_to, "bpe 2000": args.bpe_up_to})

    if flow_rows:
        report_flow(flow_rows, cli_rows, server_s)
    growth = report_scale(scale_rows)
    save(
        "data_stages",
        {
            "peak_growth": growth,
            "machine": m,
            "quick": args.quick,
            "flow": flow_rows,
            "prefect_start_s": server_s,
            "cli": cli_rows,
            "scale": scale_rows,
        },
    )


if __name__ == "__main__":
    main()
