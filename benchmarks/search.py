"""Searches (TPE sampler; the median and the halving pruner) against a grid, on War and Peace, at a size given.

    python -m benchmarks.search [--quick] [--grid-points K] [--fields 1|2] [--steps N] [--trials N]
                                [--startup-trials S] [--pruners median,halving] [--source FILE] [--threads 2]

Both run through the command line a user types, each in a storage root of its own (so neither
reuses the other's trainings; each prepares the data once, which its wall time includes), on the
`default` recipe as it was measured (AdamW alone, learned positions, GELU) with its precision
fixed (bf16) and compile off, so that a probe timed on a busy machine cannot make the two differ:

- the grid: `mllm-pipeline sweep --grid train.lr=... [--grid train.beta2=...]`, K learning rates
  spaced evenly in the logarithm from 2e-3 to 3.2e-2 (times K values of AdamW's beta2 from 0.9 to
  0.999 with --fields 2): K**fields points, every one trained to --steps;
- a search per pruner: `mllm-pipeline search --space train.lr=log:2e-3..3.2e-2 [--space
  train.beta2=0.9..0.999] --trials N --sampler tpe --pruner P --startup-trials S`, the same box as
  ranges, evaluations every tenth of --steps; TPE draws its first S trials at random, and the
  median pruner waits for S finished trials (the halving pruner needs none).

The search's trials default to three quarters of the grid's points and S to a quarter of the
trials (at least 2): 12 and 3 against the 4 x 4 grid, as first measured. Reported for each: the
best final validation loss (nats per character: the recipe's char tokenizer), the training steps
spent (the grid's points x --steps; the search's summed from its table) and their share of the
grid's, and the wall time. --quick: the smoke recipe, 150 steps, a 2 x 2 grid unless
--grid-points says otherwise. SIGTERM or Ctrl-C stops the command in flight (SIGTERM to its
process group, which stops as any command does) and removes the temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, corpus, header, load, parse_args, save, table

LR, BETA2 = (2e-3, 3.2e-2), (0.9, 0.999)


class Stopped(SystemExit):
    """SIGTERM: unwound like Ctrl-C, so that the command in flight is stopped and the temporary
    folder removed on the way out."""


def _stop(signum: int, _frame: object) -> None:
    raise Stopped(128 + signum)


def _cli(args: list[str], cwd: Path, threads: int) -> tuple[str, float]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=str(REPO),
        PREFECT_HOME=str(cwd / "prefect"),
        PYTHONUNBUFFERED="1",
    )
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MLLM_STORAGE", "MLLM_STUDY_DATABASE"):
        env.pop(name, None)  # a root, an MLflow store and a study of the benchmark's own
    started = time.perf_counter()
    # A group of its own, so that a stop reaches the command's temporary Prefect server too.
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate()
    except BaseException:
        _end(proc)
        raise
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({proc.returncode}):\n{err[-3000:]}")
    return out, seconds


def _end(proc: subprocess.Popen) -> None:
    """The command asked to stop as Ctrl-C would (it ends its flow runs), then killed if it has not
    within a minute; and every process it started (its temporary Prefect server leads a group of
    its own) ended before the temporary folder they write in is removed."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=60)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    proc.wait()


def _sizes(args, quick: bool) -> tuple[int, int, int, int]:
    """Values per field, fields, trials, TPE's random trials."""
    per_axis = args.grid_points or (2 if quick else 4)
    if per_axis < 2 or args.fields not in (1, 2):
        raise SystemExit("--grid-points takes 2 or more; --fields takes 1 (lr) or 2 (lr and beta2)")
    trials_n = args.trials or max(2, round(0.75 * per_axis**args.fields))
    startup = args.startup_trials if args.startup_trials is not None else max(2, round(trials_n / 4))
    return per_axis, args.fields, trials_n, startup


def _args():
    return parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--grid-points", type=int, default=None, help="values per field in the grid [4; quick 2]"),
            p.add_argument("--fields", type=int, default=2, help="1: the learning rate; 2: and beta2 [2]"),
            p.add_argument(
                "--steps", type=int, default=None, help="training steps of each point and trial [1000; quick 150]"
            ),
            p.add_argument("--trials", type=int, default=None, help="the search's trials [3/4 of the grid's points]"),
            p.add_argument(
                "--startup-trials",
                type=int,
                default=None,
                help="TPE's random trials; the median pruner waits for as many [a quarter of the trials, at least 2]",
            ),
            p.add_argument("--pruners", default="median,halving", help="a search per pruner [median,halving]"),
            p.add_argument("--source", default=None, help="the corpus [../shared/data/warandpeace.txt]"),
        ),
    )


