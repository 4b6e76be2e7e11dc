"""How long Ctrl-C takes to stop `mllm-pipeline run` in the middle of its training, quiet and beside
CPU-bound processes: the bound docs/cli.md states.

    python -m benchmarks.interrupt [--repeats 3] [--busy 0,2] [--quick]

Each repeat runs, as a new user would (a temporary Prefect server, SQLite tracking, all in a
temporary folder), `mllm-pipeline run --recipe smoke` on War and Peace with training long enough
to be interrupted; once training has written its first checkpoint, SIGINT goes to the command's
process group (what a terminal's Ctrl-C does) and the time to the command's exit is measured.
`--busy N` starts N processes spinning on the CPU for the repeat (stopped after it). Figures:
seconds from the signal to the exit (median and worst), the exit status, and the 1-minute load
average when the signal was sent.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, corpus, header, parse_args, save, table


def _spin(until: float) -> None:
    x = 0
    while time.monotonic() < until:
        x += 1


def once(source: Path, folder: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PREFECT_HOME": str(folder / "prefect"),
        "PREFECT_API_URL": "",
        "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
    }
    storage = folder / "storage"
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(source),
        "--storage",
        str(storage),
        "--set",
        "train.max_steps=100000",
        "--set",
        "train.checkpoint_interval=20",
        "--set",
        "train.eval_interval=100000",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, text=True
    )
    deadline = time.monotonic() + 600
    while not list(storage.glob("runs/*/checkpoints/last.pt")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the run ended or stalled before its first checkpoint: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    time.sleep(2)  # in the middle of a step, as a user's Ctrl-C comes
    load = os.getloadavg()[0]
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    took = time.monotonic() - sent
    return {
        "seconds": round(took, 2),
        "exit": proc.returncode,
        "load": round(load, 2),
        "error_line": next((x for x in err.splitlines() if x.startswith("error:")), ""),
    }


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--repeats", type=int, default=3),
            p.add_argument("--busy", default="0,2", help="busy processes beside the run, per setting"),
        ),
    )
    source = corpus("warandpeace")
    m = header("interrupt", args.quick)
    rows = []
    for busy in [int(b) for b in args.busy.split(",")]:
        times = []
        for _ in range(1 if args.quick else args.repeats):
            spinners = [
                multiprocessing.Process(target=_spin, args=(time.monotonic() + 900,), daemon=True) for _ in range(busy)
            ]
            for s in spinners:
                s.start()
            try:
                with tempfile.TemporaryDirectory(prefix="bench-interrupt-") as tmp:
                    r = once(source, Path(tmp))
            finally:
                for s in spinners:
                    s.terminate()
                    s.join()
            print(f"busy {busy}: {r['seconds']} s (exit {r['exit']}, load {r['load']}) {r['error_line']}", flush=True)
            times.append(r)
        secs = sorted(r["seconds"] for r in times)
        rows.append(
            {
                "busy": busy,
                "repeats": len(secs),
                "median": secs[len(secs) // 2],
                "worst": secs[-1],
                "load": max(r["load"] for r in times),
                "exits": ",".join(str(r["exit"]) for r in times),
            }
        )
    print()
    print(
        table(
            rows,
            [
                ("busy", "busy processes"),
                ("repeats", "repeats"),
                ("median", "median s"),
                ("worst", "worst s"),
                ("load", "load at the signal (max)"),
                ("exits", "exit statuses"),
            ],
        )
    )
    save("interrupt", {"machine": m, "rows": rows})


if __name__ == "__main__":
    main()
