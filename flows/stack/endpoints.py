"""Where a secured stack serves: its endpoints file (address, ports, the servers' and the gate's
Unix sockets, certificates), written by `stack up` and read by the proxy, the gate and clients."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from flows.stack.users import folder


def secured(home: Path) -> dict | None:
    """How the stack in `home` serves when it is secured (no secret in it), else None."""
    try:
        return json.loads((folder(home) / "endpoints.json").read_text())
    except (OSError, ValueError):
        return None


def gate_socket(home: Path) -> Path:
    """The gate's Unix socket, in a 0700 folder: only the stack's own user (the proxy) reaches it."""
    return folder(home) / "gate" / "gate.sock"


def server_sockets(home: Path) -> dict[str, str]:
    """The Prefect and MLflow servers' Unix sockets on a secured stack, in a 0700 folder: no
    server listens on TCP, and only the stack's own user reaches them."""
    return {s: str(folder(home) / "servers" / f"{s}.sock") for s in ("prefect", "mlflow")}


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
