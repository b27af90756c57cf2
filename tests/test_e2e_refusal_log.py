"""A refused client often says only "Failed to connect": the server's log (stderr) says why, never with the token.

One `coderunner serve --transport http` process at --log-level DEBUG (the most it ever writes) is sent
each kind of refused request, then a good one; its stderr has one refusal line each, with the reason
and the client's address, and neither the server's token nor a wrong one anywhere; stdout stays empty.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2
import pytest

from .conftest import (
    REPO,
    SERVER_CMD,
    SERVER_STOP_TIMEOUT_S,
    TEST_TOKEN,
    ServerDirs,
    _await_listening,
    _free_port,
    server_env,
)

pytestmark = pytest.mark.e2e

WRONG = "wrong-token-" + "5e7c9a1b3d" * 3
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
#: Over the SDK's request body limit (4 MiB).
TOO_BIG = 4 * 1024 * 1024 + 1


@dataclass
class Logged:
    url: str
    stdout: str = ""
    stderr: str = ""


@contextlib.contextmanager
def served(env: dict[str, str]) -> Iterator[Logged]:
    """`serve --transport http` with its stdout and stderr kept apart; both read once it stopped."""
    port = _free_port()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            [*SERVER_CMD, "--transport", "http", "--port", str(port), "--log-level", "DEBUG"],
            env=env,
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )
        logged = Logged(f"http://127.0.0.1:{port}/mcp")
        try:
            _await_listening(process, port, err)
            yield logged
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
            out.seek(0)
            err.seek(0)
            logged.stdout, logged.stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")


def post(url: str, headers: dict[str, str], content: bytes | None = None) -> int:
    sent = {**MCP_HEADERS, **headers}
    if content is None:
        return httpx2.post(url, json=INITIALIZE, headers=sent, timeout=30).status_code
    return httpx2.post(url, content=content, headers=sent, timeout=30).status_code


def test_each_refused_request_is_logged_with_its_reason_and_never_the_token(dirs: ServerDirs) -> None:
    right = {"Authorization": f"Bearer {TEST_TOKEN}"}
    with served(server_env(dirs)) as server:
        url = server.url
        port = url.split(":")[2].split("/")[0]
        assert post(url, {}) == 401
        assert post(url, {"Authorization": f"Bearer {WRONG}"}) == 401
        assert post(url, {**right, "Host": f"evil.example:{port}"}) == 421
        assert post(url, {**right, "Origin": "http://evil.example"}) == 403
        assert post(url, {**right, "X-CodeRunner-Client": "a"}, None) == 200  # accepted: no refusal line
        repeated = httpx2.post(
            url, json=INITIALIZE, headers=[*MCP_HEADERS.items(), *right.items(), *right.items()], timeout=30
        )
        assert repeated.status_code == 400
        assert post(url, right, b"x" * TOO_BIG) == 413
        assert post(url, right, b"not json " + TEST_TOKEN.encode()) == 400
        assert post(f"{url}/{TEST_TOKEN}", {"Authorization": f"Bearer {WRONG}"}) == 401  # a token in the URL
    refusals = [line for line in server.stderr.splitlines() if "refused POST" in line]
    expected = [
        "401 no Authorization header",
        "401 the bearer token is not one this server accepts",
        "421 Host 'evil.example:",
        "403 Origin 'http://evil.example'",
        "400 header authorization appears more than once",
        "413 'Request body too large'",
        "400 'Parse error",
        "401 the bearer token is not one this server accepts",
    ]
    assert len(refusals) == len(expected), server.stderr[-4000:]
    for line, reason in zip(refusals, expected, strict=True):
        assert "WARNING" in line and "from 127.0.0.1:" in line and reason in line, (line, reason)
    assert TEST_TOKEN not in server.stderr and WRONG not in server.stderr
    assert TEST_TOKEN[:16] not in server.stderr and WRONG[:16] not in server.stderr
    assert server.stdout == ""  # logs go to stderr, the access log included
    assert "Traceback" not in server.stderr
