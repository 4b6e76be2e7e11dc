"""The secured stack's gate, an ASGI app behind Caddy: the one place where a request meets the policy
(flows/stack/policy.py); docs/team-stack.md tells what it checks."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import sys
from pathlib import Path

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket

from flows.settings import settings
from flows.stack import checks, policy
from flows.stack.audit import LOCK_S, Audit, Throttle
from flows.stack.binding import NEEDS_BODY, pool_problem
from flows.stack.gate_ws import relay

_HOP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"upgrade",
    b"te",
    b"trailer",
    b"proxy-authorization",
    b"proxy-connection",
    b"host",
}
_BODY_LIMIT = 4 * 1024 * 1024  # a checked body (a flow run, a deployment) is a few kB
_READS = ("GET", "HEAD", "OPTIONS")


def refusal(status: int, detail: str) -> Response:
    headers = {"X-Stack-Gate": "refused"}
    if status == 401:
        headers["WWW-Authenticate"] = 'Basic realm="mllm stack"'
    if status == 429:
        headers["Retry-After"] = str(int(LOCK_S))
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _basic(header: str | None) -> tuple[str, str] | None:
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        name, _, secret = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (name, secret) if name and secret else None


class Gate:
    refusal = staticmethod(refusal)
    basic = staticmethod(_basic)

    def __init__(self, home: Path):
        ends = json.loads((home / "auth" / "endpoints.json").read_text())
        self.home, self.tracking = home, ends["tracking"]
        self.storage_endpoint = ends.get("storage_endpoint")  # the stack's own S3 endpoint, if any
        self.backends = ends["sockets"]  # each server's Unix socket
        self.audit, self.throttle = Audit(home), Throttle(settings().stack_login_tries)
        self._users: tuple[float, dict] = (-1.0, {})
        self._clients: dict[str, httpx.AsyncClient] = {}

    # -- who is asking -------------------------------------------------------------------------

    def users(self) -> dict:
        """The users file as it is now: a rotated or removed secret stops working at once."""
        path = self.home / "auth" / "users.json"
        mtime = path.stat().st_mtime
        if mtime != self._users[0]:
            self._users = (mtime, json.loads(path.read_text()).get("users", {}))
        return self._users[1]

    def authenticate(self, credential: tuple[str, str] | None, source: str, where: dict) -> tuple[str, str] | Response:
        """(user, role), or the refusal to answer: 401 for no or a wrong credential, 429 while the
        user or the address is locked out. Each refusal goes to the audit."""
        if credential is None:
            self.audit.write(
                event="login_failed", user=None, source=source, status=401, detail="no credential", **where
            )
            return refusal(401, "unauthorized: give a user's credential (mllm-pipeline stack worker-env)")
        name, secret = credential
        if self.throttle.locked(f"user:{name}", f"address:{source}"):
            self.audit.write(event="locked_out", user=name, source=source, status=429, **where)
            return refusal(429, f"too many failed logins: locked out for up to {int(LOCK_S)} s")
        user = self.users().get(name)
        # The users file holds each secret (the stack hands them out); a constant-time compare of
        # digests costs nothing, where bcrypt's cost would let wrong passwords eat the gate's CPU.
        given = hashlib.sha256(secret.encode()).digest()
        if user is not None and hmac.compare_digest(given, hashlib.sha256(user["secret"].encode()).digest()):
            return name, user["role"]
        self.audit.write(event="login_failed", user=name, source=source, status=401, **where)
        for key in self.throttle.fail(f"user:{name}", f"address:{source}"):
            self.audit.write(
                event="lockout",
                user=name,
                source=source,
                status=429,
                detail=f"{key} locked for {int(LOCK_S)} s after {self.throttle.tries} failures a minute",
            )
        return refusal(401, "unauthorized: wrong user or secret")

    # -- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.websocket(scope, receive, send)

    def _client_for(self, server: str) -> httpx.AsyncClient:
        if server not in self._clients:
            self._clients[server] = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self.backends[server]),
                timeout=httpx.Timeout(None),
                trust_env=False,
            )
        return self._clients[server]

    async def http(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        server, source = request.headers.get("x-stack-server"), request.headers.get("x-stack-client", "?")
        if server not in self.backends:
            await refusal(400, "requests come through the stack's proxy")(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        rule, templates = policy.decide(server, method, path)
        where = {"server": server, "method": method, "path": path, "route": templates[0] if templates else None}
        who = self.authenticate(_basic(request.headers.get("authorization")), source, where)
        body = None
        if isinstance(who, Response):
            answer = who
        else:
            user, role = who
            answer, body = await self._check(request, server, rule, where, user, role)
        if answer is not None:
            await self._drain(request)  # an HTTP/2 client still sending its body gets the answer, not a reset
            await answer(scope, receive, send)
            if not isinstance(who, Response):
                self.audit.write(
                    event="refused",
                    user=who[0],
                    role=who[1],
                    source=source,
                    status=answer.status_code,
                    detail=json.loads(answer.body)["detail"],
                    **where,
                )
            return
        status = await self._forward(scope, request, server, body, send)
        if method not in _READS and rule.level != "all" and where["route"] not in policy.POLLS:  # a write
            self.audit.write(event="write", user=user, role=role, source=source, status=status, **where)

    async def _check(
        self, request: Request, server: str, rule: policy.Rule, where: dict, user: str, role: str
    ) -> tuple[Response | None, bytes | None]:
        """The refusal of an authenticated request by its rule and checks (None: it passes), and
        its body when a check read it."""
        method, path = where["method"], where["path"]
        if role not in rule.roles:
            return refusal(403, f"forbidden: the role {role!r} may not {method} {where['route'] or path}"), None
        if role == "admin":
            return None, None
        pools = self.users().get(user, {}).get("pools")
        bound = bool(pools) and rule.level == "worker" and server == "prefect"
        body = None
        if rule.check or (bound and where["route"] in NEEDS_BODY):
            body = await self._body(request)
            if body is None:
                return refusal(403, "forbidden: the body is too large"), None
        problem = checks.body_problem(rule.check, body, self.tracking, self.storage_endpoint) if rule.check else None
        if not problem and rule.check == "results" and method == "PATCH":
            problem = await self._block_problem(server, path, body)
        if not problem and bound:
            problem = await pool_problem(pools, where["route"], path, body, self._lookup)
        return (refusal(403, f"forbidden: {problem}") if problem else None), body

    async def _lookup(self, path: str) -> dict | None:
        found = await self._client_for("prefect").get(f"http://localhost{path}")
        return found.json() if found.status_code == 200 else None

    async def _block_problem(self, server: str, path: str, body: bytes) -> str | None:
        """Why a non-admin may not change the block document at `path` (by the name it has now)."""
        found = await self._client_for(server).get(f"http://localhost{path}")
        name = found.json().get("name") if found.status_code == 200 else None
        return checks.results_problem(name, json.loads(body or b"{}"), self.storage_endpoint)

    async def _body(self, request: Request) -> bytes | None:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > _BODY_LIMIT:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _drain(self, request: Request) -> None:
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > _BODY_LIMIT:
                    return
        except Exception:  # noqa: BLE001 (a client gone, or a body already read: nothing to drain)
            return

    def _headers(self, scope, server: str) -> list[tuple[bytes, bytes]]:
        # Prefect needs no credential (and logs none); MLflow checks the same one again.
        drop = _HOP | ({b"authorization"} if server == "prefect" else set())
        return [(k, v) for k, v in scope["headers"] if k not in drop and not k.startswith(b"x-stack-")]

    async def _forward(self, scope, request: Request, server: str, body: bytes | None, send) -> int:
        url = f"http://localhost{scope['raw_path'].decode()}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        headers = [*self._headers(scope, server), (b"host", request.headers.get("host", "").encode())]
        client = self._client_for(server)
        upstream = client.build_request(
            scope["method"], url, headers=headers, content=body if body is not None else request.stream()
        )
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            await refusal(502, f"the stack's {server} server did not answer: {type(e).__name__}")(scope, None, send)
            return 502
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()
        return response.status_code

    # -- websockets ----------------------------------------------------------------------------

    async def websocket(self, scope, receive, send) -> None:
        ws = WebSocket(scope, receive, send)
        server, source = ws.headers.get("x-stack-server"), ws.headers.get("x-stack-client", "?")
        if server not in self.backends:
            await ws.close(1008)
            return
        rule, templates = policy.decide(server, "WS", scope["path"])
        where = {"server": server, "method": "WS", "path": scope["path"], "route": templates[0] if templates else None}
        credential = _basic(ws.headers.get("authorization"))
        who = None
        if credential is not None or not policy.has(rule, "token"):
            who = self.authenticate(credential, source, where)
            if isinstance(who, Response):
                await ws.send_denial_response(who)
                return
            if who[1] not in rule.roles:
                detail = f"forbidden: the role {who[1]!r} may not open {where['route'] or scope['path']}"
                self.audit.write(
                    event="refused", user=who[0], role=who[1], source=source, status=403, detail=detail, **where
                )
                await ws.send_denial_response(refusal(403, detail))
                return
        await relay(self, ws, server, rule, who, source, where)


def main() -> None:
    import uvicorn

    home, socket_path = Path(sys.argv[1]), Path(sys.argv[2])
    os.umask(0o077)  # the socket, the audit: the stack's user's alone
    socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(socket_path.parent, 0o700)
    socket_path.unlink(missing_ok=True)
    uvicorn.run(
        Gate(home),
        uds=str(socket_path),
        lifespan="off",
        log_level="warning",
        proxy_headers=False,
        server_header=False,
        ws="websockets-sansio",
        ws_max_size=64 * 1024 * 1024,
    )


if __name__ == "__main__":
    main()