def _sets(recipe: str, steps: int) -> list[str]:
    """The --set options every point and trial gets: its steps, evaluations, precision."""
    every = max(1, steps // 10)
    fixed = [
        f"train.max_steps={steps}",
        f"train.eval_interval={every}",
        f"train.checkpoint_interval={steps}",
        f"train.log_interval={every}",
        "train.dtype=bfloat16",
        "train.compile=false",
        "sample.max_new_tokens=20",
    ]
    if recipe == "default":  # the default as the figures in docs/search.md were measured: AdamW alone (54c4b00)
        fixed += ["train.optimizer=adamw", "model.positions=learned", "model.mlp=gelu"]
    return [a for s in fixed for a in ("--set", s)]


def grid_row(
    wp: Path, recipe: str, axes: dict[str, list[str]], sets: list[str], tmp: Path, threads: int, steps: int
) -> dict:
    """The grid as one `mllm-pipeline sweep`: its best point and the steps it took."""
    load_before = load()
    _, grid_s = _cli(
        [
            "sweep",
            "--recipe",
            recipe,
            "--source",
            str(wp),
            "--storage",
            str(tmp / "grid" / "storage"),
            *[a for f, vs in axes.items() for a in ("--grid", f"{f}={','.join(vs)}")],
            *sets,
        ],
        tmp / "grid",
        threads,
    )
    grid_rows = json.loads(next((tmp / "grid" / "storage" / "sweeps").glob("*/sweep.json")).read_text())
    done = [r for r in grid_rows if r["status"] == "ok"]
    best = min(done, key=lambda r: r["val_loss"])
    return {
        "how": f"grid, {len(grid_rows)} points",
        **_best(best, axes),
        "steps": len(done) * steps,
        "wall_s": grid_s,
        "load": f"{load_before:.1f}-{load():.1f}",
    }


def search_row(
    wp: Path,
    recipe: str,
    space: list[str],
    sets: list[str],
    folder: Path,
    threads: int,
    trials_n: int,
    startup: int,
    pruner: str,
    axes: dict,
) -> dict:
    """One `mllm-pipeline search` with TPE and `pruner`: its best trial and the steps it took."""
    load_before = load()
    _, search_s = _cli(
        [
            "search",
            "--recipe",
            recipe,
            "--source",
            str(wp),
            "--storage",
            str(folder / "storage"),
            *[a for sp in space for a in ("--space", sp)],
            "--trials",
            str(trials_n),
            "--sampler",
            "tpe",
            "--pruner",
            pruner,
            "--startup-trials",
            str(startup),
            "--study",
            "bench",
            *sets,
        ],
        folder,
        threads,
    )
    trials = json.loads((folder / "storage" / "searches" / "bench" / "search.json").read_text())
    finished = [t for t in trials if t["state"] == "complete"]
    return {
        "how": f"TPE + {pruner} pruner, {trials_n} trials",
        **_best(min(finished, key=lambda t: t["val_loss"]), axes),
        "steps": sum(t["step"] or 0 for t in trials),
        "wall_s": search_s,
        "load": f"{load_before:.1f}-{load():.1f}",
        "pruned": sum(t["state"] == "pruned" for t in trials),
    }


def report(rows: list[dict], axes: dict[str, list[str]], size: str) -> None:
    """The table, and each search's distance to the grid's best in a share of its steps."""
    grid = rows[0]
    for r in rows:
        r["bpc"] = r["best"] / math.log(2)
        r["share"] = f"{r['steps'] / grid['steps']:.0%}"
    print(
        table(
            rows,
            [
                ("how", "run"),
                ("best", "best val loss"),
                ("bpc", "bits/char"),
                *[(f, f"its {f.split('.')[1]}") for f in axes],
                ("steps", "training steps"),
                ("share", "of the grid's"),
                ("pruned", "pruned"),
                ("wall_s", "wall s"),
                ("load", "load avg"),
            ],
        )
    )
    for search in rows[1:]:
        print(
            f"\n{size}, {search['how']}: its best is {search['best'] - grid['best']:+.4f} from the grid's, in "
            f"{search['share']} of its training steps"
        )


def main() -> int:
    args = _args()
    signal.signal(signal.SIGTERM, _stop)
    wp = Path(args.source).resolve() if args.source else corpus("warandpeace")
    m = header("search", args.quick)
    recipe = "smoke" if args.quick else "default"
    per_axis, fields, trials_n, startup = _sizes(args, args.quick)
    steps = args.steps or (150 if args.quick else 1000)
    threads = args.threads or 2
    sets = _sets(recipe, steps)
    axes = {
        "train.lr": [f"{LR[0] * (LR[1] / LR[0]) ** (i / (per_axis - 1)):.3g}" for i in range(per_axis)],
        "train.beta2": [f"{BETA2[0] + (BETA2[1] - BETA2[0]) * i / (per_axis - 1):.4g}" for i in range(per_axis)],
    }
    axes = dict(list(axes.items())[:fields])
    space = [f"train.lr=log:{LR[0]}..{LR[1]}", f"train.beta2={BETA2[0]}..{BETA2[1]}"][:fields]
    size = f"{' x '.join([str(per_axis)] * fields)} grid"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-search-", ignore_cleanup_errors=True) as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "grid").mkdir()
        rows.append(grid_row(wp, recipe, axes, sets, tmp, threads, steps))
        for pruner in args.pruners.split(","):
            folder = tmp / f"search-{pruner}"
            folder.mkdir()
            rows.append(search_row(wp, recipe, space, sets, folder, threads, trials_n, startup, pruner, axes))
    report(rows, axes, size)
    name = f"search{'-quick' if args.quick else ''}-{'x'.join([str(per_axis)] * fields)}"
    save(
        name,
        {
            "machine": m,
            "recipe": recipe,
            "steps": steps,
            "threads": threads,
            "space": space,
            "grid": axes,
            "trials": trials_n,
            "startup_trials": startup,
            "pruners": args.pruners,
            "rows": rows,
            "command": " ".join(["python -m benchmarks.search", *sys.argv[1:]]),
        },
    )
    return 0


def _best(row: dict, axes: dict[str, list[str]]) -> dict:
    """A table row's best val loss and the values it was found at."""
    return {
        "best": row["val_loss"],
        **{f: f"{float(row[f]):.3g}" if f == "train.lr" else f"{float(row[f]):.4g}" for f in axes},
    }


if __name__ == "__main__":
    raise SystemExit(main())
