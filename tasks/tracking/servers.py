"""Whether the tracking and Prefect servers answer, and the one line a user reads for a server that
failed (how it failed, and what to do), shown by the terminal whichever answers first."""

from __future__ import annotations

import contextlib
import http
import re
import time
import urllib.error
import urllib.request

from mllm import failures
from mllm.failures import exception_chain
from mllm.redact import strip_userinfo
from tasks.settings import settings


def server() -> str | None:
    """The tracking server's URL (without credentials), or None for a local store."""
    uri = settings().mlflow_tracking_uri.strip()
    return strip_userinfo(uri)[0].rstrip("/") if uri.startswith(("http://", "https://")) else None


def answers(timeout: float = 3.0) -> bool:
    """Whether the tracking server answers its health check (a local store always does)."""
    url = server()
    if url is None:
        return True
    req, ctx = health_request(f"{url}/health")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (a proxy in front may guard /health)
    except (OSError, ValueError):
        return False


def health_request(url: str):
    """MLflow's health URL as its client would reach it: its CA file, its credential (a server
    behind the stack's proxy answers /health only to a user it knows)."""
    import base64
    import ssl

    req = urllib.request.Request(url)
    s = settings()
    user, password = s.mlflow_tracking_username, s.mlflow_tracking_password
    if user and password:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    ca = s.mlflow_tracking_server_cert_path
    return req, (ssl.create_default_context(cafile=ca) if ca and url.startswith("https") else None)


def how_failed(exc: BaseException | None, silent: str = "stopped answering") -> str:
    """How a server failed, in words: "answered 503 Service Unavailable" when the chain of `exc`
    holds a 5xx answer (MLflow's client gives up on a busy server with "too many 503 error
    responses"), else "stopped answering"."""
    for e in exception_chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        found = re.search(r"\b(5\d\d) (?:error responses|[A-Z])", str(e))
        code = status if isinstance(status, int) and status >= 500 else int(found.group(1)) if found else None
        if code is not None:
            with contextlib.suppress(ValueError):
                return f"answered {code} {http.HTTPStatus(code).phrase}"
            return f"answered {code}"
    return silent


def _advice(how: str, silent: str, restart: str) -> str:
    """What to do about a server that failed `how`: start it again when it is gone; when it
    answered errors, find why in its log and wait for it."""
    return (
        f"start it again ({restart}) and"
        if how == silent
        else "see why in its log (`mllm-pipeline stack status` names it) and, once it answers again,"
    )


def tracking_down(exc: BaseException | None) -> str | None:
    """One line when `exc` (or what caused it) is the tracking server not answering, or answering
    only 5xx until the client's retries ran out; else None."""
    url = server()
    for e in exception_chain(exc) if url else ():
        text = str(e)
        if failures.no_answer(e) and (url.split("://", 1)[1] in text or "API request to" in text):
            how = how_failed(e)
            fix = _advice(how, "stopped answering", "`mllm-pipeline stack up` restarts one")
            return (
                f"the MLflow tracking server {url} {how}: {fix} run the same command; finished stages and "
                "training are kept in storage and reused, and the unfinished MLflow run is closed then"
            )
    return None


_probed: dict[str, tuple[float, bool]] = {}


def wait_for_servers() -> bool:
    """Wait until the Prefect server ($PREFECT_API_URL) and the MLflow server answer their health
    checks with 200, for at most MLLM_SERVERS_WAIT_S seconds (240 by default); whether they did.
    Prefect's is its readiness (`/ready`, which asks its database, as the MLflow server of the
    stack shares that database): its `/health` says 200 while that database is down."""
    urls = [
        u
        for u in (settings().prefect_api_url.rstrip("/") + "/ready", (server() or "") + "/health")
        if u.startswith(("http://", "https://"))
    ]
    deadline, pause = time.monotonic() + settings().servers_wait_s, 1.0
    while True:
        pending = []
        for url in urls:
            clean = strip_userinfo(url)[0]
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}) if "127.0.0.1" in clean else urllib.request.ProxyHandler()
            )
            try:
                with opener.open(url, timeout=10):
                    pass
            except (OSError, ValueError):  # HTTPError (a 503) is an OSError too
                pending.append(url)
        urls = pending
        if not urls or time.monotonic() + pause > deadline:
            return not urls
        time.sleep(pause)
        pause = min(pause * 2, 15.0)


def prefect_database_down() -> str | None:
    """The Prefect server's API URL when that server answers that its database is not available
    (its /ready says 503; the stack's MLflow server shares that database), else None. One look
    every few seconds at most: the terminal's log filter asks for each failure it sees."""
    api = settings().prefect_api_url.rstrip("/")
    if not api.startswith(("http://", "https://")):
        return None
    at, down = _probed.get(api, (0.0, False))
    if time.monotonic() - at > 5.0:
        try:
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}) if "127.0.0.1" in api else urllib.request.ProxyHandler()
            )
            with opener.open(f"{api}/ready", timeout=5):
                down = False
        except urllib.error.HTTPError as e:
            down = e.code == 503
        except (OSError, ValueError):
            down = False  # the server itself is away: not its database's doing
        _probed[api] = (time.monotonic(), down)
    return strip_userinfo(api)[0] if down else None


def prefect_down(exc: BaseException | None) -> str | None:
    """One line when `exc` (or what caused it) is Prefect's client (httpx) meeting no answer, or only
    5xx answers, from its server; else None. Without $PREFECT_API_URL that server is the temporary
    one Prefect starts inside the command."""
    for e in exception_chain(exc):
        if failures.from_http_client(e) and (failures.dropped(e) or failures.server_error(e)):
            api = settings().prefect_api_url.rstrip("/")
            how = how_failed(e, "does not answer")
            if not api:
                return (
                    f"Prefect's temporary server (started by this command, as PREFECT_API_URL is not set) {how}: "
                    "run the same command again (finished stages and training are kept in storage and "
                    "reused); commands run side by side do better on one server (`mllm-pipeline stack up`)"
                )
            fix = _advice(how, "does not answer", "`mllm-pipeline stack up` restarts the stack's")
            return (
                f"the Prefect server {strip_userinfo(api)[0]} {how}: {fix} run the same command; finished "
                "stages and training are kept in storage and reused"
            )
    return None
