"""MCP session ids bound to the token that opened them (session_binding.py), against a fake app."""

from __future__ import annotations

from typing import Any

import pytest

from coderunner.edge.session_binding import BindMcpSessions, SessionOwners

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_owners_are_bounded_least_recently_used_first() -> None:
    owners = SessionOwners(limit=2)
    owners.bind("a", "alice")
    owners.bind("b", "bob")
    assert owners.allows("a", "alice")  # used: now the most recent
    owners.bind("c", "carol")
    assert owners.allows("a", "alice") and owners.allows("c", "carol")
    assert not owners.allows("b", "bob")  # forgotten, hence refused
    assert not owners.allows("a", "bob")


class FakeApp:
    """Answers like the SDK: a new session id on a request without one, else 200."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.reached.append(scope["coderunner.client"])
        headers = [] if _session(scope) else [(b"mcp-session-id", b"s-" + str(len(self.reached)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


def _session(scope: dict[str, Any]) -> bytes | None:
    return dict(scope["headers"]).get(b"mcp-session-id")


def scope_for(client: str, session: str | None = None, path: str = "/mcp", query: bytes = b"") -> dict[str, Any]:
    headers = [(b"mcp-session-id", session.encode())] if session else []
    return {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": query,
            "coderunner.client": client}  # fmt: skip


async def exchange(app: BindMcpSessions, scope: dict[str, Any]) -> tuple[int, dict[bytes, bytes]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0].get("headers", []))


async def test_only_the_opening_client_reaches_its_session() -> None:
    inner = FakeApp()
    app = BindMcpSessions(inner, lambda scope: scope.get("coderunner.client"))
    status, headers = await exchange(app, scope_for("alice"))
    session = headers[b"mcp-session-id"].decode()
    assert status == 200
    assert (await exchange(app, scope_for("alice", session)))[0] == 200
    assert (await exchange(app, scope_for("bob", session)))[0] == 404
    assert (await exchange(app, scope_for("bob", "never-opened")))[0] == 404
    assert (await exchange(app, scope_for("bob", path="/messages/", query=b"session_id=" + session.encode())))[0] == 404
    assert inner.reached == ["alice", "alice"]  # the refused requests never reached the app
