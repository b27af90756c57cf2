"""Per-client bearer tokens over HTTP: each token is its own client and nothing crosses between them.

Real servers, the official SDK client. The server's own token (TEST_TOKEN) is the client
`default`; others are made with `coderunner token add NAME`, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx2
import pytest
from mcp import Client, MCPError

from .conftest import (
    REPO,
    TEST_TOKEN,
    ServerDirs,
    connect_http,
    http_server,
    run,
    server_env,
    text_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

REFUSED = "unknown or expired session_id"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
}


def token_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "token", *args],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )


def add_token(env: dict[str, str], name: str) -> str:
    made = token_cli(env, "add", name)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert len(token) >= 40 and "\n" not in token
    return token


def initialize_status(url: str, token: str) -> int:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
    }
    return httpx2.post(url, json=INITIALIZE, headers=headers, timeout=30).status_code


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def refused(client: Client, tool: str, **arguments: Any) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, text_of(result)
    return text_of(result)


def listed(sessions: dict[str, Any]) -> set[str]:
    return {entry["session_id"] for entry in sessions["sessions"]}


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
async def test_two_tokens_never_see_each_others_variables_or_sessions(dirs: ServerDirs, transport: str) -> None:
    env = server_env(dirs)
    bob_token = add_token(env, "bob")
    with http_server(env, transport=transport) as url:
        async with connect_http(url) as alice, connect_http(url, token=bob_token) as bob:
            # Default sessions: streamable HTTP here is the stateless protocol, with no client header.
            await run(alice, "secret = 'alice-secret-31d7'\nopen('mine.txt', 'w').write('alice-file')")
            probe = await run(bob, "secret")
            assert probe.is_error and "NameError" in text_of(probe) and "alice-secret" not in text_of(probe)
            assert "FileNotFoundError" in text_of(await run(bob, "open('mine.txt').read()"))

            # Explicit ids: alice's session is refused to bob, whatever he calls with it.
            alice_session = (await call(alice, "create_session"))["session_id"]
            await run(alice, "kept = 'alice-kept'", session_id=alice_session)
            for tool, arguments in [
                ("run_python", {"code": "kept"}),
                ("manage_sessions", {"action": "status"}),
                ("read_file", {"path": "/workspace"}),
                ("kernel_reset", {}),
                ("manage_sessions", {"action": "close"}),
            ]:
                message = await refused(bob, tool, session_id=alice_session, **arguments)
                assert REFUSED in message and "alice-kept" not in message, (tool, message)
                assert "Traceback" not in message
            with pytest.raises(MCPError) as read:
                await bob.read_resource(f"sandbox://{alice_session}/workspace/mine.txt")
            assert REFUSED in str(read.value) and "alice-file" not in str(read.value)
            # ... and is untouched: alice still uses it, state kept.
            assert "alice-kept" in text_of(await run(alice, "kept", session_id=alice_session))

            # Listings are per client.
            bob_session = (await call(bob, "create_session"))["session_id"]
            alice_sees = listed(await call(alice, "manage_sessions", action="list"))
            bob_sees = listed(await call(bob, "manage_sessions", action="list"))
            assert alice_session in alice_sees and bob_session not in alice_sees
            assert bob_session in bob_sees and alice_session not in bob_sees
            assert REFUSED in await refused(alice, "run_python", code="1", session_id=bob_session)

            # A header cannot put bob under alice's token: naming himself as alice's callers would be
            # gives him a default session of his own.
            for name in ("http", "default", "default/http", "local"):
                async with connect_http(url, token=bob_token, headers={"X-CodeRunner-Client": name}) as spoof:
                    assert "NameError" in text_of(await run(spoof, "secret"))


async def test_anonymous_stateless_requests_of_two_tokens_never_share_a_kernel(dirs: ServerDirs) -> None:
    """The issue's case: pydantic-ai and openai-agents send no client identity at all."""
    env = server_env(dirs)
    first, second = add_token(env, "pydantic-ai"), add_token(env, "openai-agents")
    with http_server(env) as url:
        async with connect_http(url, token=first) as one:
            await run(one, "secret = 'one-secret-80aa'")
        # New connections, new stateless requests: each token keeps its own kernel, and only its own.
        async with connect_http(url, token=second) as two:
            leaked = await run(two, "secret")
            assert "NameError" in text_of(leaked) and "one-secret" not in text_of(leaked)
        async with connect_http(url, token=first) as one_again:
            assert "one-secret-80aa" in text_of(await run(one_again, "secret"))
        async with connect_http(url) as server_token:
            assert "NameError" in text_of(await run(server_token, "secret"))


