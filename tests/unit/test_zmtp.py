"""The ZMTP reader's bounds against a peer that lies on the wire (a fake peer: a pure unit test)."""

from __future__ import annotations

import socket
import struct

import anyio
import pytest
from jupyter_client.session import Session

from coderunner.kernel.channels import ChannelBroken, Mailbox
from coderunner.kernel.zmtp import Limits, Skipped, ZmtpConnection, ZmtpError

pytestmark = pytest.mark.anyio

LIMITS = Limits(max_frame_bytes=1 << 20, max_message_bytes=1 << 20, max_frames=8)
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


async def handshaken(socket_type: str, peer_type: bytes) -> tuple[ZmtpConnection, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.sendall(GREETING + ready(peer_type))
    connection = ZmtpConnection(ours, socket_type, LIMITS)
    with anyio.fail_after(10):
        await connection.handshake()
    return connection, theirs


async def test_a_frame_that_claims_exabytes_is_skipped_without_allocating_it() -> None:
    connection, peer = await handshaken("SUB", b"PUB")
    # A long frame claiming 2**62 bytes, 3 MiB of it actually sent, then the peer hangs up.
    peer.sendall(struct.pack(">BQ", 0x02, 1 << 62))
    async with anyio.create_task_group() as group:

        async def feed() -> None:
            for _ in range(48):
                await anyio.to_thread.run_sync(peer.sendall, b"x" * (64 << 10))
            peer.close()

        group.start_soon(feed)
        with anyio.fail_after(30), pytest.raises(ZmtpError):
            await connection.recv()
    assert len(connection._buf) == 64 << 10  # the scratch buffer never grew
    connection.close()


async def test_frames_beyond_the_limits_make_one_skipped_message_and_the_stream_goes_on() -> None:
    connection, peer = await handshaken("SUB", b"PUB")
    many = b"".join(bytes([0x01, 1]) + b"f" for _ in range(20)) + bytes([0x00, 1]) + b"l"
    peer.sendall(many + bytes([0x00, 2]) + b"ok")
    with anyio.fail_after(10):
        skipped = await connection.recv()
        assert isinstance(skipped, Skipped) and skipped.over_limit and len(skipped.head) == LIMITS.max_frames
        assert await connection.recv() == [b"ok"]
    connection.close()
    peer.close()


async def test_bytes_read_and_skipped_mark_the_connection_as_not_quiet() -> None:
    """A run whose execute_reply came waits for its idle status while its IOPub reader still reads
    anything, skipped bytes too (kernel/client.py IDLE_AFTER_REPLY_S): the stream and idle it waits
    for may be behind a backlog of messages over the limit (an IOPub flood under load lost them)."""
    connection, peer = await handshaken("SUB", b"PUB")
    quiet_since = connection.last_read_at
    await anyio.sleep(0.05)
    over = struct.pack(">BQ", 0x02, 2 << 20) + b"x" * (2 << 20)  # one frame over the 1 MiB limit
    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, peer.sendall, over + bytes([0x00, 2]) + b"ok")
        with anyio.fail_after(10):
            skipped = await connection.recv()
    assert isinstance(skipped, Skipped) and skipped.over_limit
    assert connection.last_read_at > quiet_since
    connection.close()
    peer.close()


async def test_a_peer_of_another_kind_or_mechanism_is_refused() -> None:
    with pytest.raises(ZmtpError):
        await handshaken("DEALER", b"PUB")
    ours, theirs = socket.socketpair()
    theirs.sendall(GREETING.replace(b"NULL", b"CURV"))
    with anyio.fail_after(10), pytest.raises(ZmtpError, match="mechanism"):
        await ZmtpConnection(ours, "SUB", LIMITS).handshake()
    theirs.close()


async def test_a_kernel_that_stops_reading_cannot_hold_a_send() -> None:
    connection, peer = await handshaken("DEALER", b"ROUTER")
    mailbox = Mailbox("shell", connection, Session(key=b"k"), queue_bytes=1 << 20)
    big = mailbox.make("execute_request", {"code": "x" * (16 << 20)})  # more than any socket buffer
    with anyio.fail_after(30), pytest.raises(ChannelBroken, match="did not take a request"):
        await mailbox.send(big, timeout=0.5)
    assert connection.closed
    peer.close()
