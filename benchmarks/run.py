"""Every benchmark in turn, each in a process of its own (`make bench`).

    python -m benchmarks.run [--quick] [--threads N] [--only NAME ...]

Separate processes so that no benchmark inherits another's thread setting, Prefect or MLflow
configuration, or memory high-water mark. Each prints its table and writes benchmarks/out/NAME.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks.common import REPO, hms

BENCHMARKS = ("vs_nanogpt", "train_speed", "generate_speed", "data_stages", "tracking_overhead", "orchestration")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the shorter pass of every benchmark")
    p.add_argument("--threads", type=int, help="torch threads, passed on to each benchmark")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    args = p.parse_args()
    passed = ["--quick"] if args.quick else []
    if args.threads:
        passed += ["--threads", str(args.threads)]
    failed, t_all = [], time.perf_counter()
    for name in args.only or BENCHMARKS:
        t0 = time.perf_counter()
        print(f"\n{'=' * 20} benchmarks.{name} {' '.join(passed)}", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}", *passed], cwd=REPO)
        print(
            f"{'=' * 20} {name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {hms(time.perf_counter() - t0)}",
            flush=True,
        )
        if rc:
            failed.append(name)
    print(
        f"\nall benchmarks: {hms(time.perf_counter() - t_all)}" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
