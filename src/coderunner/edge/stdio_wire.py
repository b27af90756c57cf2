"""stdio's MCP channel read and written on the event loop, with no worker thread per message.

The SDK's stdio transport reads each line, writes each message and flushes it in a worker thread:
three thread hops per call, each about 0.1 ms of CPU and more of waiting, a sixth of a warm
`1+1`'s time in the server. When stdin and stdout are pipes or sockets (what an MCP client gives the
server it launches), `claim_stdio` reads and writes them non-blocking on the loop instead; for
anything else (a terminal, a file) it gives None and the SDK's own transport serves.

The claim keeps the SDK's contract: while serving, fd 0 reads /dev/null and fd 1 writes to stderr,
so children and stray prints never reach the wire, which lives on private duplicates; on exit both
fds get the wire back, blocking again. A line longer than MAX_LINE_BYTES is dropped (logged), so the
buffer stays bounded whatever a client sends.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import AsyncIterator, Iterator

import anyio

log = logging.getLogger(__name__)

#: Longest message line the server reads (an HTTP request body may have 4 MiB; stdio carries more).
MAX_LINE_BYTES = 64 * 2**20
_CHUNK = 1 << 16


class WireReader:
    """Lines from a non-blocking pipe, as the SDK's `async for line in stdin` reads them (text, newline kept)."""

    def __init__(self, fd: int, limit: int = MAX_LINE_BYTES) -> None:
        self.fd = fd
        self.limit = limit
        self._buffer = bytearray()
        self._searched = 0  # bytes of the buffer already known to hold no newline
        self._dropping = False  # inside a line over the limit: skip up to its newline
        self._eof = False

    def __aiter__(self) -> WireReader:
        return self

    async def __anext__(self) -> str:
        while True:
            end = self._buffer.find(b"\n", self._searched)
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                self._searched = 0
                if self._dropping:
                    self._dropping = False
                    continue
                return line.decode("utf-8", "replace")
            self._searched = len(self._buffer)
            if self._searched > self.limit:
                if not self._dropping:
                    log.warning("a message line over %d MiB from the client was dropped", self.limit >> 20)
                self._dropping = True
                self._buffer.clear()
                self._searched = 0
            if self._eof:
                if self._buffer and not self._dropping:
                    rest = bytes(self._buffer)
                    self._buffer.clear()
                    return rest.decode("utf-8", "replace")
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
