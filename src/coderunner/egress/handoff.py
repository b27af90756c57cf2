"""A client socket handed to the host by the sandbox's forwarder, so no bytes are relayed inside it.

The forwarder (guest/egress_forwarder.py) accepts a connection on 127.0.0.1:EGRESS_PORT and sends
its socket over the proxy's unix socket with SCM_RIGHTS, attached to one HANDOFF byte. The host
checks the fd and answers TAKEN (the forwarder closes its copy) or NO_FD (no fd came with the byte:
the path between them cannot carry one, as under gVisor or to a VM, and the forwarder relays bytes
instead from then on). Anything else on the unix socket is an ordinary client of the proxy.

The fd comes from untrusted code, so: one fd per message, read with room for one (more truncate the
message and are discarded by the kernel, and the handoff is refused), received close-on-exec; the fd
must be a connected, non-listening TCP socket (AF_INET/AF_INET6, SOCK_STREAM) or it is closed and
refused. The host then only reads and writes bytes on it, never by its flags (wire.py, relay.py).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import socket
import stat
from dataclasses import dataclass

from coderunner.egress.wire import wait_readable

#: The first byte of a handoff (never the first byte of an HTTP request); the fd rides on it.
HANDOFF = b"\x00"
#: The host's answers to a handoff: it took the socket; or no fd came with the byte.
TAKEN = b"\x01"
NO_FD = b"\x02"
_ONE_FD = socket.CMSG_LEN(array.array("i").itemsize)  # room for exactly one fd: more truncate


class HandoffRefused(Exception):
    """A handoff the host does not take; the message says why (for a debug log, never the sandbox)."""


@dataclass
class Client:
    """Who the proxy serves on an accepted unix connection: a handed-over socket, or the connection."""

    sock: socket.socket
    #: Bytes of the client's request already read (the first byte, when it was not a handoff).
    prefix: bytes
    handed_over: bool


async def receive_client(conn: socket.socket) -> Client:
    """Read the first byte of an accepted unix connection, and any fd on it; HandoffRefused if bad.

    The caller bounds the wait. On a refusal `conn` is the caller's to close (after NO_FD, if sent).
    """
    while True:
        try:
            data, ancillary, flags, _ = conn.recvmsg(1, _ONE_FD, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            break
        except (BlockingIOError, InterruptedError):
            await wait_readable(conn)
    fds = _fds_of(ancillary)
    if data != HANDOFF:
        _close_all(fds)  # fds riding on request bytes are never used
        return Client(conn, data, handed_over=False)
    if not fds and not flags & socket.MSG_CTRUNC:
        _answer(conn, NO_FD)
        raise HandoffRefused("a handoff without an fd")
    if flags & socket.MSG_CTRUNC or len(fds) != 1:
        _close_all(fds)
        raise HandoffRefused("more than one fd in a handoff")
    sock = checked_socket(fds[0])
    _answer(conn, TAKEN)
    conn.close()
    return Client(sock, b"", handed_over=True)


def checked_socket(fd: int) -> socket.socket:
    """The fd as a socket if it is a connected, non-listening TCP socket, else closed and refused."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise HandoffRefused("not a socket")
        sock = socket.socket(fileno=fd)  # reads its family, type and protocol from the kernel
    except BaseException:
        os.close(fd)
        raise
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise HandoffRefused(f"not an internet socket ({sock.family!r})")
        if sock.type != socket.SOCK_STREAM or sock.proto not in (0, socket.IPPROTO_TCP):
            raise HandoffRefused("not a TCP stream socket")
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) != socket.IPPROTO_TCP:
            raise HandoffRefused("not TCP")
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise HandoffRefused("a listening socket")
        try:
            sock.getpeername()
        except OSError:
            raise HandoffRefused("not connected") from None
        # The file's flags are shared with the sandbox: no signal-driven I/O to its owner from our
        # reads; non-blocking as far as it lasts (every call here also says MSG_DONTWAIT).
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_NONBLOCK) & ~os.O_ASYNC)
        sock.setblocking(False)
        # As asyncio does for every TCP stream (and the byte relay did here): without it Nagle holds a
        # relayed answer's second small segment until the client's delayed ACK, tens of ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _answer(conn: socket.socket, byte: bytes) -> None:
    with contextlib.suppress(OSError):  # the forwarder went away: it will not relay this one anyway
        conn.send(byte, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
