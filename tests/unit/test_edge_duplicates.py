"""The HTTP edge (auth.RequireToken) against the real SDK apps, driven over raw ASGI.

- A request repeating an identity or routing field is refused with 400 before anything acts on it
  (http_limits.repeated_field), whatever its path and whether or not it carries a token.
- session_binding.py reads every session id a request carries, decoded as the SDK decodes it.
- Second line: with session_binding.py bypassed, the SDK's own per-user session check, fed the
  user RequireToken sets, still refuses one token another token's SSE or streamable HTTP session.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import MCP_PROTOCOL_VERSION_HEADER, MCP_SESSION_ID_HEADER
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import ASGIApp

from coderunner.edge import client_tokens
from coderunner.edge.auth import AccessPolicy, RequireToken, sdk_user
from coderunner.edge.callers import CLIENT_HEADER
from coderunner.edge.http_limits import SINGLE_HEADERS, SINGLE_PARAMS, repeated_field
from coderunner.edge.session_binding import BindMcpSessions

pytestmark = pytest.mark.anyio

SERVER_TOKEN = "server-token-for-the-edge-unit-test-0123456789"
HOST = (b"host", b"127.0.0.1:8000")
#: Bounds every wait on the in-process app.
STEP_S = 20
SESSION_HEX = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def policy(tmp_path: Path) -> tuple[AccessPolicy, str]:
    """The server's own token (client `default`) and one added token, client `alice`."""
    folder = tmp_path / "client-tokens"
    alice = client_tokens.add(folder, "alice")
    policy = AccessPolicy.for_bind(SERVER_TOKEN, "127.0.0.1", 8000, [], [], client_tokens.ClientTokens(folder))
    return policy, alice


def scope_of(method: str, path: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query, "headers": headers,
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}  # fmt: skip


def bearer(token: str) -> tuple[bytes, bytes]:
    return (b"authorization", f"Bearer {token}".encode())


