"""What the orchestration costs: the smoke recipe's wall time broken into its parts.

    python -m benchmarks.orchestration [--quick]

`mllm-pipeline run --recipe smoke` on War and Peace, as a user runs it, in a fresh process each
time: first on new storage (every stage runs, training included), then again (every stage
reused, training skipped: the champion was trained on the same data, config and code). Both with
Prefect's temporary server, and again with a running stack (`mllm-pipeline stack up`: a Prefect
server and an MLflow server over HTTP). The parts come from the timestamps of the run's own log
lines:

- start-up: the process start to the pipeline's first flow run: imports, config, the preflight
  checks, and Prefect's temporary server, which the CLI starts in the background while it
  imports torch, MLflow and the flows;
- data: the data stages (the `prepare` flow);
- tracking set-up and training: from the data to the end of the `train` flow;
- evaluate and sample: the `evaluate` flow; registry: the model, the champion, the artifacts;
- shutdown: the pipeline's end to the process's exit.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, corpus, header, load, parse_args, save, table

_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| \w+ +\| (.*)$")
_SKIPPED = r"Task run 'log-skipped-\w+' - Finished"
EVENTS = {  # the log line (a regex) that closes each part: the first after the last part's end
    "start-up": r"Beginning flow run .* for flow 'pipeline'",
    "data": r"Flow run '[^']+' - Finished in state",  # the prepare flow's end
    "tracking set-up and training": rf"Beginning subflow run .* for flow 'evaluate'|{_SKIPPED}",
    "evaluate and sample": rf"Flow run '[^']+' - Finished in state|{_SKIPPED}",
    "registry": None,  # to the pipeline's own end: the last flow run to finish
}


def run(source: Path, storage: Path, env: dict[str, str]) -> dict[str, float]:
    started = dt.datetime.now()
    t0 = time.perf_counter()
    out = subprocess.run(
        [
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
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env, "PREFECT_LOGGING_LEVEL": "INFO"},
        timeout=900,
    )
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"the smoke run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    stamps = []
    for line in out.stderr.splitlines():
        m = _LINE.match(line)
        if m:
            clock = dt.datetime.combine(started.date(), dt.time.fromisoformat(m.group(1)))
            stamps.append(((clock - started).total_seconds(), m.group(2)))
    parts, at, i = {}, 0.0, 0
    for part, pattern in EVENTS.items():
        if pattern is None:
            ends = [t for t, text in stamps if re.search(r"Flow run '[^']+' - Finished in state", text)]
            end = ends[-1] if ends else at
        else:
            while i < len(stamps) and not re.search(pattern, stamps[i][1]):
                i += 1
            end = stamps[i][0] if i < len(stamps) else at
        parts[part], at = max(0.0, end - at), max(at, end)
    parts["shutdown"] = max(0.0, wall - at)
    parts["total"] = wall
    parts["skipped"] = "skipped:" in out.stdout
    return parts


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    source = corpus("warandpeace")
    machine = header("orchestration: the smoke run's wall time, part by part", args.quick)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mllm-bench-orch-") as tmp:
        tmp = Path(tmp)
        temporary = {
            "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_API_URL": "",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
        }
        for label in ("new storage", "reused"):
            rows.append({"prefect": "temporary server", "run": label, **run(source, tmp / "storage-temp", temporary)})
        if not args.quick:
            home = tmp / "stack"
            up = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "flows.cli",
                    "stack",
                    "up",
                    "--home",
                    str(home),
                    "--storage",
                    str(tmp / "stack-storage"),
                    "--prefect-port",
                    "0",
                    "--mlflow-port",
                    "0",
                ],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=600,
            )
            try:
                if up.returncode:
                    raise SystemExit(f"stack up failed:\n{up.stderr[-3000:]}")
                exports = re.search(r"export (.*)", up.stdout).group(1).split()
                stack_env = dict(e.split("=", 1) for e in exports)
                for label in ("new storage", "reused"):
                    rows.append({"prefect": "stack", "run": label, **run(source, tmp / "storage-stack", stack_env)})
            finally:
                subprocess.run(
                    [sys.executable, "-m", "flows.cli", "stack", "down", "--home", str(home)],
                    capture_output=True,
                    cwd=REPO,
                    timeout=300,
                )
    columns = [
        ("prefect", "Prefect"),
        ("run", "run"),
        *[(p, p) for p in EVENTS],
        ("shutdown", "shutdown"),
        ("total", "total s"),
    ]
    for row in rows:
        for key in (*EVENTS, "shutdown", "total"):
            row[key] = round(row[key], 1)
    print(table(rows, columns))
    print(f"\nload {load()} at the end")
    save("orchestration", {"machine": machine, "rows": rows})


if __name__ == "__main__":
    main()
