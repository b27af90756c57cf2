"""Shell, control and IOPub of one kernel, each read continuously within a byte budget.

The kernel is hostile: it holds the session key and may publish anything at any time. Each
channel has a pump task that reads every message as it arrives (so nothing waits in a socket
buffer of the host) and keeps only what someone expects: replies and output whose parent is a
request still running. Everything else is dropped unread (between calls without even decoding
it). What is kept waits in a queue bounded in raw bytes; while the queue is full the pump stops
reading, so the kernel's own send buffer fills, inside the sandbox.

What the host holds per kernel is therefore bounded: between calls, a 64 KiB scratch buffer
per channel and nothing else; during a call, on IOPub one message being read (at most 32 MiB
raw) and a queue of at most 8 MiB (or one message) of decoded messages, on shell and control at
most 4 MiB each. Decoding is bounded too: `_loads` refuses JSON whose values would outgrow its
text (tiny containers grow twenty-fold in Python), and text grows at most four-fold (UCS-4).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import os
import re
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from jupyter_client.session import Session

from coderunner.kernel.zmtp import Limits, Skipped, ZmtpConnection, ZmtpError

log = logging.getLogger(__name__)

DELIMITER = b"<IDS|MSG>"
#: Largest IOPub message (all frames) the host accepts from a kernel; a bigger one is skipped
#: and the run it belongs to says that some output was lost.
IOPUB_LIMITS = Limits(max_frame_bytes=32 * 2**20, max_message_bytes=32 * 2**20, max_frames=64)
#: Decoded IOPub messages of a run waiting for the run to take them (beyond this the pump stops
#: reading; one message bigger than this still gets in when the queue is empty).
IOPUB_QUEUE_BYTES = 8 * 2**20
#: Replies on shell and control are small (status, execution count, error name).
REPLY_LIMITS = Limits(max_frame_bytes=4 * 2**20, max_message_bytes=4 * 2**20, max_frames=16)
#: Python memory one JSON value may cost beyond its text (measured: a dict entry with a fresh
#: key costs about 65 bytes, an empty list about 34).
_BYTES_PER_JSON_VALUE = 96
#: Frames smaller than this cannot grow much when decoded; larger ones are measured first.
_CHEAP_FRAME_BYTES = 1 << 16
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
#: The key under which a mailbox expects messages that have no parent (iopub_welcome).
NO_PARENT = ""


class ChannelBroken(Exception):
    """A channel's connection ended or the kernel broke the protocol: the kernel is unusable."""


@dataclass(frozen=True)
class Message:
    """A verified, decoded message someone expected."""

    msg_type: str
    parent_id: str
    content: dict[str, Any]


@dataclass(frozen=True)
class Lost:
    """A message for `parent_id` (None: for whoever is waiting) that was over a bound or unreadable."""

    parent_id: str | None
    reason: str


