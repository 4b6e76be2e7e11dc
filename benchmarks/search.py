"""A search (TPE sampler, median pruner) against a grid of as many points, on War and Peace.

    python -m benchmarks.search [--quick] [--threads 2] [--steps 300] [--points 4]

Both run through the command line a user types, each in a storage root of its own (so neither
reuses the other's trainings; each prepares the data once, which its wall time includes):

- the grid: `mllm-pipeline sweep --grid train.lr=...` over `--points` learning rates spaced
  evenly in the logarithm between 1e-4 and 1e-2, every point trained to --steps;
- the search: `mllm-pipeline search --space train.lr=log:1e-4..1e-2 --trials POINTS --sampler
  tpe --pruner median`, evaluations every tenth of --steps, the median pruner active after the
  first trial (--startup-trials 1).

Reported for each: the best final validation loss (nats per character: the smoke recipe's char
tokenizer), the training steps spent (the grid's points × --steps; the search's summed from its
table), and the wall time. The recipe is `smoke` (a tiny GPT: the budget is minutes on a shared
CPU, not the issue's 20-minute `default` grid). With as few trials as this TPE samples at random
(its startup), so the search's edge here is the pruner's, not the sampler's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, corpus, header, load, parse_args, save, table

SPACE = "train.lr=log:1e-4..1e-2"


def _cli(args: list[str], cwd: Path, threads: int) -> tuple[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO), PREFECT_HOME=str(cwd / "prefect"),
               PYTHONUNBUFFERED="1")
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MLLM_STORAGE", "MLLM_STUDY_DATABASE"):
        env.pop(name, None)  # a root, an MLflow store and a study of the benchmark's own
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, text=True, capture_output=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, seconds


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--steps", type=int, default=None, help="training steps of each point and trial [300; quick 150]"),
        p.add_argument("--points", type=int, default=4, help="grid points, and so search trials [4]")))
    wp = corpus("warandpeace")
    m = header("search", args.quick)
    steps = args.steps or (150 if args.quick else 300)
    threads = args.threads or 2
    every = max(1, steps // 10)
    fixed = [f"train.max_steps={steps}", f"train.eval_interval={every}", f"train.checkpoint_interval={steps}",
             f"train.log_interval={every}", "sample.max_new_tokens=20"]
    sets = [a for s in fixed for a in ("--set", s)]
    lrs = [f"{10 ** (-4 + 2 * i / (args.points - 1)):.3g}" for i in range(args.points)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "grid").mkdir()
        (tmp / "search").mkdir()
        load_before = load()
        _, grid_s = _cli(["sweep", "--recipe", "smoke", "--source", str(wp), "--storage", str(tmp / "grid" / "storage"),
                          "--grid", "train.lr=" + ",".join(lrs), *sets], tmp / "grid", threads)
        grid_rows = json.loads(next((tmp / "grid" / "storage" / "sweeps").glob("*/sweep.json")).read_text())
        done = [r for r in grid_rows if r["status"] == "ok"]
        rows.append({"how": f"grid, {args.points} points", "best": min(r["val_loss"] for r in done),
                     "best_lr": min(done, key=lambda r: r["val_loss"])["train.lr"], "steps": len(done) * steps,
                     "wall_s": grid_s, "load": f"{load_before:.1f}-{load():.1f}"})
        load_before = load()
        out, search_s = _cli(["search", "--recipe", "smoke", "--source", str(wp), "--storage",
                              str(tmp / "search" / "storage"), "--space", SPACE, "--trials", str(args.points),
                              "--sampler", "tpe", "--pruner", "median", "--startup-trials", "1", "--study", "bench",
                              *sets], tmp / "search", threads)
        trials = json.loads((tmp / "search" / "storage" / "searches" / "bench" / "search.json").read_text())
        finished = [t for t in trials if t["state"] == "complete"]
        rows.append({"how": f"TPE + median pruner, {args.points} trials", "best": min(t["val_loss"] for t in finished),
                     "best_lr": min(finished, key=lambda t: t["val_loss"])["train.lr"],
                     "steps": sum(t["step"] or 0 for t in trials), "wall_s": search_s,
                     "load": f"{load_before:.1f}-{load():.1f}",
                     "pruned": sum(t["state"] == "pruned" for t in trials)})
    for r in rows:
        r["best_lr"] = f"{float(r['best_lr']):.3g}"
        r["bpc"] = r["best"] / math.log(2)
    print(table(rows, [("how", "run"), ("best", "best val loss"), ("bpc", "bits/char"), ("best_lr", "its lr"),
                       ("steps", "training steps"), ("pruned", "pruned"), ("wall_s", "wall s"), ("load", "load avg")]))
    save("search", {"machine": m, "steps": steps, "points": args.points, "threads": threads, "space": SPACE,
                    "grid_lrs": lrs, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
