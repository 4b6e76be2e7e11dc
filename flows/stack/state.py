"""The stack's state file, `<home>/stack.json`: what `stack up` started (process ids, command
lines, URLs, log files) and the environment its clients use. No secret is written here."""

from __future__ import annotations

import json
from pathlib import Path

from flows.settings import settings
from flows.stack.processes import Service


def stack_home(home: str | None = None) -> Path:
    return Path(home or settings().stack_home or ".mllm-stack").expanduser().resolve()


def state_file(home: Path) -> Path:
    return home / "stack.json"


def load(home: Path) -> dict:
    try:
        state = json.loads(state_file(home).read_text())
    except (OSError, ValueError):
        return {"services": [], "env": {}}
    state["services"] = [Service(**s) for s in state.get("services", [])]
    return state


def save(
    home: Path, services: list[Service], env: dict[str, str], pool: str, storage: str, worker_env: dict[str, str]
) -> None:
    home.mkdir(parents=True, exist_ok=True)
    tmp = state_file(home).with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "services": [s.saved() for s in services],
                "env": env,
                "pool": pool,
                "storage": storage,
                "worker_env": worker_env,
            },
            indent=2,
        )
        + "\n"
    )
    tmp.replace(state_file(home))
