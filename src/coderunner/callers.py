"""Which client a tool call comes from, so that each client has its own default session.

Over stdio the server has exactly one client. Over HTTP several clients may share one server:
a handshake-era client is known by its MCP session (the `Mcp-Session-Id` header, or the
`session_id` query parameter of legacy SSE); a stateless 2026-era request carries no connection,
so a client may name itself with the `X-CodeRunner-Client` header (the proxy does). Requests that
name no client share one HTTP default session. This is bookkeeping, not a security boundary:
every HTTP caller holds the server's token, and session ids are unguessable handles.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from mcp.types.version import HANDSHAKE_PROTOCOL_VERSIONS

#: The caller over stdio, and of the CLI's one-shot run.
LOCAL_CALLER = "local"
#: HTTP requests that name no client.
SHARED_HTTP_CALLER = "http"
CLIENT_HEADER = "x-coderunner-client"
MAX_KEY_CHARS = 128
#: Caller keys that live exactly as long as one MCP connection.
CONNECTION_PREFIXES = ("mcp:", "sse:")
_WATCHED = "coderunner.caller-watched"


def caller_key(request: Any) -> str:
    """The caller key for the HTTP request behind a tool call (None over stdio)."""
    if request is None:
        return LOCAL_CALLER
    headers = getattr(request, "headers", None) or {}
    if session := headers.get("mcp-session-id"):
        return "mcp:" + session[:MAX_KEY_CHARS]
    query = getattr(request, "query_params", None) or {}
    if session := query.get("session_id"):
        return "sse:" + session[:MAX_KEY_CHARS]
    if client := headers.get(CLIENT_HEADER):
        return "client:" + client[:MAX_KEY_CHARS]
    return SHARED_HTTP_CALLER


def on_connection_close(session: Any, key: str, release: Callable[[str], Awaitable[None]]) -> None:
    """Call `release(key)` once the handshake-era MCP connection behind `session` closes.

    Only for callers that are one connection: their default session would otherwise hold a
    kernel until the idle timeout after the client has gone. mcp 2.3 has no public accessor
    for a request's Connection, hence the guarded private attribute; without it, idle reaping
    still applies.
    """
    if not key.startswith(CONNECTION_PREFIXES):
        return
    # A 2026-era request is a connection of its own, even on an SSE stream: it closes at once.
    if getattr(session, "protocol_version", None) not in HANDSHAKE_PROTOCOL_VERSIONS:
        return
    connection = getattr(session, "_connection", None)
    state = getattr(connection, "state", None)
    if connection is None or not isinstance(state, dict) or state.get(_WATCHED):
        return
    state[_WATCHED] = True
    connection.exit_stack.push_async_callback(release, key)
