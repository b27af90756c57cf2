"""Faults around the server: clients that vanish, servers that are told to stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from .conftest import (
    REPO,
    SERVER_CMD,
    TEST_TOKEN,
    ServerDirs,
    connect_http,
    http_server,
    raw_stdio_server,
    run,
    sandbox_processes_alive,
    server_env,
    text_of,
    wait_until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

VANISHING_CLIENT = """
import sys, anyio, httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
async def main():
    http = httpx2.AsyncClient(headers={"Authorization": "Bearer " + sys.argv[2]}, timeout=httpx2.Timeout(30, read=None))
    async with Client(streamable_http_client(sys.argv[1], http_client=http)) as client:
        print("calling", flush=True)
        await client.call_tool("run_python", {"code": "while True:\\n    pass", "timeout_s": 300})
anyio.run(main)
"""


async def test_http_client_vanishing_mid_run_interrupts_the_cell(dirs: ServerDirs, tmp_path: Path) -> None:
    script = tmp_path / "vanish.py"
    script.write_text(VANISHING_CLIENT)
    with http_server(server_env(dirs)) as url:
        client_process = subprocess.Popen([sys.executable, str(script), url, TEST_TOKEN], stdout=subprocess.PIPE)
        try:
            assert client_process.stdout is not None
            assert client_process.stdout.readline().strip() == b"calling"
            await anyio.sleep(2.0)
        finally:
            client_process.kill()
            client_process.wait(timeout=10)
        async with connect_http(url) as client:
            began = time.monotonic()
            # The default session is shared over HTTP: had the cell kept running, this would be "busy".
            result = await run(client, "1 + 1", timeout_s=15)
            assert not result.is_error, text_of(result)
            assert text_of(result).splitlines()[0] == "2"
            assert time.monotonic() - began < 10


async def test_sigterm_to_stdio_server_closes_every_sandbox_within_bound(dirs: ServerDirs) -> None:
    calls: list[tuple[str, dict[str, object]]] = [("create_session", {}), ("run_python", {"code": "1"})]
    with raw_stdio_server(server_env(dirs), calls) as server:
        assert len(sandbox_processes_alive(dirs)) >= 2
        began = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=20)
        assert time.monotonic() - began < 15, "sessions must be shut down within the bound"
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=5)
    assert [p for p in dirs.workspace_entries()] == [], "SIGTERM closes sessions and removes their workspaces"


def test_a_sigterm_during_the_close_after_stdin_ends_does_not_cut_it_short(dirs: ServerDirs) -> None:
    """A client that closes stdin escalates after ~2 s (SIGTERM, then SIGKILL): a SIGTERM that meets the
    close under way must let it finish, not end the process at once and leave the sessions behind."""
    env = server_env(dirs, CODERUNNER_LOG_LEVEL="INFO")
    server = subprocess.Popen(SERVER_CMD, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=str(REPO))  # fmt: skip
    try:
        assert server.stdin and server.stdout and server.stderr
        handshake = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}
        for message in [
            {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": handshake},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "create_session", "arguments": {}}},
        ]:
            server.stdin.write((json.dumps(message) + "\n").encode())
        server.stdin.flush()
        replies = 0
        while replies < 2:
            line = server.stdout.readline()
            assert line, "server closed stdout"
            replies += b'"id":' in line
        assert sandbox_processes_alive(dirs)
        server.stdin.close()
        # The moment the close begins (its first log line), the client's SIGTERM arrives.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line, "the server ended before it began closing its sessions"
            if b"shutting down: closing" in line:
                break
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, "a SIGTERM during the close ended the server (the default action)"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    assert not sandbox_processes_alive(dirs)
    assert list(dirs.workspace_entries()) == [], "the close ran to its end and removed the workspace"


STDIO_VANISHING_CLIENT = """
import json, sys, anyio
from mcp import Client, StdioServerParameters
async def main():
    params = StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"],
                                   env=json.loads(sys.argv[1]))
    async with Client(params) as client:
        await client.call_tool("run_python", {"code": "1"})
        print("calling", flush=True)
        await client.call_tool("run_python", {"code": "while True:\\n    pass", "timeout_s": 300})
anyio.run(main)
"""


async def test_stdio_client_killed_mid_run_leaves_no_sandbox(dirs: ServerDirs, tmp_path: Path) -> None:
    script = tmp_path / "vanish_stdio.py"
    script.write_text(STDIO_VANISHING_CLIENT)
    client_process = subprocess.Popen(
        [sys.executable, str(script), json.dumps(server_env(dirs))], stdout=subprocess.PIPE, cwd=str(Path.cwd())
    )
    try:
        assert client_process.stdout is not None
        assert client_process.stdout.readline().strip() == b"calling"
        await anyio.sleep(1.0)
        assert sandbox_processes_alive(dirs)
    finally:
        client_process.kill()
        client_process.wait(timeout=10)
    # The orphaned server sees stdin close, interrupts nothing it needs to keep, and takes its sandboxes down.
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=20)
    assert await wait_until(lambda: not [p for p in dirs.workspace_entries()], timeout_s=10)
