"""Each refused HTTP request leaves one log line with its reason and the client's address, never the token.

What a client shows its user is often only "Failed to connect"; the server's log is where the
reason must be. RequireToken runs here in this process in front of a stand-in for the MCP app,
which refuses as the SDK's transports do (413, a 400 quoting the body).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from coderunner.edge.auth import AccessPolicy, RequireToken
from coderunner.edge.refusals import Quoter, RefusalLog, body_reason

pytestmark = pytest.mark.anyio

TOKEN = "srv-token-" + "9d1c7e3a5b" * 4
WRONG = "not-the-token-" + "0a8f6e4c2d" * 3
CLIENT = ("127.0.0.9", 41234)
CLIENT_SHOWN = "127.0.0.9:41234"


async def app_behind(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The MCP app's part: 413 over its body limit, a 400 that quotes what was sent, else 200."""
    if scope["path"] == "/too-big":
        status, body = 413, b"Request body too large"
    elif scope["path"] == "/garbled":
        message = f"Parse error: cannot read {TOKEN}"
        status, body = 400, json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": message}})
    else:
        status, body = 200, "{}"
    encoded = body if isinstance(body, bytes) else body.encode()
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": encoded})


async def request(path: str = "/mcp", headers: dict[str, str] | None = None, *, repeat: str | None = None) -> int:
    """One request through RequireToken; its status."""
    sent = {"host": "127.0.0.1:8765", **(headers or {})}
    raw = [(name.encode(), value.encode()) for name, value in sent.items()]
    if repeat is not None:
        raw.append((repeat.encode(), sent[repeat].encode()))
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": raw,
        "client": CLIENT,
        "server": ("127.0.0.1", 8765),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    policy = AccessPolicy.for_bind(TOKEN, "127.0.0.1", 8765, [], [])
    await RequireToken(app_behind, policy)(scope, receive, send)
    return statuses[0]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


CASES = [
    ("no token", {}, None, "/mcp", 401, "no Authorization header"),
    ("wrong token", bearer(WRONG), None, "/mcp", 401, "not one this server accepts"),
    ("not bearer", {"authorization": f"Basic {WRONG}"}, None, "/mcp", 401, "is not 'Bearer <token>'"),
    ("foreign host", {**bearer(TOKEN), "host": "evil.example"}, None, "/mcp", 421, "Host 'evil.example'"),
    ("foreign origin", {**bearer(TOKEN), "origin": "http://evil.example"}, None, "/mcp", 403, "Origin 'http://evil"),
    ("repeated token", bearer(TOKEN), "authorization", "/mcp", 400, "header authorization appears more than once"),
    ("body too large", bearer(TOKEN), None, "/too-big", 413, "'Request body too large'"),
    ("garbled body", bearer(TOKEN), None, "/garbled", 400, "'Parse error: cannot read <token>'"),
    # The server's token in the URL, a wrong one in the header: neither is written.
    ("token in the path", bearer(WRONG), None, f"/mcp/{TOKEN}/{WRONG}", 401, "'/mcp/<token>/<token>'"),
]


@pytest.mark.parametrize(
    ("headers", "repeat", "path", "status", "reason"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
async def test_each_refusal_is_one_line_with_its_reason_and_address_and_no_token(
    caplog: pytest.LogCaptureFixture,
    headers: dict[str, str],
    repeat: str | None,
    path: str,
    status: int,
    reason: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)
    assert await request(path, headers, repeat=repeat) == status
    lines = [record.getMessage() for record in caplog.records if record.name == "coderunner.edge.refusals"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("refused POST '") and f"from {CLIENT_SHOWN}: {status} " in lines[0]
    if reason is not None:
        assert reason in lines[0], lines[0]
    everything = caplog.text + "".join(record.getMessage() for record in caplog.records)
    assert TOKEN not in everything and WRONG not in everything
    assert TOKEN[:20] not in everything and WRONG[:20] not in everything  # not even a cut-off part


async def test_an_accepted_request_and_the_health_check_log_no_refusal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert await request("/mcp", bearer(TOKEN)) == 200
    assert await request("/health") == 200
    assert [record for record in caplog.records if record.name == "coderunner.edge.refusals"] == []


async def test_oauth_discovery_is_noted_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert await request("/.well-known/oauth-protected-resource") == 404
    (record,) = [record for record in caplog.records if record.name == "coderunner.edge.refusals"]
    assert record.levelno == logging.INFO and "has no OAuth" in record.getMessage()


def test_quoted_text_is_bounded_escaped_and_cut_before_it_is_shortened() -> None:
    scope = {"headers": [(b"authorization", f"Bearer {TOKEN}".encode())]}
    quote = Quoter(scope)
    assert quote("a\nb\x1b[31m'") == "'a\\nb\\x1b[31m\\''"
    # The token straddles the point where the quote is cut: none of it may remain.
    shown = quote("x" * 100 + TOKEN)
    assert TOKEN[:10] not in shown and shown.startswith("'" + "x" * 100 + "<token>")
    assert len(quote("y" * 10_000)) < 200


def test_a_refusals_body_gives_its_reason() -> None:
    quote = Quoter({"headers": []})
    assert body_reason(b'{"error": {"code": -32600, "message": "Bad Request: Missing session ID"}}', quote) == (
        "'Bad Request: Missing session ID'"
    )
    assert body_reason(b'{"error": "unauthorized", "error_description": "send a token"}', quote) == "'send a token'"
    assert body_reason(b'{"error": "unknown MCP session"}', quote) == "'unknown MCP session'"
    assert body_reason(b"Invalid Content-Type header", quote) == "'Invalid Content-Type header'"
    assert body_reason(b"", quote) == "(no reason given)"


def test_a_flood_of_refusals_is_bounded_and_the_rest_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Anyone who reaches the port can be refused as often as they like: the log is not theirs to fill."""
    caplog.set_level(logging.DEBUG)
    now = [0.0]
    refusals = RefusalLog(burst=3, window_s=10.0, clock=lambda: now[0])
    scope = {"method": "POST", "path": "/mcp", "client": CLIENT, "headers": []}
    for _ in range(10):
        refusals.refused(scope, 401, "no Authorization header")
    lines = [record.getMessage() for record in caplog.records if record.name == "coderunner.edge.refusals"]
    assert len(lines) == 3 and "more refusals" not in lines[-1]
    now[0] = 10.0  # the next window
    refusals.refused(scope, 401, "no Authorization header")
    lines = [record.getMessage() for record in caplog.records if record.name == "coderunner.edge.refusals"]
    assert len(lines) == 4 and lines[-1].endswith("(7 more refusals before this one were not logged)"), lines[-1]