@dataclass
class Mailbox:
    """One kernel channel: a pump that drains it, and a bounded queue of expected messages."""

    name: str
    connection: ZmtpConnection
    session: Session
    queue_bytes: int
    _expected: set[str] = field(default_factory=set)
    _queue: collections.deque[tuple[Message | Lost, int]] = field(default_factory=collections.deque)
    _queued_bytes: int = 0
    _arrived: anyio.Event = field(default_factory=anyio.Event)
    _space: anyio.Event = field(default_factory=anyio.Event)
    broken: str | None = None
    #: Messages read and thrown away because nobody expected them (for tests and figures).
    dropped: int = 0
    #: The frames `_decide` last read a parent from, and that parent: `_sort` reads it once, not twice.
    _decided: tuple[list[bytes], str | None] | None = None

    # --- the consumer side ----------------------------------------------------------------------

    def expect(self, key: str) -> None:
        """Keep messages whose parent is `key` (a request's msg_id, or NO_PARENT) from now on."""
        self._expected.add(key)

    def forget(self, key: str) -> None:
        """Stop keeping messages for `key` and drop those already queued."""
        self._expected.discard(key)
        kept = collections.deque(item for item in self._queue if item[0].parent_id in self._expected)
        if len(kept) != len(self._queue):
            self._queue = kept
            self._queued_bytes = sum(size for _, size in kept)
            self._space.set()
            if not kept and self.broken is None:
                self._arrived = anyio.Event()

    async def get(self, timeout: float) -> Message | Lost | None:
        """The next expected message, or None when none came within `timeout`.

        Raises ChannelBroken once the queue is empty and the connection has ended.
        """
        if not self._queue:
            if self.broken is not None:
                raise ChannelBroken(f"the kernel's {self.name} channel ended: {self.broken}")
            if timeout <= 0:
                return None
            with anyio.move_on_after(timeout):
                await self._arrived.wait()
            if not self._queue:
                if self.broken is not None:
                    raise ChannelBroken(f"the kernel's {self.name} channel ended: {self.broken}")
                return None
        item, size = self._queue.popleft()
        self._queued_bytes -= size
        if not self._queue:
            self._arrived = anyio.Event()
        self._space.set()
        return item

    def make(self, msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
        """A request signed by this session; `expect` its msg_id before sending when its
        reply matters."""
        return self.session.msg(msg_type, content=content)

    async def send(self, msg: dict[str, Any], timeout: float) -> None:
        """Send within `timeout`: a kernel that stops reading its socket must not hold the
        caller. A send cut short leaves half a message on the wire, so the channel is broken."""
        reason = f"the kernel did not take a request within {timeout:g}s"
        with anyio.move_on_after(timeout):
            try:
                await self.connection.send(self.session.serialize(msg))
                return
            except ZmtpError as exc:
                reason = str(exc)
        self._break(reason)
        raise ChannelBroken(f"the kernel's {self.name} channel ended: {reason}")

    # --- the pump -----------------------------------------------------------------------------

    async def pump(self) -> None:
        """Read until the connection ends; never raises (a failure marks the mailbox broken)."""
        try:
            while True:
                received = await self.connection.recv(self._decide)
                item, size = self._sort(received)
                if item is None or (isinstance(item, Lost) and self._queue and self._queue[-1][0] == item):
                    self.dropped += 1  # nobody waits for it, or the same loss is already queued
                    continue
                while self._queue and self._queued_bytes + size > self.queue_bytes:
                    self._space = anyio.Event()
                    await self._space.wait()
                if not self._expected or (item.parent_id is not None and item.parent_id not in self._expected):
                    self.dropped += 1  # forgotten while we waited for room
                    continue
                self._queue.append((item, size))
                self._queued_bytes += size
                self._arrived.set()
        except ZmtpError as exc:
            self._break(str(exc))
        except Exception as exc:  # a bug here must not leave callers waiting for ever
            log.exception("%s channel pump failed", self.name)
            self._break(f"internal error: {exc}")

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        self.connection.close()
        self._arrived.set()

    def _decide(self, frames: list[bytes]) -> bool | None:
        """Read a message only when someone waits for it: between calls, nothing is read at all;
        during one, what has another parent is skipped once its parent header is in."""
        if not self._expected:
            return False
        try:
            at = frames.index(DELIMITER)
        except ValueError:
            return None
        if len(frames) < at + 4:
            return None
        parent = _parent_id(frames, self.connection.limits)
        self._decided = (frames, parent)
        return parent is not None and parent in self._expected

    def _sort(self, received: list[bytes] | Skipped) -> tuple[Message | Lost | None, int]:
        """Decode what someone expects; None for the rest. Returns the item and its raw size."""
        decided, self._decided = self._decided, None  # never held past its message (its frames may be big)
        if isinstance(received, Skipped):
            if not received.over_limit or not self._expected:
                return None, 0
            parent = _parent_id(received.head, self.connection.limits)
            if parent is not None and parent not in self._expected:
                return None, 0
            limit = self.connection.limits.max_message_bytes
            return Lost(parent, f"a message over {limit // 2**20} MiB was skipped"), 0
        size = sum(len(frame) for frame in received)
        if decided is not None and decided[0] is received:  # the same message: its parent frame is unchanged
            parent = decided[1]
        else:
            parent = _parent_id(received, self.connection.limits)
        if parent is None or parent not in self._expected:
            return None, 0
        try:
            return self._decode(received, parent), size
        except (ValueError, RecursionError, KeyError, TypeError) as exc:
            return Lost(parent, f"an unreadable message ({exc})"), size

    def _decode(self, frames: list[bytes], parent: str) -> Message:
        at = frames.index(DELIMITER)
        signature, header, _parent, metadata, content = frames[at + 1 : at + 6]
        expected = self.session.sign([header, _parent, metadata, content])
        if not hmac.compare_digest(expected, bytes(signature)):
            raise ValueError("bad signature")
        limit = self.connection.limits.max_message_bytes
        head = _loads(header, limit)
        return Message(msg_type=str(head.get("msg_type", "")), parent_id=parent, content=_loads(content, limit))


def _parent_id(frames: list[bytes], limits: Limits) -> str | None:
    """The msg_id in a message's parent header (unverified: only used to choose what to drop)."""
    try:
        at = frames.index(DELIMITER)
    except ValueError:
        return None
    if len(frames) < at + 4:
        return None
    try:
        parent = _loads(frames[at + 3], limits.max_message_bytes)
    except (ValueError, RecursionError):
        return None
    msg_id = parent.get("msg_id")
    return msg_id if isinstance(msg_id, str) else NO_PARENT


def _loads(frame: bytes, limit: int) -> dict[str, Any]:
    """Decode a JSON object whose Python form stays within about `limit` bytes beyond its text."""
    if not frame:
        return {}
    if len(frame) > _CHEAP_FRAME_BYTES and _json_values(frame) * _BYTES_PER_JSON_VALUE > limit:
        raise ValueError("a JSON document with too many values")
    value = json.loads(frame)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _json_values(frame: bytes) -> int:
    """An upper bound on the number of values in a JSON text (commas inside strings excluded
    only when the quick count is high)."""
    quick = frame.count(b",") + frame.count(b":") + frame.count(b"[") + frame.count(b"{")
    if quick * _BYTES_PER_JSON_VALUE <= len(frame):
        return quick
    outside = _JSON_STRING.sub(b'""', frame)
    return outside.count(b",") + outside.count(b":") + outside.count(b"[") + outside.count(b"{")


async def connect(url: str, socket_type: str, limits: Limits, identity: bytes = b"") -> ZmtpConnection:
    """Connect to one kernel channel (`ipc://path` or `tcp://host:port`) and do the ZMTP handshake.

    Never retries: a kernel that is not listening yet is the caller's wait, not a reconnect loop.
    """
    transport, _, where = url.partition("://")
    if transport == "ipc":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    elif transport == "tcp":
        host, _, port = where.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        raise ValueError(f"unsupported transport in {url}")
    connection = ZmtpConnection(sock, socket_type, limits, identity)
    try:
        if transport == "ipc":
            with _socket_entry(where) as address:
                await _connect(sock, address, url)
        else:
            await _connect(sock, (host, int(port)), url)
        await connection.handshake()
    except BaseException:
        connection.close()
        raise
    return connection


async def _connect(sock: socket.socket, address: Any, url: str) -> None:
    sock.setblocking(False)
    try:
        sock.connect(address)
    except (BlockingIOError, InterruptedError):
        await anyio.wait_writable(sock)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, f"could not connect to {url}") from None


@contextlib.contextmanager
def _socket_entry(path: str) -> Iterator[str]:
    """An address for the socket at `path` that cannot be a link the sandbox swapped in.

    The socket's folder is writable from inside the sandbox: the last component is opened
    without following links, checked to be a socket, and connected through /proc/self/fd.
    (Where O_PATH does not exist, as on macOS, the entry is only checked before connecting.)
    """
    o_path = getattr(os, "O_PATH", None)
    if o_path is None:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} is not a socket")
        yield path
        return
    fd = os.open(path, o_path | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a socket")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