async def test_the_client_header_narrows_within_a_token_and_keeps_state_across_mcp_sessions(
    dirs: ServerDirs,
) -> None:
    """langchain-mcp-adapters' quickstart opens one MCP session per call: the header keeps its kernel."""
    env = server_env(dirs)
    token = add_token(env, "langchain")
    agent = {"X-CodeRunner-Client": "agent-1"}
    with http_server(env) as url:
        async with connect_http(url, token=token, headers=agent, mode="legacy") as call_one:
            await run(call_one, "x = 41")
            made = (await call(call_one, "create_session"))["session_id"]
        # The MCP session is gone; a new one with the same header finds the same kernel.
        async with connect_http(url, token=token, headers=agent, mode="legacy") as call_two:
            assert text_of(await run(call_two, "x + 1")).splitlines()[0] == "42"
            assert made in listed(await call(call_two, "manage_sessions", action="list"))
        # Another name under the same token is another default session and another listing ...
        async with connect_http(url, token=token, headers={"X-CodeRunner-Client": "agent-2"}) as other:
            assert "NameError" in text_of(await run(other, "x"))
            assert made not in listed(await call(other, "manage_sessions", action="list"))
            # ... but the same client: a session id of its token is usable (the header is no boundary).
            await run(other, "y = 'shared within a token'", session_id=made)
        # Without the header, each MCP session is a caller of its own, as before.
        async with connect_http(url, token=token, mode="legacy") as unnamed:
            assert "NameError" in text_of(await run(unnamed, "x"))
        # The server's own token with the same header is another client altogether.
        async with connect_http(url, headers=agent) as same_name:
            assert "NameError" in text_of(await run(same_name, "x"))
            assert REFUSED in await refused(same_name, "run_python", code="y", session_id=made)


