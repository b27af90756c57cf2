"""The bytes of one proxied connection before its relay: the request head read under a bound, and
the short plain-text answers the proxy gives instead of a relay.

Every read and write here is on a raw socket with MSG_DONTWAIT, never relying on the socket's own
O_NONBLOCK: a client socket handed over by the sandbox (egress/handoff.py) shares its file flags with
the sandbox, which could make it blocking at any time, and one blocking call would stall the server's
event loop. Nothing here decides anything: the policy proxy (policy_proxy.py) decides, and uses these
to talk; the relay itself is relay.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

KiB = 1024

#: What every refusal's first line starts with (it reaches pip's and requests' error messages).
BLOCKED = "blocked by CodeRunner's network policy"
#: The most read from a client at once while its head is read.
READ_CHUNK = 64 * KiB
_ANSWER_DRAIN_S = 2.0
_MAX_PHRASE = 400


class HeadTooLarge(Exception):
    """The client's request head is over the proxy's byte bound."""


async def wait_readable(sock: socket.socket) -> None:
    """Until the loop sees `sock` readable (or closed, or in error)."""
    await _wait(sock, write=False)


async def _wait(sock: socket.socket, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def recv_some(sock: socket.socket, size: int) -> bytes:
    """Up to `size` bytes as soon as any are there; b"" at EOF. Never blocks the loop."""
    while True:
        try:
            return sock.recv(size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            await _wait(sock, write=False)


async def send_all(sock: socket.socket, data: bytes) -> None:
    """All of `data`, waiting for room as needed (bound it with a timeout). Never blocks the loop."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) :]
        except (BlockingIOError, InterruptedError):
            await _wait(sock, write=True)


async def read_head(sock: socket.socket, max_bytes: int, prefix: bytes = b"") -> tuple[bytes | None, bytes]:
    """(head without its CRLFCRLF, bytes read past it); (None, b"") if the client closed first.

    `prefix`: bytes of this client already read (the first byte a handoff check took)."""
    buf = bytearray(prefix)
    searched = 0
    while True:
        index = buf.find(b"\r\n\r\n", max(0, searched - 3))
        if index >= 0:
            if index > max_bytes:
                raise HeadTooLarge
            return bytes(buf[:index]), bytes(buf[index + 4 :])
        if len(buf) > max_bytes:
            raise HeadTooLarge
        searched = len(buf)
        chunk = await recv_some(sock, min(READ_CHUNK, max_bytes + 4 - len(buf) + 1))
        if not chunk:
            return None, b""
        buf += chunk


async def answer(sock: socket.socket, code: int, phrase: str, body: str, *, status: str = "") -> None:
    """Send a short plain-text answer (bounded in time); the caller closes the connection.

    Refusals (403, 5xx) also carry the body's first line in the reason phrase: clients that report a
    failed CONNECT print the status line but not the body (Python's http.client: "Tunnel connection
    failed: 403 Forbidden (blocked by ...)"), so that is where pip and requests users can see it.
    """
    data = (body + "\n").encode("utf-8", "replace")
    if code == 403 or code >= 500:
        first = "".join(ch for ch in body.split("\n", 1)[0] if " " <= ch <= "~")[:_MAX_PHRASE]
        phrase = f"{phrase} ({first})"
    lines = [
        f"HTTP/1.1 {code} {phrase}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(data)}",
        "Connection: close",
        "X-CodeRunner-Egress: " + ("denied" if code == 403 else "error"),
    ]
    if status:
        lines.append(f"Proxy-Status: coderunner; error={status}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(_ANSWER_DRAIN_S):
            await send_all(sock, head + data)


def end(sock: socket.socket) -> None:
    """End a connection for every holder of the socket, then close ours.

    shutdown first: a socket the sandbox handed over may still be open in the sandbox (its copy, or
    one a program kept), and a bare close would then send no FIN, leaving the client waiting.
    """
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def os_reason(exc: OSError) -> str:
    """An OSError in a few words for an answer or a decision (never a repr)."""
    if isinstance(exc, socket.gaierror):
        return exc.strerror or "lookup failed"
    return exc.strerror or type(exc).__name__
