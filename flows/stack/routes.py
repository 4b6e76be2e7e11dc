"""The Prefect and MLflow servers' own route lists, as the stack's gate resolves requests against
them (flows/stack/routes.json): Prefect's OpenAPI document and websocket routes, MLflow's Flask
routes with its basic-auth app's. `python -m flows.stack.routes` writes the file again after an
upgrade of either server; tests/stack/test_stack_policy.py fails until it is.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import warnings
from pathlib import Path

from flows.settings import process_defaults
from flows.stack.policy import ROUTES
from mllm.settings import exported

# Prefect's UI and API documents, outside the API's OpenAPI document: served to any path.
_PREFECT_EXTRA = [("GET", "/{ui:path}")]


def prefect_routes() -> list[tuple[str, str]]:
    from prefect.server.api.server import create_app

    app = create_app(ephemeral=True)
    api = next(r for r in app.routes if getattr(r, "path", None) == "/api").app
    found = {(m.upper(), "/api" + p) for p, ops in api.openapi()["paths"].items() for m in ops}
    for included in api.routes:  # websockets are in no OpenAPI document
        for route in getattr(getattr(included, "original_router", None), "routes", []):
            if "WebSocket" in type(route).__name__:
                found.add(("WS", "/api" + route.path))
    return sorted(found | set(_PREFECT_EXTRA), key=lambda r: (r[1], r[0]))


def mlflow_routes() -> list[tuple[str, str]]:
    """MLflow's Flask routes with its basic-auth app's (made on a throwaway database)."""
    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "auth.ini"
        ini.write_text(
            f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{tmp}/auth.db\n"
            "admin_username = routes\nadmin_password = routes-listing-only-0\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        settings = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "routes-listing-only"}
        with exported(settings), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from mlflow.server import app
            from mlflow.server.auth import create_app

            flask = create_app(app)
    found = set()
    for rule in flask.url_map.iter_rules():
        template = re.sub(r"<(?:path:)([^>]+)>", r"{\1:path}", rule.rule)
        template = re.sub(r"<(?:\w+:)?([^>]+)>", r"{\1}", template)
        found |= {(m, template) for m in rule.methods - {"HEAD", "OPTIONS"}}
    return sorted(found, key=lambda r: (r[1], r[0]))


def current() -> dict[str, list[tuple[str, str]]]:
    return {"prefect": prefect_routes(), "mlflow": mlflow_routes()}


def main() -> None:
    process_defaults()  # before Prefect and MLflow are imported: no telemetry
    data = current()
    # One route a line: a server upgrade's difference reads as lines added and removed.
    lines = {s: ",\n".join(f"  {json.dumps(list(r))}" for r in found) for s, found in data.items()}
    ROUTES.write_text("{\n" + ",\n".join(f'"{s}": [\n{body}\n]' for s, body in lines.items()) + "\n}\n")
    print(f"{ROUTES}: {len(data['prefect'])} Prefect and {len(data['mlflow'])} MLflow routes", file=sys.stderr)


if __name__ == "__main__":
    main()
