"""Network 'allowlist' as the user and the agent see it, through the official MCP client (in memory).

- a host inside the user's ceiling but outside the session's list is put to the user by MCP
  elicitation during the call (accept: the request goes through, and the session keeps the host;
  decline: denied, and the reply says the user declined);
- without elicitation it is denied, and the reply says how to allow it;
- a host beyond the ceiling is never asked about, and the reply names allowed_domains;
- manage_sessions status shows the session's hosts, its recent decisions and the totals; get_capabilities
  says what is enforced here.

The upstream is tests/netns_servers.py's public server (TEST-NET-2, in a namespace of its own); the
host's own side of that pair stands for a host beyond the ceiling (never contacted: denied by name).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import Client, types
from mcp.types import CallToolResult, TextContent

from coderunner.egress.policy_proxy import MAX_ASKS
from tests.conftest import ServerDirs, memory_client, server_env
from tests.netns_servers import BODY, NetnsServers

pytestmark = pytest.mark.anyio

FETCH = """
import urllib.request, urllib.error
try:
    print(urllib.request.urlopen({url!r}, timeout=30).read().decode())
except urllib.error.HTTPError as error:
    print("HTTP", error.code, error.read().decode())
"""


def ceiling(servers: NetnsServers) -> list[str]:
    """The user's ceiling: the test server by IP literal, a name the session asks for instead, a name
    the user will decline (never resolved: a declined host is not looked up), and names code picks."""
    return [servers.public_ip, "a.example.org", "b.example.org", "*.c.example.org"]


def text(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


class Asked:
    """The client's elicitation callback: records each question, answers as told."""

    def __init__(self) -> None:
        self.answer = "decline"
        self.messages: list[str] = []
        self.schemas: list[dict[str, Any]] = []

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestFormParams)
        self.messages.append(params.message)
        self.schemas.append(params.requested_schema)
        if self.answer == "accept":
            return types.ElicitResult(action="accept", content={"decision": "allow"})
        return types.ElicitResult(action="decline")


@contextlib.asynccontextmanager
async def allowlist_server(dirs: ServerDirs, servers: NetnsServers, **client_options: Any) -> AsyncIterator[Client]:
    env = server_env(
        dirs,
        CODERUNNER_ALLOWED_DOMAINS=json.dumps(ceiling(servers)),
        CODERUNNER_EGRESS_AUDIT_LOG=str(dirs.root / "egress.jsonl"),
    )
    async with memory_client(env, **client_options) as client:
        yield client


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text(result)
    return result


async def new_session(client: Client) -> str:
    created = await call(client, "create_session", {"network": "allowlist", "allow": ["a.example.org"]})
    return json.loads(text(created))["session_id"]


