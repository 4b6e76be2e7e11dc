"""Where the test suite's CPU goes: each test's CPU seconds, and those of everything it started.

    python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p benchmarks.suite_cpu
    python -m benchmarks.suite_cpu            # the summary: by module, then the costliest tests

A pytest plugin (by hand, as root, not in `make test`): each xdist worker moves itself into a
control group of its own (cgroup v1 `cpuacct`, or a v2 group with the `cpu` controller), so that
the servers, commands, flow runs and trainings it starts are counted with it wherever they run,
and at each test's teardown it writes the CPU the group used since the last one, module fixtures
included, to benchmarks/out/suite-cpu-<worker>.jsonl. Docker's containers run in the engine's
groups and are not counted. Wall clock says how long a test waited; this says what it cost the
cores, which is what two workers on two cores run out of.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
_state: dict = {}


def _group(name: str) -> tuple[Path, str] | None:
    """A new control group for this process, and the file whose count of CPU time it reads."""
    for root, counter in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"), (Path("/sys/fs/cgroup"), "cpu.stat")):
        if not (root / counter).exists() and not (root / "cgroup.procs").exists():
            continue
        try:
            group = root / name
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            continue
        if (group / counter).exists():
            return group, counter
    return None


def _used_s(group: Path, counter: str) -> float:
    text = (group / counter).read_text()
    if counter == "cpuacct.usage":
        return int(text) / 1e9
    return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6


def pytest_configure(config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if os.environ.get("PYTEST_XDIST_WORKER") is None and getattr(config.option, "numprocesses", None):
        return  # the controller runs no tests
    found = _group(f"mllm-suite-{worker}-{os.getpid()}")
    if found is None:
        import pytest

        config.issue_config_time_warning(
            pytest.PytestConfigWarning(
                "benchmarks.suite_cpu: no control group could be made (it needs root, and cgroup v1 cpuacct or v2 "
                "cpu): nothing recorded"
            ),
            stacklevel=2,
        )
        return
    OUT.mkdir(parents=True, exist_ok=True)
    _state.update(group=found, last=_used_s(*found), out=open(OUT / f"suite-cpu-{worker}.jsonl", "w"))


def pytest_runtest_logreport(report) -> None:
    if report.when != "teardown" or "group" not in _state:
        return
    now = _used_s(*_state["group"])
    _state["out"].write(
        json.dumps({"test": report.nodeid, "cpu_s": round(now - _state["last"], 3), "at": round(time.time(), 1)}) + "\n"
    )
    _state["out"].flush()
    _state["last"] = now


def main() -> int:
    rows = [json.loads(line) for path in sorted(OUT.glob("suite-cpu-*.jsonl")) for line in path.open()]
    if not rows:
        print(f"nothing recorded in {OUT}: run the suite with -p benchmarks.suite_cpu first (as root)")
        return 1
    total = sum(r["cpu_s"] for r in rows)
    modules = collections.Counter()
    for r in rows:
        modules[r["test"].split("::")[0]] += r["cpu_s"]
    print(f"{len(rows)} tests, {total:,.0f} CPU seconds (Docker's containers not counted)\n")
    print("| module | CPU s | share |\n|---|---|---|")
    for name, cpu in modules.most_common(15):
        print(f"| `{name}` | {cpu:,.0f} | {cpu / total:.0%} |")
    print("\n| test | CPU s |\n|---|---|")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:15]:
        print(f"| `{r['test']}` | {r['cpu_s']:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
