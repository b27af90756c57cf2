"""Who may talk to an HTTP-listening server: token, Host and Origin, and one client per default session."""

from __future__ import annotations

import stat
import subprocess
import sys

import anyio
import httpx2
import pytest
from mcp import Client, MCPError

from .conftest import (
    REPO,
    SERVER_CMD,
    TEST_TOKEN,
    ServerDirs,
    connect_http,
    http_server,
    json_of,
    run,
    server_env,
    text_of,
    wait_until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def post(url: str, **headers: str) -> httpx2.Response:
    return httpx2.post(url, json=INITIALIZE, headers={**MCP_HEADERS, **headers}, timeout=30)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_requests_without_the_right_token_are_refused(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        missing = post(url)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert "coderunner token" in missing.json()["error_description"]
        assert post(url, **bearer("wrong-" + TEST_TOKEN)).status_code == 401
        assert post(url, Authorization=f"Basic {TEST_TOKEN}").status_code == 401
        assert post(url, **bearer(TEST_TOKEN)).status_code == 200
        with pytest.raises(Exception):  # noqa: B017 - the SDK client fails its handshake, however it spells it
            async with connect_http(url, token="wrong") as client:
                await client.list_tools()
        # The server still serves the right token afterwards.
        async with connect_http(url) as client:
            assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"


async def test_legacy_sse_needs_the_token_too(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs), transport="sse") as url:
        with httpx2.stream("GET", url, timeout=30) as response:
            assert response.status_code == 401
        messages = url.replace("/sse", "/messages/?session_id=0123")
        assert post(messages).status_code == 401


async def test_health_answers_without_a_token_and_reveals_nothing(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        health = httpx2.get(url.replace("/mcp", "/health"), timeout=30)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert "coderunner" not in health.text.lower() and "version" not in health.text.lower()


async def test_foreign_host_and_origin_are_refused_even_with_the_token(dirs: ServerDirs) -> None:
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends its own Host and Origin."""
    with http_server(server_env(dirs)) as url:
        port = url.split(":")[2].split("/")[0]
        assert post(url, Host=f"evil.example:{port}", **bearer(TEST_TOKEN)).status_code == 421
        assert post(url, Origin="http://evil.example", **bearer(TEST_TOKEN)).status_code == 403
        assert httpx2.get(url.replace("/mcp", "/health"), headers={"Host": "evil.example"}).status_code == 421
        assert post(url, Origin=f"http://localhost:{port}", **bearer(TEST_TOKEN)).status_code == 200


async def test_a_token_is_generated_on_first_run_kept_private_and_printed_by_the_cli(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    del env["CODERUNNER_TOKEN"]
    token_file = dirs.root / "token"
    with http_server(env) as url:
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) & 0o077 == 0 or token_file.parent == dirs.root
        token = token_file.read_text().strip()
        assert len(token) >= 40
        printed = subprocess.run(
            [sys.executable, "-m", "coderunner.cli", "token"], env=env, capture_output=True, text=True, timeout=60
        )
        assert printed.stdout.strip() == token
        async with connect_http(url, token=token) as client:
            assert text_of(await run(client, "1 + 1")).splitlines()[0] == "2"
            # The sandbox sees none of the host's files, the token file least of all.
            probe = await run(client, f"open({str(token_file)!r}).read()")
            assert probe.is_error and "FileNotFoundError" in text_of(probe) and token not in text_of(probe)
    # A restart keeps the same token: configured clients keep working.
    with http_server(env) as url:
        assert token_file.read_text().strip() == token
        assert post(url, **bearer(token)).status_code == 200


def serve_refusal(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SERVER_CMD, "--transport", "streamable-http", "--port", "0", *flags],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_listening_beyond_loopback_needs_a_chosen_token_and_host_names(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    del env["CODERUNNER_TOKEN"]
    del env["CODERUNNER_TOKEN_FILE"]
    no_token = serve_refusal(env, "--host", "0.0.0.0")
    assert no_token.returncode == 1
    assert "needs a token you chose" in no_token.stderr and "Traceback" not in no_token.stderr
    no_hosts = serve_refusal({**env, "CODERUNNER_TOKEN": TEST_TOKEN}, "--host", "0.0.0.0")
    assert no_hosts.returncode == 1 and "allowed_hosts" in no_hosts.stderr
    assert list(dirs.root.glob("w/*")) == []  # refused before any sandbox existed
    assert not (dirs.root / "token").exists()


async def test_two_http_clients_each_get_their_own_default_session(dirs: ServerDirs) -> None:
    """Handshake-era clients are told apart by their MCP session; each has its own default kernel."""
    with http_server(server_env(dirs)) as url:
        async with connect_http(url, mode="legacy") as alice, connect_http(url, mode="legacy") as bob:

            async def use(client: Client, value: str) -> None:
                await run(client, f"owner_name = {value!r}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(use, alice, "alice")
                tg.start_soon(use, bob, "bob")
            assert "alice" in text_of(await run(alice, "owner_name"))
            assert "bob" in text_of(await run(bob, "owner_name"))
            # One client's long cell does not hold up another's.
            finished: list[str] = []

            async def timed_run(client: Client, name: str, code: str) -> None:
                await run(client, code)
                finished.append(name)

            async with anyio.create_task_group() as tg:
                tg.start_soon(timed_run, alice, "alice", "import time; time.sleep(4)")
                await anyio.sleep(0.5)
                tg.start_soon(timed_run, bob, "bob", "1 + 1")
            assert finished == ["bob", "alice"]

            listed_by_alice = json_of(await alice.call_tool("manage_sessions", {"action": "list"}))["sessions"]
            listed_by_bob = json_of(await bob.call_tool("manage_sessions", {"action": "list"}))["sessions"]
            assert len(listed_by_alice) == len(listed_by_bob) == 1
            assert listed_by_alice[0]["session_id"] != listed_by_bob[0]["session_id"]

            # A stateless client naming itself gets its own default too, and sees neither.
            async with connect_http(url, headers={"X-CodeRunner-Client": "carol"}) as carol:
                assert "NameError" in text_of(await run(carol, "owner_name"))
                assert len(json_of(await carol.call_tool("manage_sessions", {"action": "list"}))["sessions"]) == 1


async def test_session_ids_are_unguessable_handles(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        async with connect_http(url) as client:
            ids = set()
            for _ in range(3):
                created = await client.call_tool("create_session", {})
                ids.add(json_of(created)["session_id"])
            assert len(ids) == 3
            for session_id in ids:
                assert len(session_id) >= 22  # >= 128 random bits, URL-safe base64
                assert set(session_id) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
            guess = next(iter(ids))[:-1] + ("A" if not next(iter(ids)).endswith("A") else "B")
            wrong = await run(client, "1", session_id=guess)
            assert wrong.is_error and guess in text_of(wrong) and "unknown or expired" in text_of(wrong)


def test_the_token_file_folder_cannot_be_mounted_into_a_sandbox(dirs: ServerDirs) -> None:
    env = {**server_env(dirs), "CODERUNNER_TOKEN_FILE": str(dirs.root / "secrets" / "token")}
    (dirs.root / "secrets").mkdir(mode=0o700)
    done = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "run", "1"],
        env={**env, "CODERUNNER_MOUNTS": f'["{dirs.root / "secrets"}:/data:ro"]'},
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "coderunner" in done.stderr.lower() and str(dirs.root / "secrets") in done.stderr


async def test_an_unknown_tool_is_an_error_not_a_crash(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        async with connect_http(url) as client:
            try:
                unknown = await client.call_tool("no_such_tool", {})
                assert unknown.is_error and "no_such_tool" in text_of(unknown)
            except MCPError as exc:  # either spelling is fine; a dead connection is not
                assert "no_such_tool" in str(exc)
            assert text_of(await run(client, "2 + 2")).splitlines()[0] == "4"


def workspaces(dirs: ServerDirs) -> list[str]:
    """Open sessions' workspace folders (not the one made ahead for the next create)."""
    return [entry.name for entry in dirs.session_workspaces() if entry.is_dir()]


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
async def test_a_departed_clients_default_session_is_closed_and_its_handles_kept(
    dirs: ServerDirs, transport: str
) -> None:
    with http_server(server_env(dirs), transport=transport) as url:
        async with connect_http(url, mode="legacy") as leaving:
            await run(leaving, "scratch = 1")
            created = await leaving.call_tool("create_session", {})
            kept_id = json_of(created)["session_id"]
            await run(leaving, "kept = 'still here'", session_id=kept_id)
            assert len(workspaces(dirs)) == 2
        # The client closed its MCP session: its default kernel goes, the handle it made stays.
        assert await wait_until(lambda: len(workspaces(dirs)) == 1, timeout_s=20)
        async with connect_http(url) as other:
            assert "still here" in text_of(await run(other, "kept", session_id=kept_id))
