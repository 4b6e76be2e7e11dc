"""The gate's websockets (flows/stack/gate.py): a client's socket joined to the server's, with the
credential taken from inside the first message where Prefect's subscribers send it there, and a
non-admin worker's hello kept from making pools."""

from __future__ import annotations

import base64
import json

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import unix_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from flows.stack import checks, policy
from flows.stack.binding import pool_problem


async def relay(gate, ws: WebSocket, server: str, rule, who, source: str, where: dict) -> None:
    url = f"ws://localhost{ws.scope['raw_path'].decode()}"
    if ws.scope.get("query_string"):
        url += "?" + ws.scope["query_string"].decode()
    subprotocols = ws.scope.get("subprotocols") or None
    try:
        upstream = await unix_connect(
            gate.backends[server],
            url,
            subprotocols=subprotocols,
            open_timeout=30,
            max_size=64 * 1024 * 1024,
            ping_interval=None,
        )
    except (OSError, InvalidStatus, TimeoutError) as e:
        await ws.send_denial_response(gate.refusal(502, f"the stack's {server} server did not take the websocket: {e}"))
        return
    async with upstream:
        await ws.accept(subprotocol=upstream.subprotocol)
        if who is None:  # the credential is the first message's token
            who = await _token_login(gate, ws, upstream, rule, source, where)
            if who is None:
                return
        pools = gate.users().get(who[0], {}).get("pools")
        if pools and who[1] == "worker" and (problem := await pool_problem(pools, None, where["path"], None, None)):
            gate.audit.write(
                event="refused", user=who[0], role=who[1], source=source, status=403, detail=problem, **where
            )
            await ws.close(1008, "forbidden")
            return
        gate.audit.write(event="websocket", user=who[0], role=who[1], source=source, status=101, **where)
        hello = policy.has(rule, "hello") and who[1] != "admin"
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_to_server, ws, upstream, hello, tasks.cancel_scope)
            tasks.start_soon(_to_client, ws, upstream, tasks.cancel_scope)


async def _token_login(gate, ws: WebSocket, upstream, rule, source: str, where: dict):
    try:
        first = await ws.receive_text()
        message = json.loads(first)
    except (WebSocketDisconnect, ValueError, KeyError):
        await ws.close(1008, "Expected 'auth' message")
        return None
    token = message.get("token") if isinstance(message, dict) and message.get("type") == "auth" else None
    credential = gate.basic("Basic " + base64.b64encode(token.encode()).decode()) if isinstance(token, str) else None
    who = gate.authenticate(credential, source, where)
    if not isinstance(who, tuple):
        await ws.close(1008, "Invalid token")
        return None
    if who[1] not in rule.roles:
        gate.audit.write(
            event="refused",
            user=who[0],
            role=who[1],
            source=source,
            status=403,
            detail="forbidden by the role",
            **where,
        )
        await ws.close(1008, "forbidden")
        return None
    # The server has no auth string of its own: it takes the handshake, and never sees the secret.
    await upstream.send(json.dumps({"type": "auth", "token": None}))
    return who


async def _to_server(ws: WebSocket, upstream, hello: bool, scope) -> None:
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            text, data = message.get("text"), message.get("bytes")
            if text is not None and hello:
                text = _no_new_pool(text)
            await upstream.send(text if text is not None else data)
    except (WebSocketDisconnect, ConnectionClosed):
        pass
    finally:
        await upstream.close()
        scope.cancel()


async def _to_client(ws: WebSocket, upstream, scope) -> None:
    try:
        async for message in upstream:
            if isinstance(message, str):
                await ws.send_text(message)
            else:
                await ws.send_bytes(message)
        code, reason = upstream.close_code or 1000, upstream.close_reason or ""
    except ConnectionClosed as e:
        code, reason = (e.rcvd.code, e.rcvd.reason) if e.rcvd else (1011, "")
    except WebSocketDisconnect:  # the client went: nothing to tell it
        scope.cancel()
        return
    try:
        await ws.close(code if code not in (1005, 1006) else 1011, reason)
    except (RuntimeError, WebSocketDisconnect):  # closed already, or the client went
        pass
    scope.cancel()


def _no_new_pool(text: str) -> str:
    """A non-admin's worker hello with create_pool_if_not_found turned off: `prefect worker start`
    asks for it by default; the pool must exist (an admin makes it), or the server refuses."""
    try:
        message = json.loads(text)
    except ValueError:
        return text
    if isinstance(message, dict) and checks.hello_problem(message):
        message["payload"]["create_pool_if_not_found"] = False
        message["payload"]["default_base_job_template"] = {}
        return json.dumps(message)
    return text
