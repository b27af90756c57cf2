"""Which client a tool call comes from, so that each client has its own default session.

Over stdio the server has exactly one client. Over HTTP several clients may share one server:
a handshake-era client is known by its MCP session (the `Mcp-Session-Id` header, or the
`session_id` query parameter of legacy SSE); a stateless 2026-era request carries no connection,
so a client may name itself with the `X-CodeRunner-Client` header (the proxy does). Requests that
name no client share one HTTP default session. This is bookkeeping, not a security boundary:
every HTTP caller holds the server's token, and session ids are unguessable handles.
"""

from __future__ import annotations

from typing import Any

#: The caller over stdio, and of the CLI's one-shot run.
LOCAL_CALLER = "local"
#: HTTP requests that name no client.
SHARED_HTTP_CALLER = "http"
CLIENT_HEADER = "x-coderunner-client"
MAX_KEY_CHARS = 128


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
