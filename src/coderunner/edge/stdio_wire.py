"""stdio's MCP channel read and written on the event loop, with no worker thread per message.

The SDK's stdio transport reads each line, writes each message and flushes it in a worker thread:
three thread hops per call, each about 0.1 ms of CPU and more of waiting, a sixth of a warm
`1+1`'s time in the server. When stdin and stdout are pipes or sockets (what an MCP client gives the
server it launches), `claim_stdio` reads and writes them non-blocking on the loop instead; for
anything else (a terminal, a file) it gives None and the SDK's own transport serves.

The claim keeps the SDK's contract: while serving, fd 0 reads /dev/null and fd 1 writes to stderr,
so children and stray prints never reach the wire, which lives on private duplicates; on exit both
fds get the wire back, blocking again.

`wire_streams` frames messages as JSON-RPC wants, and answers what it refuses instead of dropping it
in silence: a line longer than MAX_LINE_BYTES (skipped as it is read, so the buffer stays bounded
whatever a client sends) and a line that is not JSON get a parse error (-32700, id null); JSON that
is not a JSON-RPC message gets an invalid-request error (-32600). Blank lines are skipped. When
stdin closes, the requests already read are answered before the server is told the channel is gone
(bounded: `drain_s`), so a request written just before the close is never lost; unless the client
also stopped reading stdout (it was killed), when nothing is waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import stat
from collections.abc import AsyncIterator, Iterator

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage
from mcp.types import (
    CONNECTION_CLOSED,
    INVALID_REQUEST,
    PARSE_ERROR,
    ErrorData,
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    jsonrpc_message_adapter,
)
from pydantic import ValidationError

log = logging.getLogger(__name__)

#: Longest message line the server reads (an HTTP request body may have 4 MiB; stdio carries more).
MAX_LINE_BYTES = 64 * 2**20
_CHUNK = 1 << 16


class WireReader:
    """Lines from a non-blocking pipe, as bytes with their newline; None for a line over the limit (skipped)."""

    def __init__(self, fd: int, limit: int = MAX_LINE_BYTES) -> None:
        self.fd = fd
        self.limit = limit
        self._buffer = bytearray()
        self._searched = 0  # bytes of the buffer already known to hold no newline
        self._dropping = False  # inside a line over the limit: skip up to its newline
        self._eof = False

    def __aiter__(self) -> WireReader:
        return self

    async def __anext__(self) -> bytes | None:
        while True:
            end = self._buffer.find(b"\n", self._searched)
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                self._searched = 0
                if self._dropping or len(line) > self.limit + 1:  # + 1: its newline
                    if not self._dropping:
                        log.warning("a message line over %d MiB from the client was dropped", self.limit >> 20)
                    self._dropping = False
                    return None
                return line
            self._searched = len(self._buffer)
            if self._searched > self.limit:
                if not self._dropping:
                    log.warning("a message line over %d MiB from the client was dropped", self.limit >> 20)
                self._dropping = True
                self._buffer.clear()
                self._searched = 0
            if self._eof:
                if self._dropping:
                    self._dropping = False
                    return None
                if self._buffer:
                    rest = bytes(self._buffer)
                    self._buffer.clear()
                    return rest
                raise StopAsyncIteration
            await self._fill()

    async def _fill(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, _CHUNK)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(self.fd)
                continue
            if not chunk:
                self._eof = True
            self._buffer += chunk
            return


class WireWriter:
    """Writes to a non-blocking pipe, waiting (never spinning) while the client is slow to read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = anyio.Lock()

    async def write(self, text: str) -> None:
        view = memoryview(text.encode("utf-8"))
        async with self._lock:  # one message's bytes never interleave with another's
            while view:
                try:
                    view = view[os.write(self.fd, view) :]
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_writable(self.fd)

    async def flush(self) -> None:
        """Nothing is buffered here: each write has reached the pipe when it returns."""


