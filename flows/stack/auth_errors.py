"""One line for a client of a secured stack that is refused: a credential the server does not
take (401), a role that does not allow what was asked (403), a certificate the client does not
trust. Prefect's client (httpx) and MLflow's (requests) each report these their own way."""

from __future__ import annotations

import ssl

from mllm.failures import exception_chain
from mllm.settings import environment

_USERS = "`mllm-pipeline stack user list` on the stack's machine shows its users"


def _who(variable: str, prefect: bool) -> str:
    value = environment().get(variable, "")
    name = value.split(":", 1)[0] if prefect else value
    return f"user {name!r}" if name else f"no user ({variable} is not set)"


def _tls(e: BaseException) -> str | None:
    if isinstance(e, ssl.SSLCertVerificationError):
        return e.verify_message or str(e)
    text = str(e)
    if "TLSV1_ALERT_INTERNAL_ERROR" in text or "TLSV1_UNRECOGNIZED_NAME" in text:
        # Caddy's answer to a client asking for a name none of its certificates holds.
        return "no certificate of the server names this address (TLS alert from the server)"
    text = str(e)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return text.split("certificate verify failed:", 1)[-1].split("(")[0].strip(" )'\"") or "verify failed"
    return None


def auth_line(exc: BaseException | None) -> str | None:
    tracking = environment().get("MLFLOW_TRACKING_URI", "").rstrip("/")
    chain = list(exception_chain(exc))
    for e in chain:
        why = _tls(e)
        if why is None:
            continue
        mlflow = tracking and (tracking.split("://", 1)[-1] in str(e) or type(e).__module__.startswith("requests"))
        return tls_line(mlflow, why)
    for e in chain:
        response = getattr(e, "response", None)
        code = getattr(response, "status_code", None)
        if type(e).__module__.split(".")[0] in ("httpx", "prefect") and code in (401, 403):
            return prefect_refused(code, _detail(response))
        text = str(e)
        if "API request to endpoint" in text and ("error code 401" in text or "error code 403" in text):
            return mlflow_refused(401 if "error code 401" in text else 403)
    return None


def tls_line(mlflow: bool, why: str) -> str:
    """One line for a certificate the client refused: expired, made for another address, or
    from a CA it was not given. Each has its own fix."""
    server, url, variable = (
        ("MLflow", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_SERVER_CERT_PATH")
        if mlflow
        else ("Prefect", "PREFECT_API_URL", "PREFECT_API_SSL_CERT_FILE")
    )
    where = f"the {server} server {environment().get(url, '').rstrip('/')}"
    low = why.lower()
    if "expired" in low or "not yet valid" in low:
        return (
            f"{where} has a certificate that is out of its validity period ({why}): on the stack's machine "
            "`mllm-pipeline stack up` makes the stack's own certificate again (a team's own: renew it and give "
            "it with --tls-cert/--tls-key); if it is new, check this machine's clock"
        )
    if "mismatch" in low or "names this address" in low:
        return (
            f"{where} has a certificate for other addresses ({why}): set {url} to an address the certificate "
            "names, as `mllm-pipeline stack worker-env` prints it, or start the stack with --listen at this "
            "address so its certificate names it"
        )
    return (
        f"{where} has a certificate this client does not trust ({why}): set {variable} to the stack's CA "
        "file (`mllm-pipeline stack worker-env` prints it; the stack's own is auth/tls/ca.pem in its home)"
    )


def version_line(api: str, server: str, client: str) -> str | None:
    """One line when this client's Prefect is not the server's: Prefect's client refuses only
    another major version and warns of an older server, yet its objects and API change between
    minor versions, so the project asks for the one version it pins on both sides."""
    if server == client:
        return None
    return (
        f"the Prefect server {api} runs Prefect {server} and this client Prefect {client}: install "
        f"prefect=={server} here (or run the server on {client}); every worker and client of a stack needs "
        "the version its server runs (the project pins one in constraints.txt)"
    )


def _detail(response) -> str | None:
    """The stack's gate's reason for a refusal (flows/stack/gate.py), where it gave one."""
    try:
        if response.headers.get("x-stack-gate") == "refused":
            return str(response.json()["detail"])
    except (ValueError, KeyError, AttributeError, TypeError):
        pass
    return None


def prefect_refused(code: int, detail: str | None = None) -> str:
    prefect = environment().get("PREFECT_API_URL", "").rstrip("/")
    who = _who("PREFECT_API_AUTH_STRING", True)
    if code == 401:
        return (
            f"the Prefect server {prefect} did not take the credential of {who} (401): set "
            "PREFECT_API_AUTH_STRING to NAME:SECRET as `mllm-pipeline stack worker-env --user NAME` "
            f"prints it (a removed or rotated user's old secret no longer works; {_USERS})"
        )
    if detail:  # the policy's reason names the route or the field (docs/team-stack.md, the policy table)
        return (
            f"the Prefect server {prefect} does not let {who} do this (403, {detail}): a viewer only reads, a "
            "worker runs the project's training; ask the stack's admin for the rest"
        )
    return (
        f"the Prefect server {prefect} does not let {who} do this (403: a viewer only reads): run it as "
        "a worker (`mllm-pipeline stack user add NAME --role worker` on the stack's machine)"
    )


def mlflow_refused(code: int) -> str:
    tracking = environment().get("MLFLOW_TRACKING_URI", "").rstrip("/")
    who = _who("MLFLOW_TRACKING_USERNAME", False)
    if code == 401:
        return (
            f"the MLflow server {tracking} did not take the credential of {who} (401): set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD as `mllm-pipeline stack worker-env "
            f"--user NAME` prints them (a removed or rotated user's old secret no longer works; {_USERS})"
        )
    return (
        f"the MLflow server {tracking} does not let {who} do this (403: a viewer only reads): run it as "
        "a worker (`mllm-pipeline stack user add NAME --role worker` on the stack's machine)"
    )
