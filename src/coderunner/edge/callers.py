"""Which client a tool call comes from, so that each client has its own default session.

Over stdio the server has exactly one client, `local`. Over HTTP the bearer token decides the
client (auth.py puts it in the request's scope): each token is a client of its own, and a
session is bound to the client that created it (sessions/manager.py refuses it to any other). Within one
token, callers are told apart for their default session, in this order:
- the `X-CodeRunner-Client: NAME` header (the proxy sends one; any client may), which wins over
  the MCP session so that clients opening one MCP session per call keep their state;
- the MCP session (the `Mcp-Session-Id` header, or legacy SSE's `session_id` query parameter);
- otherwise `http`: the token's stateless, unnamed requests share its one default session.
A caller key is `TOKEN_CLIENT/WHICH`, so two tokens never share a key, a default session or a
listing. Within one token the header is a convenience, not a boundary: whoever holds the token
may send any header.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

#: The caller over stdio, and of the CLI's one-shot run.
LOCAL_CALLER = "local"
#: The last part of the key of a token's requests that name no client.
SHARED_HTTP_CALLER = "http"
CLIENT_HEADER = "x-coderunner-client"
MAX_KEY_CHARS = 128
#: Caller keys that live exactly as long as one MCP connection (after the token's part).
CONNECTION_PREFIXES = ("mcp:", "sse:")
_WATCHED = "coderunner.caller-watched"


class UnknownClient(Exception):
    """An HTTP request that did not pass the token check: it must not act as anyone."""


def token_client(request: Any) -> str:
    """The client the request's bearer token names (`local` over stdio)."""
    if request is None:
        return LOCAL_CALLER
    from coderunner.edge.auth import scope_client  # here: a cluster node's sessions import this module, never auth

    client = scope_client(getattr(request, "scope", None))
    if client is None:
        raise UnknownClient("this request carries no checked bearer token; send 'Authorization: Bearer <token>'")
    return client


def caller_key(request: Any) -> str:
    """The caller key for the HTTP request behind a tool call (`local` over stdio)."""
    if request is None:
        return LOCAL_CALLER
    return f"{token_client(request)}/{_within_token(request)}"


def _within_token(request: Any) -> str:
    headers = getattr(request, "headers", None) or {}
    if client := headers.get(CLIENT_HEADER):
        return "client:" + client[:MAX_KEY_CHARS]
    if session := headers.get("mcp-session-id"):
        return "mcp:" + session[:MAX_KEY_CHARS]
    query = getattr(request, "query_params", None) or {}
    if session := query.get("session_id"):
        return "sse:" + session[:MAX_KEY_CHARS]
    return SHARED_HTTP_CALLER


def client_of_key(key: str) -> str:
    """The token's client of a caller key: whose sessions the caller may use."""
    return key.partition("/")[0] if "/" in key else key


def on_connection_close(session: Any, key: str, release: Callable[[str], Awaitable[None]]) -> None:
    """Call `release(key)` once the handshake-era MCP connection behind `session` closes.

    Only for callers that are one connection: their default session would otherwise hold a
    kernel until the idle timeout after the client has gone. mcp 2.3 has no public accessor
    for a request's Connection, hence the guarded private attribute; without it, idle reaping
    still applies.
    """
    if not key.partition("/")[2].startswith(CONNECTION_PREFIXES):
        return
    from mcp.types.version import HANDSHAKE_PROTOCOL_VERSIONS  # here: a cluster node never loads the MCP SDK

    # A 2026-era request is a connection of its own, even on an SSE stream: it closes at once.
    if getattr(session, "protocol_version", None) not in HANDSHAKE_PROTOCOL_VERSIONS:
        return
    connection = getattr(session, "_connection", None)
    state = getattr(connection, "state", None)
    if connection is None or not isinstance(state, dict) or state.get(_WATCHED):
        return
    state[_WATCHED] = True
    connection.exit_stack.push_async_callback(release, key)