def _is_stream(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.contextmanager
def _claimed(fd: int, diversion: int) -> Iterator[int]:
    """A private, non-blocking duplicate of `fd` while `fd` itself points at `diversion`; restored after."""
    wire = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    try:
        os.dup2(diversion, fd)
        os.set_blocking(wire, False)
        try:
            yield wire
        finally:
            with contextlib.suppress(OSError):
                os.set_blocking(wire, True)  # the description is shared again once it is back on `fd`
            os.dup2(wire, fd)
    finally:
        os.close(wire)


@contextlib.asynccontextmanager
async def claim_stdio() -> AsyncIterator[tuple[WireReader, WireWriter] | None]:
    """The MCP wire on stdin/stdout, read and written on the loop; None when they are not pipes or sockets."""
    if not (_is_stream(0) and _is_stream(1)):
        yield None
        return
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with _claimed(0, null) as wire_in, _claimed(1, 2) as wire_out:
            os.close(null)
            null = -1
            yield WireReader(wire_in), WireWriter(wire_out)
    finally:
        if null >= 0:
            os.close(null)


#: The server's read stream (a refused line never reaches it) and write stream.
Incoming = MemoryObjectReceiveStream[SessionMessage | Exception]
Outgoing = MemoryObjectSendStream[SessionMessage]


def error_line(code: int, message: str, request_id: int | str | None = None) -> str:
    """A JSON-RPC error reply, one line."""
    reply = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
    return json.dumps(reply, separators=(",", ":")) + "\n"


def refusal(line: bytes | None) -> str:
    """The error reply to a line that is not a JSON-RPC message (None: a line over the limit)."""
    if line is None:
        return error_line(PARSE_ERROR, f"Parse error: a line over {MAX_LINE_BYTES >> 20} MiB was dropped")
    try:
        value = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return error_line(PARSE_ERROR, "Parse error: the line is not JSON")
    found = value.get("id") if isinstance(value, dict) and "method" in value else None
    request_id = found if isinstance(found, str) or (isinstance(found, int) and not isinstance(found, bool)) else None
    return error_line(INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message", request_id)


class Unanswered:
    """The ids of requests read from the client and not yet answered on the wire, and of the server's own
    requests to the client (an elicitation, say) not yet answered by it."""

    def __init__(self) -> None:
        self.ids: set[int | str] = set()
        #: The server's requests the client has not answered.
        self.asked: set[int | str] = set()
        #: The client can no longer be written to: nothing is left to wait for.
        self.gone = False
        self._changed = anyio.Event()

    def read(self, message: JSONRPCMessage) -> None:
        if isinstance(message, JSONRPCRequest):
            self.ids.add(message.id)
        elif isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
            self.asked.discard(message.id)
        elif isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled":
            request_id = (message.params or {}).get("requestId")  # a cancelled request gets no answer
            if isinstance(request_id, int | str):
                self._settle(request_id)

    def written(self, message: JSONRPCMessage) -> None:
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
            self._settle(message.id)
        elif isinstance(message, JSONRPCRequest):
            self.asked.add(message.id)
            self._changed.set()

    def lost_client(self) -> None:
        self.gone = True
        self._changed.set()

    def _settle(self, request_id: int | str) -> None:
        if request_id in self.ids:
            self.ids.discard(request_id)
            self._changed.set()

    async def drained(self, sink: MemoryObjectSendStream[SessionMessage | Exception]) -> None:
        """Return once every request read has been answered (or the client is gone). stdin has closed: each
        request the server asks the client meanwhile is answered here, as the SDK would, 'Connection closed'
        (the client can no longer answer it, and the call waiting for it must not wait for nothing)."""
        while self.ids and not self.gone:
            for request_id in sorted(self.asked, key=str):
                self.asked.discard(request_id)
                closed = ErrorData(code=CONNECTION_CLOSED, message="Connection closed: stdin ended")
                await sink.send(SessionMessage(JSONRPCError(jsonrpc="2.0", id=request_id, error=closed)))
            if self.ids and not self.gone and not self.asked:
                self._changed = anyio.Event()
                await self._changed.wait()


@contextlib.asynccontextmanager
async def wire_streams(
    reader: AsyncIterator[bytes | None], writer: WireWriter, drain_s: float
) -> AsyncIterator[tuple[Incoming, Outgoing]]:
    """The server's (read stream, write stream) over the wire, framed and refusing as the module says."""
    incoming_send, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    outgoing, outgoing_receive = anyio.create_memory_object_stream[SessionMessage](0)
    unanswered = Unanswered()
    async with anyio.create_task_group() as group:
        group.start_soon(_read_wire, reader, writer, incoming_send, unanswered, drain_s)
        group.start_soon(_write_wire, outgoing_receive, writer, unanswered)
        yield incoming, outgoing


async def _read_wire(
    reader: AsyncIterator[bytes | None],
    writer: WireWriter,
    sink: MemoryObjectSendStream[SessionMessage | Exception],
    unanswered: Unanswered,
    drain_s: float,
) -> None:
    async with sink:
        async for line in reader:
            if line is not None and not line.strip():
                continue
            try:
                if line is None:
                    raise ValueError("over the limit")
                message = jsonrpc_message_adapter.validate_json(line, by_name=False)
            except (ValidationError, ValueError):
                reply = refusal(line)
                if not unanswered.gone:
                    log.warning("refused a line from the client: %s", reply.strip())
                    with contextlib.suppress(OSError):
                        await writer.write(reply)
                continue
            unanswered.read(message)
            await sink.send(SessionMessage(message))
        with anyio.move_on_after(drain_s):
            async with anyio.create_task_group() as watch:
                watch.start_soon(_watch_hang_up, writer.fd, unanswered)
                await unanswered.drained(sink)
                watch.cancel_scope.cancel()
        if unanswered.ids and not unanswered.gone:
            log.warning("stdin closed; %d request(s) still unanswered after %.0f s", len(unanswered.ids), drain_s)


#: How often, once stdin has closed, the server looks whether the client also stopped reading stdout.
HANG_UP_POLL_S = 0.25


def hung_up(fd: int) -> bool:
    """Whether nobody reads `fd` any more (a pipe's reader closed: POLLERR; a socket's peer: POLLHUP)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


async def _watch_hang_up(fd: int, unanswered: Unanswered) -> None:
    """Once stdin has closed, a client that also stopped reading (killed, not just done writing) is gone:
    the requests it sent are not waited for, so its sandboxes end now, not after its longest cell."""
    while not unanswered.gone:
        if hung_up(fd):
            log.info("the client closed stdin and stopped reading stdout: its requests are not waited for")
            unanswered.lost_client()
            return
        await anyio.sleep(HANG_UP_POLL_S)


async def _write_wire(
    source: MemoryObjectReceiveStream[SessionMessage], writer: WireWriter, unanswered: Unanswered
) -> None:
    async with source:
        async for item in source:
            if unanswered.gone:
                continue  # keep taking them, so that no sender waits on a client that left
            text = item.message.model_dump_json(by_alias=True, exclude_unset=True)
            try:
                await writer.write(text + "\n")
            except OSError as exc:
                log.warning("the client's end of stdout is gone (%s): replies are dropped from now on", exc)
                unanswered.lost_client()
                continue
            unanswered.written(item.message)
