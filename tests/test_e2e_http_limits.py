"""HTTP connection bounds against anyone who can reach the port: a request-head timeout and a cap.

Half-open connections (connected, never finishing a request head) cost the server a file
descriptor each, before any token check. A flood of them must neither fill the server's
descriptors nor keep /health or an authenticated client from being served.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import httpx2
import pytest

from .conftest import ServerDirs, connect_http, http_server, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Generous bound on waiting for the server to close a connection (the head timeout in these tests is 1 s).
CLOSE_WAIT_S = 20.0


def _address(url: str) -> tuple[str, int]:
    host_port = url.split("//")[1].split("/")[0]
    host, _, port = host_port.partition(":")
    return host, int(port)


@contextlib.contextmanager
def half_open(address: tuple[str, int], count: int, first_bytes: bytes = b"") -> Iterator[list[socket.socket]]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.create_connection(address, timeout=10)
            if first_bytes:
                sock.sendall(first_bytes)
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """True once the server has closed (or reset) this connection, within `wait_s`."""
    sock.settimeout(wait_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def health(url: str) -> int:
    return httpx2.get(url.replace("/mcp", "/health"), timeout=30).status_code


async def test_a_flood_over_the_cap_is_shed_and_the_server_keeps_serving(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_HTTP_MAX_CONNECTIONS="40", CODERUNNER_HTTP_HEAD_TIMEOUT_S="120")
    with http_server(env) as url, half_open(_address(url), 300) as flood:
        assert health(url) == 200
        async with connect_http(url) as client:
            assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"
        # The oldest half-open connections made room: at most the cap can still be open.
        still_open = [sock for sock in flood if not closed_by_server(sock, 0.05)]
        assert len(still_open) <= 40, len(still_open)
        assert health(url) == 200


async def test_a_connection_that_never_finishes_its_request_head_is_closed(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_HTTP_HEAD_TIMEOUT_S="1", CODERUNNER_HTTP_IDLE_TIMEOUT_S="120")
    with http_server(env) as url:
        address = _address(url)
        with half_open(address, 1) as (silent,), half_open(address, 1, b"GET /health HTTP/1.1\r\nHost: x") as (slow,):
            assert closed_by_server(silent, CLOSE_WAIT_S)
            assert closed_by_server(slow, CLOSE_WAIT_S)
        # A kept-alive connection that starts its next request but never finishes it is closed too.
        with socket.create_connection(address, timeout=10) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            deadline = time.monotonic() + CLOSE_WAIT_S
            answer = b""
            while b'{"status":"ok"}' not in answer and time.monotonic() < deadline:
                answer += kept.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            kept.sendall(b"G")
            assert closed_by_server(kept, CLOSE_WAIT_S)
        # And ordinary clients are unaffected.
        assert health(url) == 200
        async with connect_http(url) as client:
            assert text_of(await run(client, "1 + 1")).splitlines()[0] == "2"
