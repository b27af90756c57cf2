"""Abuse cases for per-client tokens: wrong, forged and revoked tokens, and one token's client
(mallory) going after another's (alice's) sessions and persistent workspace.

Every case aims at a canary the test made itself (a value in alice's bystander session, a file in
her persistent workspace), checks it is untouched, then checks the server still serves and the
bystander kept its state.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

import httpx2
import pytest
from mcp import Client, MCPError

from ..conftest import REPO, TEST_TOKEN, ServerDirs, connect_http, http_server, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

CANARY = "alice-token-canary-6b0e"
BYSTANDER_VALUE = "alice-bystander-4c19"
REFUSED = "unknown or expired session_id"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def token_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "token", *args],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def status(url: str, authorization: str | None) -> int:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "m", "version": "0"}},
    }
    return httpx2.post(url, json=body, headers=headers, timeout=30).status_code


def named_workspace_digest(dirs: ServerDirs, owner: str) -> str:
    """The host's copy of a closed persistent workspace: its disk image as root, else its files."""
    folder = dirs.workspaces / "named" / owner
    image = folder / "project.img"
    data = image.read_bytes() if image.exists() else (folder / "project" / "canary.txt").read_bytes()
    if not image.exists():
        assert data.decode() == CANARY
    return hashlib.sha256(data).hexdigest()


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def test_wrong_forged_and_revoked_tokens_get_401_and_the_server_still_serves(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    alice_token = token_cli(env, "add", "alice")
    revoked = token_cli(env, "add", "former")
    token_cli(env, "revoke", "former")
    stored = hashlib.sha256(alice_token.encode()).hexdigest()  # what the folder holds, as a token
    with http_server(env) as url:
        async with connect_http(url, token=alice_token) as alice:
            bystander = (await call(alice, "create_session"))["session_id"]
            await run(alice, f"guarded = {BYSTANDER_VALUE!r}", session_id=bystander)
            for authorization in [
                None,
                "Bearer",
                f"Bearer {stored}",
                f"Bearer sha256:{stored}",
                "Bearer alice",
                "Bearer default",
                f"Bearer {revoked}",
                f"Bearer {alice_token}x",
                f"Bearer {alice_token[:-1]}",
                f"Bearer {TEST_TOKEN}{alice_token}",
                "Bearer ../token",
                f"Bearer {'A' * 4000}",
                f"Basic {alice_token}",
                f"Token {alice_token}",
            ]:
                assert status(url, authorization) == 401, authorization
            with pytest.raises(Exception):  # noqa: B017 - the SDK reports a 401 however it spells it
                async with connect_http(url, token=revoked) as former:
                    await run(former, "1", session_id=bystander)
            # The server serves, alice's bystander kept its state, the server's own token still works.
            assert BYSTANDER_VALUE in text_of(await run(alice, "guarded", session_id=bystander))
            async with connect_http(url) as owner:
                assert text_of(await run(owner, "1 + 1")).splitlines()[0] == "2"


async def test_another_tokens_client_cannot_touch_sessions_or_workspaces(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    mallory_token = token_cli(env, "add", "mallory")
    same_name = {"X-CodeRunner-Client": "laptop"}
    with http_server(env) as url:
        async with (
            connect_http(url, headers=same_name) as alice,
            connect_http(url, token=mallory_token, headers=same_name) as mallory,
        ):
            bystander = (await call(alice, "create_session"))["session_id"]
            await run(alice, f"guarded = {BYSTANDER_VALUE!r}", session_id=bystander)
            project = (await call(alice, "create_session", name="project", persistent=True))["session_id"]
            await run(alice, f"open('canary.txt', 'w').write({CANARY!r})", session_id=project)
            await call(alice, "manage_sessions", action="close", session_id=project)
            before = named_workspace_digest(dirs, "laptop")

            # Her session ids, whatever tool carries them.
            for tool, arguments in [
                ("run_python", {"code": "guarded = 'mallory was here'"}),
                ("kernel_reset", {}),
                ("manage_sessions", {"action": "close"}),
                ("write_file", {"path": "planted.txt", "content": "x"}),
                ("read_file", {"path": "/workspace/planted.txt"}),
                ("manage_sessions", {"action": "status"}),
            ]:
                result = await mallory.call_tool(tool, {"session_id": bystander, **arguments})
                assert result.is_error and REFUSED in text_of(result), (tool, text_of(result))
            with pytest.raises(MCPError, match=REFUSED):
                await mallory.read_resource(f"sandbox://{bystander}/workspace/x")
            # No existence oracle: her live id and an id that never existed get the same answer.
            unknown = "s" * len(bystander)
            for tool, arguments in [
                ("run_python", {"code": "1"}),
                ("manage_sessions", {"action": "status"}),
                ("manage_sessions", {"action": "close"}),
            ]:
                live = text_of(await mallory.call_tool(tool, {"session_id": bystander, **arguments}))
                never = text_of(await mallory.call_tool(tool, {"session_id": unknown, **arguments}))
                assert live.replace(bystander, "ID") == never.replace(unknown, "ID"), (tool, live, never)

            # Her persistent workspace, by its name: mallory's own namespace has none.
            assert (await call(mallory, "manage_workspaces", action="list"))["workspaces"] == []
            gone = await mallory.call_tool("manage_workspaces", {"action": "delete", "name": "project"})
            assert gone.is_error and "no persistent workspace" in text_of(gone)
            own = (await call(mallory, "create_session", name="project", persistent=True))["session_id"]
            probe = await run(mallory, "open('canary.txt').read()", session_id=own)
            assert "FileNotFoundError" in text_of(probe) and CANARY not in text_of(probe)
            await run(mallory, "open('canary.txt', 'w').write('overwritten')", session_id=own)

            # Untouched canaries, a bystander with its state, a server that serves both.
            assert named_workspace_digest(dirs, "laptop") == before
            assert (dirs.workspaces / "named" / "t.mallory.laptop" / "project").is_dir()
            assert [s["session_id"] for s in (await call(mallory, "manage_sessions", action="list"))["sessions"]] == [
                own
            ]
            assert BYSTANDER_VALUE in text_of(await run(alice, "guarded", session_id=bystander))
            reopened = (await call(alice, "create_session", name="project", persistent=True))["session_id"]
            assert CANARY in text_of(await run(alice, "open('canary.txt').read()", session_id=reopened))
            assert text_of(await run(mallory, "6 * 7")).splitlines()[0] == "42"