async def test_revoke_takes_effect_for_new_requests(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    token = add_token(env, "ci")
    listing = token_cli(env, "list")
    assert listing.returncode == 0 and listing.stdout.split()[0] == "default" and "ci" in listing.stdout.split()
    assert token not in listing.stdout and TEST_TOKEN not in listing.stdout
    with http_server(env) as url:
        async with connect_http(url, token=token) as ci:
            assert text_of(await run(ci, "2 * 21")).splitlines()[0] == "42"
            assert initialize_status(url, token) == 200
            revoked = token_cli(env, "revoke", "ci")
            assert revoked.returncode == 0, revoked.stderr
            # No restart: the very next request is refused, the open client's calls too.
            assert initialize_status(url, token) == 401
            with pytest.raises(Exception):  # noqa: B017 - the SDK reports a 401 however it spells it
                await run(ci, "1")
        assert "ci" not in token_cli(env, "list").stdout.split()
        # A new token for the same name works; the old one stays refused; other clients were never affected.
        renewed = add_token(env, "ci")
        assert initialize_status(url, token) == 401 and initialize_status(url, renewed) == 200
        async with connect_http(url) as server_token:
            assert text_of(await run(server_token, "1 + 1")).splitlines()[0] == "2"


async def test_exports_and_named_workspaces_follow_the_token(dirs: ServerDirs) -> None:
    out = dirs.root / "exports"
    env = server_env(dirs, CODERUNNER_EXPORT_DIR=str(out))
    token = add_token(env, "bob")
    same_name = {"X-CodeRunner-Client": "laptop"}
    with http_server(env) as url:
        async with (
            connect_http(url, headers=same_name) as alice,
            connect_http(url, token=token, headers=same_name) as bob,
        ):
            for client, owner in ((alice, "alice"), (bob, "bob")):
                made = await call(client, "create_session", name="project", persistent=True)
                await run(client, f"open('owner.txt', 'w').write({owner!r})", session_id=made["session_id"])
                await call(client, "manage_sessions", action="close", session_id=made["session_id"])
                await run(client, f"open('/mnt/outputs/from-{owner}.txt', 'w').write({owner!r})")
            # Same header, same workspace name: two workspaces, one per token.
            for client, owner in ((alice, "alice"), (bob, "bob")):
                reopened = await call(client, "create_session", name="project", persistent=True)
                found = await run(client, "open('owner.txt').read()", session_id=reopened["session_id"])
                assert text_of(found).splitlines()[0] == repr(owner)
                names = [
                    entry["name"] for entry in (await call(client, "manage_workspaces", action="list"))["workspaces"]
                ]
                assert names == ["project"]
    # The server's own token keeps the folder names of earlier versions; the added token has its own.
    assert sorted(path.name for path in out.iterdir()) == ["laptop", "t.bob.laptop"]
    assert [path.name for path in (out / "laptop").iterdir()] == ["from-alice.txt"]
    assert [path.name for path in (out / "t.bob.laptop").iterdir()] == ["from-bob.txt"]


def test_token_commands_refuse_bad_names_and_print_secrets_only_once(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    token = add_token(env, "laptop")
    again = token_cli(env, "add", "laptop")
    assert again.returncode == 1 and "already a client" in again.stderr and again.stdout == ""
    for bad in ("default", "Laptop", "../x"):
        refusal = token_cli(env, "add", bad)
        assert refusal.returncode == 1 and "Traceback" not in refusal.stderr and refusal.stdout == ""
    assert token not in token_cli(env, "list").stdout
    assert token not in "".join(path.read_text() for path in (dirs.root / "client-tokens").iterdir())
    gone = token_cli(env, "revoke", "nobody")
    assert gone.returncode == 1 and "token list" in gone.stderr


def mcp_headers(token: str, session: str | None = None) -> dict[str, str]:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
    }
    if session is not None:
        headers["Mcp-Session-Id"] = session
    return headers


LIST_TOOLS = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def test_an_mcp_session_id_works_only_with_the_token_that_opened_it(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    other = add_token(env, "other")
    with http_server(env) as url:
        opened = httpx2.post(url, json=INITIALIZE, headers=mcp_headers(TEST_TOKEN), timeout=30)
        session = opened.headers["mcp-session-id"]
        # Another token presenting it: as unknown, whatever the method.
        assert httpx2.post(url, json=LIST_TOOLS, headers=mcp_headers(other, session), timeout=30).status_code == 404
        assert httpx2.delete(url, headers=mcp_headers(other, session), timeout=30).status_code == 404
        with httpx2.stream("GET", url, headers=mcp_headers(other, session), timeout=30) as stream:
            assert stream.status_code == 404
        # Its own token still uses it: the session was not ended by the attempts.
        assert httpx2.post(url, json=INITIALIZED, headers=mcp_headers(TEST_TOKEN, session), timeout=30).is_success
        listed = httpx2.post(url, json=LIST_TOOLS, headers=mcp_headers(TEST_TOKEN, session), timeout=30)
        assert listed.status_code == 200 and "run_python" in listed.text


def test_a_legacy_sse_session_works_only_with_the_token_that_opened_it(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    other = add_token(env, "other")
    with http_server(env, transport="sse") as url:
        base = url.removesuffix("/sse")
        with httpx2.stream("GET", url, headers=mcp_headers(TEST_TOKEN), timeout=30) as stream:
            lines = stream.iter_lines()  # kept: a closed iterator would close the stream, and end the session
            endpoint = next(line for line in lines if line.startswith("data: /messages"))
            messages = base + endpoint.removeprefix("data: ")
            refused = httpx2.post(messages, json=INITIALIZE, headers=mcp_headers(other), timeout=30)
            assert refused.status_code == 404 and "another token" in refused.text
            served = httpx2.post(messages, json=INITIALIZE, headers=mcp_headers(TEST_TOKEN), timeout=30)
            assert served.status_code == 202, served.text