async def exchange(app: ASGIApp, scope: dict[str, Any], body: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
    """One request/response, bounded; the response's status, headers and whole body."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(STEP_S):
        await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start.get("headers", [])), content


class Reached:
    """An inner app that notes every request reaching it."""

    def __init__(self) -> None:
        self.reached = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.reached += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_the_edge_knows_every_field_the_code_reads() -> None:
    assert CLIENT_HEADER.encode() in SINGLE_HEADERS
    assert MCP_SESSION_ID_HEADER.lower().encode() in SINGLE_HEADERS
    assert MCP_PROTOCOL_VERSION_HEADER.lower().encode() in SINGLE_HEADERS
    assert {b"authorization", b"host", b"origin", b"last-event-id"} <= SINGLE_HEADERS
    assert "session_id" in SINGLE_PARAMS


@pytest.mark.parametrize(
    ("headers", "query", "field"),
    [
        ([(b"mcp-session-id", b"a"), (b"mcp-session-id", b"b")], b"", "header mcp-session-id"),
        ([(b"authorization", b"Bearer a"), (b"Authorization", b"Bearer b")], b"", "header authorization"),
        ([(b"x-coderunner-client", b"a"), (b"X-CodeRunner-Client", b"a")], b"", "header x-coderunner-client"),
        ([(b"origin", b"http://a"), (b"origin", b"http://b")], b"", "header origin"),
        ([], b"session_id=a&session_id=b", "query parameter session_id"),
        ([], b"session_id=a&session%5Fid=b", "query parameter session_id"),
        ([], b"session_id&session_id=b", "query parameter session_id"),
        ([(b"accept", b"a"), (b"accept", b"b")], b"x=1&x=2&session_id=a", None),  # not identity nor routing
        ([(b"mcp-session-id", b"a")], b"session_id=b", None),  # one of each: session_binding.py checks both
    ],
)
def test_repeated_fields_are_found(headers: list[tuple[bytes, bytes]], query: bytes, field: str | None) -> None:
    assert repeated_field(scope_of("POST", "/messages/", [HOST, *headers], query)) == field


async def test_a_repeated_field_gets_400_before_anything_acts(policy: tuple[AccessPolicy, str]) -> None:
    access, alice = policy
    inner = Reached()
    edge = RequireToken(inner, access)
    for path, headers, query in [
        ("/mcp", [bearer(SERVER_TOKEN), bearer(alice)], b""),
        ("/mcp", [bearer(SERVER_TOKEN), (b"mcp-session-id", b"a"), (b"mcp-session-id", b"b")], b""),
        ("/mcp", [bearer(SERVER_TOKEN), (b"x-coderunner-client", b"a"), (b"x-coderunner-client", b"b")], b""),
        ("/messages/", [bearer(SERVER_TOKEN)], f"session_id={SESSION_HEX}&session_id={SESSION_HEX}".encode()),
        ("/health", [(b"origin", b"http://127.0.0.1"), (b"origin", b"http://127.0.0.1")], b""),  # before health
        ("/mcp", [(b"mcp-session-id", b"a"), (b"mcp-session-id", b"b")], b""),  # before the token check
    ]:
        status, headers_out, body = await exchange(edge, scope_of("POST", path, [HOST, *headers], query))
        assert status == 400, (path, headers, query)
        assert headers_out[b"content-type"].startswith(b"text/plain") and b"more than once" in body
    assert inner.reached == 0
    assert (await exchange(edge, scope_of("POST", "/mcp", [HOST, bearer(alice)])))[0] == 200
    assert inner.reached == 1


async def test_binding_reads_every_session_id_as_the_sdk_decodes_it(policy: tuple[AccessPolicy, str]) -> None:
    access, alice = policy
    inner = Reached()
    edge = RequireToken(inner, access)
    binding = edge.app
    assert isinstance(binding, BindMcpSessions)
    mine, victims = "1" * 32, "2" * 32
    binding.owners.bind(mine, "alice")
    binding.owners.bind(victims, "default")
    for headers, query in [
        ([], f"session%5Fid={victims}".encode()),  # the SDK decodes the name: session_id
        ([(b"mcp-session-id", mine.encode())], f"session_id={victims}".encode()),
        ([(b"mcp-session-id", victims.encode())], f"session_id={mine}".encode()),
    ]:
        status = (await exchange(edge, scope_of("POST", "/messages/", [HOST, bearer(alice), *headers], query)))[0]
        assert status == 404, (headers, query)
    assert inner.reached == 0
    ok = scope_of("POST", "/messages/", [HOST, bearer(alice)], f"session%5Fid={mine}".encode())
    assert (await exchange(edge, ok))[0] == 200


def test_each_tokens_client_is_a_distinct_sdk_principal() -> None:
    from mcp.server.auth.middleware.bearer_auth import authorization_context

    contexts = [authorization_context(sdk_user(name)) for name in ("default", "alice", "bob")]
    assert len({json.dumps(context, sort_keys=True) for context in contexts}) == 3
    assert authorization_context(sdk_user("alice")) == authorization_context(sdk_user("alice"))


def bypassed(edge: RequireToken) -> RequireToken:
    """The edge with session_binding.py's check switched off: only the SDK's own check is left."""
    binding = edge.app
    assert isinstance(binding, BindMcpSessions)
    binding.owners.allows = lambda session_id, client: True  # type: ignore[method-assign]
    return edge


def mcp_server() -> MCPServer:
    return MCPServer("edge-unit-test")


NO_DNS_CHECK = TransportSecuritySettings(enable_dns_rebinding_protection=False)
JSON_POST = [(b"content-type", b"application/json"), (b"accept", b"application/json, text/event-stream")]


@asynccontextmanager
async def sse_stream(app: ASGIApp, token: str) -> AsyncIterator[str]:
    """A legacy SSE stream opened with `token`: yields its session id; closes it on exit."""
    sent, received = anyio.create_memory_object_stream[dict[str, Any]](100)
    gone = anyio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async with anyio.create_task_group() as tg, sent, received:
        tg.start_soon(app, scope_of("GET", "/sse", [HOST, bearer(token)]), receive, sent.send)
        with anyio.fail_after(STEP_S):
            async for message in received:
                body = message.get("body", b"")
                if b"session_id=" in body:
                    session = body.split(b"session_id=")[1][:32].decode()
                    break
        try:
            yield session
        finally:
            gone.set()
            tg.cancel_scope.cancel()


async def test_sdk_refuses_another_tokens_sse_session_without_our_check(policy: tuple[AccessPolicy, str]) -> None:
    access, alice = policy
    edge = bypassed(RequireToken(mcp_server().sse_app(transport_security=NO_DNS_CHECK), access))
    ping = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode()
    async with sse_stream(edge, SERVER_TOKEN) as victims:
        query = f"session_id={victims}".encode()
        crossed = await exchange(edge, scope_of("POST", "/messages/", [HOST, bearer(alice), *JSON_POST], query), ping)
        assert crossed[0] == 404 and b"Could not find session" in crossed[2]
        own = await exchange(
            edge, scope_of("POST", "/messages/", [HOST, bearer(SERVER_TOKEN), *JSON_POST], query), ping
        )
        assert own[0] == 202


async def test_sdk_refuses_another_tokens_streamable_session_without_our_check(
    policy: tuple[AccessPolicy, str],
) -> None:
    access, alice = policy
    server = mcp_server()
    edge = bypassed(RequireToken(server.streamable_http_app(transport_security=NO_DNS_CHECK), access))
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "v", "version": "0"}},
    }
    async with server.session_manager.run():
        opened = await exchange(
            edge, scope_of("POST", "/mcp", [HOST, bearer(SERVER_TOKEN), *JSON_POST]), json.dumps(initialize).encode()
        )
        assert opened[0] == 200, opened
        session = opened[1][b"mcp-session-id"]
        ping = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode()
        as_session = [HOST, *JSON_POST, (b"mcp-session-id", session), (b"mcp-protocol-version", b"2025-06-18")]
        crossed = await exchange(edge, scope_of("POST", "/mcp", [bearer(alice), *as_session]), ping)
        assert crossed[0] == 404 and b"Session not found" in crossed[2]
        own = await exchange(edge, scope_of("POST", "/mcp", [bearer(SERVER_TOKEN), *as_session]), ping)
        assert own[0] == 202
