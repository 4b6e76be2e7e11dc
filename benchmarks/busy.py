"""The `default` recipe (what `make run` trains) on a quiet machine and beside a CPU-bound load.

    python -m benchmarks.busy [--minutes 3] [--load 2] [--quick]

Two trainings of the recipe on War and Peace through `python -m mllm.train`, one after the other,
each for the same time budget (train.max_minutes): the first with the machine as it is, the
second beside `--load` processes that spin on the CPU, started here and bounded in time (they
end themselves a little after the training's budget, and are killed when it ends). Figures per
training: steps done, tokens/s over the training, the threads it chose and why, whether its
record says the machine was busy, the share of its threads' time the CPU gave it, the steps it
estimates it would have done alone, and the load average. The ratio of the two step counts is
the figure: taken within one run of the benchmark, since on a shared machine the first training
is only as quiet as the other users leave it (the load average says how quiet).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, corpus, header, load, parse_args, run_config, save, table, token_ids

SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def train_once(paths: dict, folder: Path, minutes: float) -> dict:
    """One training of the default recipe for `minutes`: its result as `python -m mllm.train` gave it."""
    cfg = run_config("default", paths, folder / "checkpoints", {"train.max_minutes": minutes})
    config, events = folder / "config.yaml", folder / "events.jsonl"
    config.write_text(cfg.to_yaml())
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "mllm.train", "--config", str(config), "--events", str(events)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60 * minutes + 600,
    )
    if out.returncode != 0:
        raise SystemExit(f"error: the training failed:\n{out.stderr[-3000:]}")
    result = next(json.loads(line)["result"] for line in events.read_text().splitlines() if '"result"' in line)
    said = [line for line in out.stdout.splitlines() if line.startswith(("threads:", "the machine was busy"))]
    return {**result, "wall_s": round(time.perf_counter() - start, 1), "said": said, "load_end": load()}


KEPT = (
    "steps",
    "tokens_per_s",
    "val_loss",
    "threads",
    "threads_reason",
    "busy",
    "cpu_share",
    "steps_planned",
    "load_average",
    "wall_s",
    "said",
)


def beside_spinners(paths: dict, folder: Path, name: str, spinners: int, minutes: float) -> dict:
    """One training beside `spinners` CPU-bound processes: its row of the table."""
    folder.mkdir()
    # Bounded by themselves too: a benchmark killed with SIGKILL leaves nothing spinning for long.
    spin = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=60 * minutes + 120)]) for _ in range(spinners)]
    try:
        started = load()
        r = train_once(paths, folder, minutes)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    print(
        f"{name}: {r['steps']} steps, busy {r['busy']}, threads {r['threads']} ({r['threads_reason']})",
        flush=True,
    )
    return {"run": name, "load_start": started, **{k: r[k] for k in KEPT}}


def report(rows: list[dict], ratio: float) -> None:
    print()
    print(
        table(
            rows,
            [
                ("run", "machine"),
                ("load_start", "load at start"),
                ("steps", "steps"),
                ("tokens_per_s", "tok/s"),
                ("val_loss", "val loss"),
                ("threads", "threads"),
                ("busy", "record: busy"),
                ("cpu_share", "CPU share"),
                ("steps_planned", "steps planned"),
                ("load_average", "load at end"),
            ],
        )
    )
    print(
        f"\nsteps beside the load / steps as it is: {ratio:.2f} (acceptance: at least 0.33); "
        f"the second's record says busy: {rows[1]['busy']}"
    )


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--minutes", type=float, default=3.0, help="each training's time budget (default 3)"),
            p.add_argument("--load", type=int, default=2, help="CPU-bound processes beside the second (default 2)"),
        ),
    )
    minutes = 0.5 if args.quick else args.minutes
    machine = header("busy machine", args.quick)
    wp = corpus("warandpeace")
    with tempfile.TemporaryDirectory(prefix="bench-busy-") as tmp_name:
        tmp = Path(tmp_name)
        paths = token_ids(wp, tmp / "wp")
        rows = [
            beside_spinners(paths, tmp / f"run-{spinners}", name, spinners, minutes)
            for name, spinners in (("as it is", 0), (f"beside {args.load} spinning processes", args.load))
        ]
    ratio = rows[1]["steps"] / rows[0]["steps"]
    report(rows, ratio)
    save(
        "busy",
        {"machine": machine, "minutes": minutes, "load_processes": args.load, "rows": rows, "ratio": round(ratio, 3)},
    )


if __name__ == "__main__":
    main()
