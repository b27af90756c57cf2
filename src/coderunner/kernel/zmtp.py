"""A small, strict ZMTP 3.0 peer (NULL mechanism) that never holds more than its byte budget.

libzmq bounds what it buffers in messages (the high-water mark) and in bytes per frame
(MAXMSGSIZE), never in bytes per message or per connection: a kernel that publishes many
multi-frame messages makes the host hold all of them. The host therefore speaks the wire
protocol itself, over a socket it connected, reading one frame header at a time. A frame's
size is known before its body is read, so a message over the budget is skipped as it streams
past (its bytes are read into a scratch buffer and dropped) and reported as `Skipped`. The
caller may also look at the first frames of a message and decide to skip the rest unread: a
message nobody waits for costs the host a 64 KiB scratch buffer, whatever its size.

There is no reconnect: a closed or misbehaving peer ends the connection for good.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

#: Greeting of a ZMTP 3.0 peer using the NULL mechanism, not as server (RFC 23).
_SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
_GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
#: Which peer socket types each of ours may talk to.
_PEERS = {"SUB": {b"PUB", b"XPUB"}, "DEALER": {b"ROUTER", b"DEALER"}}
#: Largest command (READY, or any command a peer sends later) the host reads.
_MAX_COMMAND_BYTES = 4096
_CHUNK = 1 << 16
#: Bytes read without waiting after which the reader lets other tasks run: a peer that always
#: has data ready must not hold the event loop.
_YIELD_EVERY = 1 << 16


class ZmtpError(Exception):
    """The peer broke the protocol or closed the connection; the connection is unusable."""


@dataclass(frozen=True)
class Limits:
    """What one message may occupy in the host; a message beyond any of these is skipped."""

    max_frame_bytes: int
    max_message_bytes: int
    max_frames: int = 64


@dataclass
class Skipped:
    """A message whose rest was skipped unread; `head` are its frames read before that.

    `over_limit` says why: it broke the limits (True), or the caller did not want it (False).
    """

    over_limit: bool
    head: list[bytes] = field(default_factory=list)
    skipped_bytes: int = 0


#: Told the frames of a message read so far (none yet, at first): True to read the whole
#: message, False to skip the rest of it, None to decide after the next frame.
Decide = Callable[[list[bytes]], "bool | None"]


class ZmtpConnection:
    """One connected stream socket speaking ZMTP 3.0 as a SUB or DEALER peer.

    Only one task may call `recv` at a time; `send` is serialised by a lock.
    """

    def __init__(self, sock: socket.socket, socket_type: str, limits: Limits, identity: bytes = b"") -> None:
        if socket_type not in _PEERS:
            raise ValueError(f"unsupported socket type {socket_type}")
        sock.setblocking(False)
        self._sock = sock
        self._type = socket_type
        self._identity = identity
        self.limits = limits
        self._buf = bytearray(_CHUNK)
        self._start = 0
        self._end = 0
        self._send_lock = anyio.Lock()
        self._unyielded = 0
        self.closed = False
        #: time.monotonic() of the last bytes read, skipped ones too: a reader still draining a
        #: backlog is not a quiet channel.
        self.last_read_at = time.monotonic()

    # --- lifecycle ---------------------------------------------------------------------------

    async def handshake(self) -> None:
        """Exchange greetings and READY commands; for SUB, subscribe to everything.

        The caller bounds the time (the peer may say nothing at all).
        """
        await self._send_raw(_GREETING)
        greeting = await self._read_exact(64)
        if greeting[:1] != b"\xff" or greeting[9:10] != b"\x7f" or greeting[10] < 3:
            raise ZmtpError("the peer does not speak ZMTP 3")
        if greeting[12:32].rstrip(b"\x00") != b"NULL":
            raise ZmtpError("the peer asks for a security mechanism other than NULL")
        properties = {b"Socket-Type": self._type.encode()}
        if self._type == "DEALER":
            properties[b"Identity"] = self._identity
        await self._send_raw(_frame(_COMMAND, _command(b"READY", properties)))
        name, peer = await self._read_command()
        if name == b"ERROR":
            raise ZmtpError("the peer refused the connection")
        if name != b"READY" or peer.get(b"Socket-Type") not in _PEERS[self._type]:
            raise ZmtpError("the peer's handshake does not fit this socket type")
        if self._type == "SUB":
            await self._send_raw(_frame(0, b"\x01"))  # ZMTP 3.0 subscription to every topic

    def close(self) -> None:
        """Close the socket; a task waiting in recv gets ZmtpError."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # no event loop (closed from a finaliser)
            anyio.notify_closing(self._sock)
        self._sock.close()

    # --- messages ----------------------------------------------------------------------------

    async def send(self, frames: list[bytes]) -> None:
        if not frames:
            raise ValueError("a message has at least one frame")
        wire = bytearray()
        for index, frame in enumerate(frames):
            wire += _frame(_MORE if index < len(frames) - 1 else 0, frame)
        async with self._send_lock:
            await self._send_raw(bytes(wire))

    async def recv(self, decide: Decide | None = None) -> list[bytes] | Skipped:
        """The next message, or `Skipped` for one that broke the limits or that `decide`
        refused (the bytes skipped are gone)."""
        frames: list[bytes] = []
        kept = 0
        skipped: Skipped | None = None
        wanted: bool | None = True if decide is None else None
        while True:
            flags, size = await self._read_header()
            if flags & _COMMAND:
                await self._skip(size)  # ZMTP 3.1 PING and the like: nothing the host needs
                if frames or kept:
                    raise ZmtpError("a command inside a multi-frame message")
                continue
            if wanted is None and not frames and skipped is None and decide is not None:
                # Asked only now that the message has begun to arrive, not while waiting for it.
                wanted = decide(frames)
                if wanted is False:
                    skipped = Skipped(over_limit=False)
            if skipped is None and (
                size > self.limits.max_frame_bytes
                or kept + size > self.limits.max_message_bytes
                or len(frames) >= self.limits.max_frames
            ):
                skipped = Skipped(over_limit=True, head=frames, skipped_bytes=kept)
            if skipped is not None:
                await self._skip(size)
                skipped.skipped_bytes += size
                kept += size
            else:
                frames.append(await self._read_exact(size))
                kept += size
                if wanted is None and decide is not None:
                    wanted = decide(frames)
                    if wanted is False:
                        skipped = Skipped(over_limit=False, head=frames, skipped_bytes=kept)
            if not flags & _MORE:
                return frames if skipped is None else skipped

    # --- wire --------------------------------------------------------------------------------

    async def _read_command(self) -> tuple[bytes, dict[bytes, bytes]]:
        flags, size = await self._read_header()
        if not flags & _COMMAND or flags & _MORE or size > _MAX_COMMAND_BYTES:
            raise ZmtpError("expected a command from the peer")
        body = await self._read_exact(size)
        if not body or len(body) < 1 + body[0]:
            raise ZmtpError("a malformed command")
        name, rest = body[1 : 1 + body[0]], body[1 + body[0] :]
        properties: dict[bytes, bytes] = {}
        if name == b"READY":
            while rest:
                key_len = rest[0]
                if len(rest) < 1 + key_len + 4:
                    raise ZmtpError("a malformed READY property")
                key = rest[1 : 1 + key_len]
                (value_len,) = struct.unpack_from(">I", rest, 1 + key_len)
                value_at = 1 + key_len + 4
                if len(rest) < value_at + value_len:
                    raise ZmtpError("a malformed READY property")
                properties[key] = rest[value_at : value_at + value_len]
                rest = rest[value_at + value_len :]
        return name, properties

    async def _read_header(self) -> tuple[int, int]:
        await self._fill(2)
        flags = self._buf[self._start]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise ZmtpError("a frame with unknown flags")
        if flags & _LONG:
            await self._fill(9)
            (size,) = struct.unpack_from(">Q", self._buf, self._start + 1)
            self._start += 9
        else:
            size = self._buf[self._start + 1]
            self._start += 2
        return flags, size

    async def _read_exact(self, size: int) -> bytes:
        """`size` bytes; callers have checked `size` against the limits already."""
        have = self._end - self._start
        if size <= have:
            data = bytes(self._buf[self._start : self._start + size])
            self._start += size
            return data
        out = bytearray(size)
        out[:have] = self._buf[self._start : self._end]
        self._start = self._end = 0
        view = memoryview(out)
        filled = have
        while filled < size:
            filled += await self._recv_into(view[filled:])
        return out  # type: ignore[return-value]  # a bytearray read as bytes: no second copy of a big frame

    async def _skip(self, size: int) -> None:
        have = self._end - self._start
        if size <= have:
            self._start += size
            return
        size -= have
        self._start = self._end = 0
        view = memoryview(self._buf)
        while size > 0:
            size -= await self._recv_into(view[: min(size, _CHUNK)])

    async def _fill(self, size: int) -> None:
        """At least `size` (small) bytes buffered at `_start`."""
        if self._end - self._start >= size:
            return
        if self._start:
            self._buf[: self._end - self._start] = self._buf[self._start : self._end]
            self._end -= self._start
            self._start = 0
        view = memoryview(self._buf)
        while self._end < size:
            self._end += await self._recv_into(view[self._end :])

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            if self.closed:
                raise ZmtpError("the connection was closed")
            if self._unyielded >= _YIELD_EVERY:
                self._unyielded = 0
                await anyio.lowlevel.checkpoint()
                continue
            try:
                count = self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                self._unyielded = 0
                try:
                    await anyio.wait_readable(self._sock)
                except (anyio.ClosedResourceError, OSError) as exc:
                    raise ZmtpError("the connection was closed") from exc
                continue
            except OSError as exc:
                raise ZmtpError(f"the connection failed: {exc}") from exc
            if count == 0:
                raise ZmtpError("the peer closed the connection")
            self.last_read_at = time.monotonic()
            self._unyielded += count + 1024  # and at least every 64 reads, however small
            return count

    async def _send_raw(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.closed:
                raise ZmtpError("the connection was closed")
            try:
                sent = self._sock.send(view)
            except (BlockingIOError, InterruptedError):
                try:
                    await anyio.wait_writable(self._sock)
                except (anyio.ClosedResourceError, OSError) as exc:
                    raise ZmtpError("the connection was closed") from exc
                continue
            except OSError as exc:
                raise ZmtpError(f"the connection failed: {exc}") from exc
            view = view[sent:]


def _frame(flags: int, body: bytes) -> bytes:
    if len(body) > 255:
        return struct.pack(">BQ", flags | _LONG, len(body)) + body
    return struct.pack(">BB", flags, len(body)) + body


def _command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for key, value in properties.items():
        body += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return body
