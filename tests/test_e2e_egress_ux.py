"""Network 'allowlist' as the user and the agent see it, through the official MCP client over stdio.

- a host inside the user's ceiling but outside the session's list is put to the user by MCP
  elicitation during the call (accept: the request goes through, and the session keeps the host;
  decline: denied, and the reply says the user declined);
- without elicitation it is denied, and the reply says how to allow it;
- a host beyond the ceiling is never asked about, and the reply names allowed_domains;
- session_status shows the session's hosts, its recent decisions and the totals; get_capabilities
  says what is enforced here.

The upstream is a plain HTTP server in a network namespace this module makes, on TEST-NET-2
(198.51.100.244/30: host side .245, server .246; the wiring's and the bench's servers use other
addresses), removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters, types
from mcp.types import CallToolResult, TextContent

from tests.conftest import REPO, SERVER_CMD, ServerDirs, server_env

pytestmark = pytest.mark.anyio

NAMESPACE = f"crux{os.getpid() % 100000}"
HOST_IF, NS_IF = f"cruh{os.getpid() % 100000}", f"crun{os.getpid() % 100000}"
HOST_SIDE, SERVER = "198.51.100.245", "198.51.100.246"
PAGE = "hello from the test namespace"
#: The user's ceiling: the test server by IP literal, a name the session asks for instead, and a name
#: the user will decline (never resolved: a declined host is not looked up).
CEILING = [SERVER, "a.example.org", "b.example.org"]

FETCH = """
import urllib.request, urllib.error
try:
    print(urllib.request.urlopen({url!r}, timeout=30).read().decode())
except urllib.error.HTTPError as error:
    print("HTTP", error.code, error.read().decode())
"""


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """An HTTP server at SERVER:80 in a namespace of its own; its URL."""
    if os.geteuid() != 0:
        pytest.fail("these tests make a network namespace: run them as root")
    root = Path(tempfile.mkdtemp(prefix="crux-"))
    (root / "index.html").write_text(PAGE)

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    process = None
    try:
        ip("netns", "add", NAMESPACE)
        ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        ip("link", "set", NS_IF, "netns", NAMESPACE)
        ip("addr", "add", f"{HOST_SIDE}/30", "dev", HOST_IF)
        ip("link", "set", HOST_IF, "up")
        ip("-n", NAMESPACE, "addr", "add", f"{SERVER}/30", "dev", NS_IF)
        ip("-n", NAMESPACE, "link", "set", NS_IF, "up")
        ip("-n", NAMESPACE, "link", "set", "lo", "up")
        argv = ["ip", "netns", "exec", NAMESPACE, sys.executable, "-m", "http.server", "80", "--bind", SERVER]
        process = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                curl = ["curl", "-sf", "--noproxy", "*", "-m", "2", f"http://{SERVER}/"]
                if subprocess.run(curl, capture_output=True, timeout=5, check=True).stdout.decode() == PAGE:
                    break
            if process.poll() is not None:
                pytest.fail("the namespace's HTTP server did not start")
        else:
            pytest.fail("the namespace's HTTP server does not answer")
        yield f"http://{SERVER}/"
    finally:
        if process is not None:
            process.kill()
            process.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, timeout=10)
        shutil.rmtree(root, ignore_errors=True)


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
async def allowlist_server(dirs: ServerDirs, **client_options: Any) -> AsyncIterator[Client]:
    env = server_env(
        dirs,
        CODERUNNER_ALLOWED_DOMAINS=json.dumps(CEILING),
        CODERUNNER_EGRESS_AUDIT_LOG=str(dirs.root / "egress.jsonl"),
    )
    params = StdioServerParameters(command=SERVER_CMD[0], args=SERVER_CMD[1:], env=env, cwd=str(REPO))
    async with Client(params, read_timeout_seconds=120, **client_options) as client:
        yield client


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text(result)
    return result


async def new_session(client: Client) -> str:
    created = await call(client, "create_session", {"network": "allowlist", "allow": ["a.example.org"]})
    return json.loads(text(created))["session_id"]


async def test_the_user_is_asked_and_the_answer_holds(upstream: str, dirs: ServerDirs) -> None:
    asked = Asked()
    # The 2025-11-25 handshake: a server may send requests to the client during a call.
    async with allowlist_server(dirs, mode="legacy", elicitation_callback=asked) as client:
        session = await new_session(client)
        fetch = {"code": FETCH.format(url=upstream), "session_id": session}

        asked.answer = "accept"
        allowed = text(await call(client, "run_python", fetch))
        assert len(asked.messages) == 1 and f"{SERVER}:80" in asked.messages[0], asked.messages
        assert asked.schemas[0]["properties"]["decision"]["enum"] == ["allow", "deny"]
        assert PAGE in allowed and "[network:" not in allowed, allowed
        # The session keeps the host: no question the next time.
        assert PAGE in text(await call(client, "run_python", fetch)) and len(asked.messages) == 1

        asked.answer = "decline"
        other = {**fetch, "code": FETCH.format(url="http://b.example.org/")}
        declined = text(await call(client, "run_python", other))
        assert len(asked.messages) == 2 and "b.example.org:80" in asked.messages[1], asked.messages
        assert "HTTP 403" in declined and "blocked by CodeRunner's network policy" in declined, declined
        assert "[network: denied b.example.org:80 (the user declined)]" in declined, declined

        beyond = text(await call(client, "run_python", {**fetch, "code": FETCH.format(url=f"http://{HOST_SIDE}/")}))
        assert len(asked.messages) == 2, "a host beyond the user's ceiling must never be put to the user"
        assert f"[network: denied {HOST_SIDE}:80 (" in beyond and "allowed_domains" in beyond, beyond

        status = json.loads(text(await call(client, "session_status", {"session_id": session})))
        egress = status["egress"]
        assert status["network"] == "allowlist" and egress["ports"] == [80, 443]
        assert set(egress["allowed_hosts"]) == {"a.example.org", SERVER}, "allowed, not declined, hosts join"
        received = [row["received"] for row in egress["recent"] if row["allowed"] and row["host"] == SERVER]
        assert received and all(size > len(PAGE) for size in received), egress["recent"]
        assert [row["host"] for row in egress["recent"] if not row["allowed"]] == ["b.example.org", HOST_SIDE]
        assert egress["totals"]["allowed"] == 2 and egress["totals"]["denied"] == 2
        assert egress["totals"]["received"] >= sum(received)


async def test_without_elicitation_the_reply_says_how_to_allow(upstream: str, dirs: ServerDirs) -> None:
    async with allowlist_server(dirs) as client:  # the default client declares no elicitation
        session = await new_session(client)
        reply = text(await call(client, "run_python", {"code": FETCH.format(url=upstream), "session_id": session}))
        assert "HTTP 403" in reply, reply
        assert f"[network: denied {SERVER}:80 (not in this session's allowlist; allowed: a.example.org" in reply, reply
        assert f"to reach it: create_session(network='allowlist', allow=['{SERVER}'])]" in reply, reply

        quiet = text(await call(client, "run_python", {"code": "1 + 1", "session_id": session}))
        assert "[network:" not in quiet, "a call names only the hosts denied during it"

        capabilities = json.loads(text(await call(client, "get_capabilities", {})))
        network = capabilities["network"]
        assert network["modes"]["allowlist"] == "available"
        assert network["allowlist"]["enforcement"].startswith(f"enforced on {capabilities['sandbox']['backend']}:")
        assert SERVER in network["allowlist"]["allowed_domains"]
        assert {"python-packages", "github"} <= set(network["allowlist"]["presets"])
