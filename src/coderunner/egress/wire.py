"""The bytes of one proxied connection: its request head read under a bound, the relay both ways
with an idle bound, and the short plain-text answers the proxy gives instead of a relay.

Nothing here decides anything: the policy proxy (policy_proxy.py) decides, and uses these to talk.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass

KiB = 1024

#: What every refusal's first line starts with (it reaches pip's and requests' error messages).
BLOCKED = "blocked by CodeRunner's network policy"
#: The most read from either side at once (and the stream limit of every connection).
READ_CHUNK = 64 * KiB
_ANSWER_DRAIN_S = 2.0
_MAX_PHRASE = 400


class HeadTooLarge(Exception):
    """The client's request head is over the proxy's byte bound."""


@dataclass
class ByteCounts:
    """Bytes moved through one relay so far: up to the server, and back down."""

    sent: int = 0
    received: int = 0


async def read_head(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes | None, bytes]:
    """(head without its CRLFCRLF, bytes read past it); (None, b"") if the client closed first."""
    buf = bytearray()
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
        chunk = await reader.read(max_bytes + 4 - len(buf) + 1)
        if not chunk:
            return None, b""
        buf += chunk


async def relay(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    up_r: asyncio.StreamReader,
    up_w: asyncio.StreamWriter,
    counts: ByteCounts,
    idle_s: float,
) -> None:
    """Copy both ways until the server side finishes, or nothing moves either way for idle_s.

    The idle check is one wait with a timeout here, not a timer per read: wait_for around every
    read costs a task per chunk on Python < 3.12 and took a third of the throughput.
    """
    last = [time.monotonic()]

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upward: bool) -> None:
        while True:
            data = await src.read(READ_CHUNK)
            if not data:
                if dst.can_write_eof():
                    with contextlib.suppress(OSError, RuntimeError):
                        dst.write_eof()
                return
            last[0] = time.monotonic()
            dst.write(data)
            if upward:
                counts.sent += len(data)
            else:
                counts.received += len(data)
            await dst.drain()  # returns at once below the high-water mark; a stall shows as idleness

    up = asyncio.ensure_future(pump(client_r, up_w, True))
    down = asyncio.ensure_future(pump(up_r, client_w, False))
    try:
        pending: set[asyncio.Future[None]] = {up, down}
        while pending:
            wait_s = max(0.0, last[0] + idle_s - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if time.monotonic() - last[0] >= idle_s:
                    return  # idle both ways
                continue
            for task in done:
                if task.exception() is not None:
                    return  # an error on one side ends the whole connection
            if down in done:
                return  # the server finished; what the client still sends has nowhere to go
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)


async def answer(writer: asyncio.StreamWriter, code: int, phrase: str, body: str, *, status: str = "") -> None:
    """Send a short plain-text answer and let the connection close.

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
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + data)
    with contextlib.suppress(OSError, asyncio.TimeoutError, ConnectionError):
        await asyncio.wait_for(writer.drain(), _ANSWER_DRAIN_S)


def close_quietly(writer: asyncio.StreamWriter) -> None:
    """Close a stream, whatever state it is in."""
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()


def os_reason(exc: OSError) -> str:
    """An OSError in a few words for an answer or a decision (never a repr)."""
    if isinstance(exc, socket.gaierror):
        return exc.strerror or "lookup failed"
    return exc.strerror or type(exc).__name__
