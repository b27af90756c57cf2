"""The relay of an allowed connection: bytes both ways between the client and the server until the
server finishes, either side fails, or nothing moves either way for idle_s.

A direction starts on the event loop (MSG_DONTWAIT reads and writes: a small request never waits
for a thread to wake) and, once it has moved ON_LOOP_BYTES, goes on in a worker thread (large
recv_into/send, the GIL released in each call), so a 50 MB download never runs on the server's loop.
Worker threads are bounded server-wide (RELAY_THREADS); a direction that finds none free stays on
the loop, slower but just as bounded. recv_into/send beat splice(2) through a pipe here (measured:
the same speed on loopback, and no pipe fds or urgent-data corner cases).

Stopping a relay never relies on a socket's flags (a socket the sandbox handed over shares them with
the sandbox, which may make it blocking at any time): the loop shuts both sockets down, which wakes
a worker blocked in any call on them, and workers also look at a stop flag at least every second.
A worker uses its own dup of each socket and closes it itself, so the caller may close its sockets
as soon as relay returns without a worker ever touching a reused fd number.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coderunner.egress.wire import KiB, recv_some, send_all

#: Worker threads for relays, server-wide (one per busy direction); past them relays stay on the loop.
RELAY_THREADS = 128
#: The most one direction holds at once: one buffer of this size per worker (or loop relay direction).
CHUNK = 256 * KiB
#: What a direction moves on the event loop before it goes to a worker thread.
ON_LOOP_BYTES = 512 * KiB
#: A worker blocked on a socket looks at its relay's stop flag at least this often.
_POLL_S = 1.0

_pool = ThreadPoolExecutor(max_workers=RELAY_THREADS, thread_name_prefix="egress-relay")


@dataclass
class ByteCounts:
    """Bytes moved through one relay so far: up to the server, and back down."""

    sent: int = 0
    received: int = 0


@dataclass
class _Shared:
    """What a relay's workers and its watcher on the loop share (plain attribute writes only)."""

    idle_s: float
    last: float = field(default_factory=time.monotonic)
    stopped: bool = False

    def over(self) -> bool:
        """Whether a worker should end: stopped, or idle past the bound on its own (its watcher on
        the loop stops it first; this keeps a worker from outliving a loop that is gone)."""
        return self.stopped or time.monotonic() - self.last >= self.idle_s


class _Slots:
    """Worker threads in use, server-wide: taken by a relay direction, given back when its worker ends."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._free < 1:
                return False
            self._free -= 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._free += 1

    @property
    def free(self) -> int:
        return self._free


slots = _Slots(RELAY_THREADS)


async def relay(client: socket.socket, upstream: socket.socket, counts: ByteCounts, idle_s: float) -> None:
    """Copy both ways until the server side finishes, either side fails, or idle_s of silence."""
    shared = _Shared(idle_s)

    def sent(n: int) -> None:
        counts.sent += n

    def received(n: int) -> None:
        counts.received += n

    up = asyncio.ensure_future(_pump(client, upstream, sent, shared))
    down = asyncio.ensure_future(_pump(upstream, client, received, shared))
    for direction in (up, down):
        direction.add_done_callback(_retrieved)
    try:
        pending: set[asyncio.Future[None]] = {up, down}
        while pending:
            wait_s = max(0.0, shared.last + idle_s - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if time.monotonic() - shared.last >= idle_s:
                    return  # idle both ways
                continue
            for finished in done:
                if finished.exception() is not None:
                    return  # an error on one side ends the whole connection
            if down in done:
                return  # the server finished; what the client still sends has nowhere to go
    finally:
        shared.stopped = True
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked on it
        for task in (up, down):
            task.cancel()  # a worker goes on until it sees `stopped` or the shutdown; it closes its own copies


def _retrieved(task: asyncio.Future[None]) -> None:
    """A direction's error is read even when it ends after the relay did (never "never retrieved")."""
    if not task.cancelled():
        task.exception()


async def _pump(src: socket.socket, dst: socket.socket, moved: Callable[[int], None], shared: _Shared) -> None:
    """One direction: on the loop for its first ON_LOOP_BYTES (a small request never waits for a
    thread), then in a worker thread if one is free."""
    on_loop = 0
    while True:
        if on_loop >= ON_LOOP_BYTES and slots.take():
            try:
                src_copy, dst_copy = src.dup(), dst.dup()
            except OSError:
                slots.give_back()
                raise
            await asyncio.get_running_loop().run_in_executor(_pool, _worker, src_copy, dst_copy, moved, shared)
            return
        data = await recv_some(src, CHUNK)
        if not data:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            return
        shared.last = time.monotonic()
        moved(len(data))
        await send_all(dst, data)  # waits for room: a stall shows as idleness
        on_loop += len(data)
        shared.last = time.monotonic()


def _worker(src: socket.socket, dst: socket.socket, moved: Callable[[int], None], shared: _Shared) -> None:
    """One direction in a worker thread, on its own copies of the sockets (closed here, at the end):
    until EOF (passed on as a half-close), an error, or the relay's stop."""
    try:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while not shared.over():
            try:
                n = src.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                _wait(src, select.POLLIN)
                continue
            if not n:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            shared.last = time.monotonic()
            moved(n)  # counted as taken on (before the other side can have it, as a reader would expect)
            sent = 0
            while sent < n:
                if shared.over():
                    return
                try:
                    sent += dst.send(view[sent:n], socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    _wait(dst, select.POLLOUT)
            shared.last = time.monotonic()
    finally:
        src.close()
        dst.close()
        slots.give_back()


def _wait(sock: socket.socket, event: int) -> None:
    poller = select.poll()
    poller.register(sock.fileno(), event)
    poller.poll(_POLL_S * 1000)
