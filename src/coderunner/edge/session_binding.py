"""An MCP session id works only with the token that opened it.

The SDK routes a request to an MCP session by its id alone (`Mcp-Session-Id`, or legacy SSE's
`session_id` query parameter). Tool calls already act for the request's own token (callers.py),
but a request carrying another token's MCP session id could still end that session, cancel its
requests or take its standalone notification stream. So this ASGI layer, behind the token check,
notes which client opened each MCP session and answers 404 (as for an unknown session) to any
other client presenting its id. Bounded: at most MAX_BOUND entries, the least recently used
forgotten first (the SDK itself holds at most 10,000 streamable sessions); a forgotten id is
refused too, and its client starts a new session as after any 404. auth.RequireToken also makes
the token's client the request's SDK user, so the SDK's own per-user session check refuses the
same requests: a second line, should this one ever be bypassed.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BOUND = 20_000
#: Legacy SSE: the stream's first event names the POST endpoint with the new session's id.
SSE_STREAM_PATH = "/sse"
_SSE_ENDPOINT = re.compile(rb"session_id=([0-9a-f]{32})")
#: Body messages of a new SSE stream searched for its endpoint event.
_SSE_SCAN_MESSAGES = 4


class SessionOwners:
    """MCP session id -> the client (token) that opened it, least recently used first."""

    def __init__(self, limit: int = MAX_BOUND) -> None:
        self.limit = limit
        self._owners: OrderedDict[str, str] = OrderedDict()

    def bind(self, session_id: str, client: str) -> None:
        self._owners[session_id] = client
        self._owners.move_to_end(session_id)
        while len(self._owners) > self.limit:
            self._owners.popitem(last=False)

    def allows(self, session_id: str, client: str) -> bool:
        owner = self._owners.get(session_id)
        if owner is None:
            return False
        self._owners.move_to_end(session_id)
        return owner == client

    def forget(self, session_id: str) -> None:
        self._owners.pop(session_id, None)


class BindMcpSessions:
    """ASGI middleware: record who opens an MCP session; refuse its id to every other client."""

    def __init__(
        self, app: ASGIApp, client_of: Callable[[Scope], str | None], owners: SessionOwners | None = None
    ) -> None:
        self.app = app
        #: The client the token check found for a request (auth.scope_client).
        self.client_of = client_of
        self.owners = owners or SessionOwners()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.client_of(scope) if scope["type"] == "http" else None
        if client is None:
            await self.app(scope, receive, send)
            return
        presented = _presented_sessions(scope)
        if presented:
            # Every id the request carries, however the SDK might read it, must be this client's.
            if not all(self.owners.allows(session_id, client) for session_id in presented):
                await _not_found(send)
                return
            await self.app(scope, receive, send)
            return
        opened: list[str] = []
        scanned = 0

        async def watch(message: Message) -> None:
            nonlocal scanned
            if message["type"] == "http.response.start":
                for name, value in message.get("headers", []):
                    if name.lower() == b"mcp-session-id":
                        self.owners.bind(value.decode("latin-1"), client)
            elif message["type"] == "http.response.body" and _new_sse_stream(scope) and not opened:
                if scanned < _SSE_SCAN_MESSAGES and (found := _SSE_ENDPOINT.search(message.get("body", b""))):
                    opened.append(found.group(1).decode())
                    self.owners.bind(opened[0], client)
                scanned += 1
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            for session_id in opened:  # a legacy SSE session lives exactly as long as its stream
                self.owners.forget(session_id)


def _new_sse_stream(scope: Scope) -> bool:
    return scope["path"] == SSE_STREAM_PATH and scope.get("method") == "GET"


def _presented_sessions(scope: Scope) -> list[str]:
    """Every MCP session id in the request: each `Mcp-Session-Id` header and `session_id` parameter.

    The parameter is decoded as Starlette's QueryParams decodes it (the SDK's SSE transport reads
    it so: `session%5Fid=` is `session_id=`), on every path. auth.RequireToken has already refused
    a request repeating either; all are returned anyway, so that this check never reads a
    different copy than the SDK does.
    """
    found = [value.decode("latin-1") for name, value in scope.get("headers", []) if name.lower() == b"mcp-session-id"]
    query = scope.get("query_string", b"").decode("latin-1")
    found += [value for name, value in parse_qsl(query, keep_blank_values=True) if name == "session_id"]
    return found


async def _not_found(send: Send) -> None:
    body = json.dumps(
        {"error": "unknown MCP session: it ended, or another token opened it; start a new one (initialize)"}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