async def test_the_user_is_asked_and_the_answer_holds(servers: NetnsServers, dirs: ServerDirs) -> None:
    asked = Asked()
    server, beyond_host = servers.public_ip, servers.host_ip
    # The 2025-11-25 handshake: a server may send requests to the client during a call.
    async with allowlist_server(dirs, servers, mode="legacy", elicitation_callback=asked) as client:
        session = await new_session(client)
        fetch = {"code": FETCH.format(url=f"http://{server}/"), "session_id": session}

        asked.answer = "accept"
        allowed = text(await call(client, "run_python", fetch))
        assert len(asked.messages) == 1 and f"{server}:80" in asked.messages[0], asked.messages
        assert asked.schemas[0]["properties"]["decision"]["enum"] == ["allow", "deny"]
        assert BODY in allowed and "[network:" not in allowed, allowed
        # The session keeps the host: no question the next time.
        assert BODY in text(await call(client, "run_python", fetch)) and len(asked.messages) == 1
        status = json.loads(text(await call(client, "manage_sessions", {"action": "status", "session_id": session})))
        egress = status["egress"]
        assert status["network"] == "allowlist" and egress["ports"] == [80, 443]
        assert set(egress["allowed_hosts"]) == {"a.example.org", server}
        assert [(row["host"], row["allowed"]) for row in egress["recent"]] == [(server, True)] * 2
        received = [row["received"] for row in egress["recent"]]
        assert all(size > len(BODY) for size in received) and egress["totals"]["received"] == sum(received)

        asked.answer = "decline"
        other = {**fetch, "code": FETCH.format(url="http://b.example.org/")}
        declined = text(await call(client, "run_python", other))
        assert len(asked.messages) == 2 and "b.example.org:80" in asked.messages[1], asked.messages
        assert "HTTP 403" in declined and "blocked by CodeRunner's network policy" in declined, declined
        assert "[network: denied b.example.org:80 (the user declined)]" in declined, declined

        # Code picks the names: however many it tries, a session puts only MAX_ASKS to the user.
        names = [f"http://n{n}.c.example.org/" for n in range(MAX_ASKS)]
        burst = text(await call(client, "run_python", {**fetch, "code": "".join(FETCH.format(url=u) for u in names)}))
        assert len(asked.messages) == MAX_ASKS, asked.messages
        assert burst.count("HTTP 403") == len(names) and "(the user declined)" in burst, burst
        last = f"n{MAX_ASKS - 1}.c.example.org"
        assert f"to reach it: create_session(network='allowlist', allow=['n{MAX_ASKS - 2}.c.example.org', " in burst
        assert f"'{last}'])" in burst, burst

        beyond = text(await call(client, "run_python", {**fetch, "code": FETCH.format(url=f"http://{beyond_host}/")}))
        assert len(asked.messages) == MAX_ASKS, "no more questions, and a host beyond the ceiling is never one"
        assert f"[network: denied {beyond_host}:80 (" in beyond and "allowed_domains" in beyond, beyond

        status = json.loads(text(await call(client, "manage_sessions", {"action": "status", "session_id": session})))
        egress = status["egress"]
        assert set(egress["allowed_hosts"]) == {"a.example.org", server}, "allowed, not declined, hosts join"
        assert (egress["recent"][-1]["host"], egress["recent"][-1]["allowed"]) == (beyond_host, False)
        assert len(egress["recent"]) == 10 and egress["recent"][-1]["reason"]
        assert egress["totals"]["allowed"] == 2 and egress["totals"]["denied"] == 2 + len(names)


async def test_without_elicitation_the_reply_says_how_to_allow(servers: NetnsServers, dirs: ServerDirs) -> None:
    server = servers.public_ip
    async with allowlist_server(dirs, servers) as client:  # the default client declares no elicitation
        session = await new_session(client)
        fetch = {"code": FETCH.format(url=f"http://{server}/"), "session_id": session}
        reply = text(await call(client, "run_python", fetch))
        assert "HTTP 403" in reply, reply
        assert f"[network: denied {server}:80 (not in this session's allowlist; allowed: a.example.org" in reply, reply
        assert f"to reach it: create_session(network='allowlist', allow=['{server}'])]" in reply, reply

        quiet = text(await call(client, "run_python", {"code": "1 + 1", "session_id": session}))
        assert "[network:" not in quiet, "a call names only the hosts denied during it"

        # A one-shot run gets the whole ceiling and its own proxy; its denials go in the reply's 'network'.
        code = FETCH.format(url=f"http://{servers.host_ip}/") + FETCH.format(url=f"http://{server}/")
        run = json.loads(text(await call(client, "execute_code", {"language": "python", "code": code,
                                                                  "network": "allowlist"})))  # fmt: skip
        assert BODY in run["stdout"] and "HTTP 403" in run["stdout"], run
        assert run["network"].startswith(f"network: denied {servers.host_ip}:80 (not in the user's allowed_domains")

        capabilities = json.loads(text(await call(client, "get_capabilities", {})))
        network = capabilities["network"]
        assert network["modes"]["allowlist"] == "available"
        assert network["allowlist"]["enforcement"].startswith(f"enforced on {capabilities['sandbox']['backend']}:")
        assert server in network["allowlist"]["allowed_domains"]
        assert {"python-packages", "github"} <= set(network["allowlist"]["presets"])
