"""stdio's wire on the loop: lines as the SDK reads them, bounded, and fds given back as they were."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import anyio
import pytest

from coderunner.edge.stdio_wire import WireReader, WireWriter, _claimed

pytestmark = pytest.mark.anyio


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    yield read, write
    for fd in (read, write):
        with contextlib.suppress(OSError):
            os.close(fd)


async def lines_of(reader: WireReader) -> list[str | None]:
    return [None if line is None else line.decode("utf-8", "replace") async for line in reader]


async def test_lines_split_across_writes_come_whole_and_a_last_unended_one_too(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.set_blocking(read, False)
    reader = WireReader(read)

    async def feed() -> None:
        for piece in (b'{"a":', b'1}\n{"b"', b':2}\n\n{"c":"\xc3', b'\xa9"}\n{"tail":3}'):
            os.write(write, piece)
            await anyio.sleep(0.01)
        os.close(write)

    async with anyio.create_task_group() as group:
        group.start_soon(feed)
        got = await lines_of(reader)
    assert got == ['{"a":1}\n', '{"b":2}\n', "\n", '{"c":"é"}\n', '{"tail":3}']


async def test_a_line_over_the_limit_is_dropped_told_as_none_and_the_next_one_read(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.set_blocking(read, False)
    reader = WireReader(read, limit=1000)

    async def feed() -> None:
        for _ in range(10):  # 5000 bytes without a newline, in pieces: never held beyond the limit
            os.write(write, b"x" * 500)
            await anyio.sleep(0)
        os.write(write, b"x\n" + b'{"ok":true}\n')
        os.close(write)

    async with anyio.create_task_group() as group:
        group.start_soon(feed)
        got = await lines_of(reader)
    assert got == [None, '{"ok":true}\n']  # None: the place of the dropped line, for its error reply
    assert len(reader._buffer) == 0


async def test_a_line_just_over_the_limit_that_ends_in_one_read_is_dropped_too(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.set_blocking(read, False)
    reader = WireReader(read, limit=1000)
    os.write(write, b"x" * 1001 + b"\n" + b"x" * 1000 + b"\n" + b"x" * 2000)
    os.close(write)
    assert await lines_of(reader) == [None, "x" * 1000 + "\n", None]


async def test_writes_wait_for_a_slow_reader_and_arrive_whole(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.set_blocking(write, False)
    writer = WireWriter(write)
    message = "y" * (1 << 20) + "\n"  # far more than a pipe holds
    received = bytearray()

    async def drain() -> None:
        while len(received) < len(message):
            await anyio.wait_readable(read)
            received.extend(os.read(read, 1 << 16))

    async with anyio.create_task_group() as group:
        group.start_soon(drain)
        await writer.write(message)
        await writer.flush()
    assert received.decode() == message


def test_a_claimed_fd_points_elsewhere_and_gets_its_wire_back_blocking(pipe: tuple[int, int]) -> None:
    read, write = pipe
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        with _claimed(write, null) as wire:
            assert wire > 2 and not os.get_blocking(wire)
            os.write(write, b"stray\n")  # goes to the diversion, never to the wire
            os.write(wire, b"message\n")
        assert os.get_blocking(write)
        os.write(write, b"after\n")
    finally:
        os.close(null)
    os.close(write)
    assert os.read(read, 100) == b"message\nafter\n"


async def test_after_stdin_closes_the_servers_own_request_is_answered_connection_closed_and_its_call_still_answered(
    pipe: tuple[int, int],
) -> None:
    """A call read just before stdin closed waits on the client (an elicitation, say): the client cannot answer
    any more, so the wire answers that request 'Connection closed' at once; the call's reply still goes out,
    and only then does the server's read stream end."""
    from mcp.shared.message import SessionMessage
    from mcp.types import JSONRPCError, JSONRPCRequest, JSONRPCResponse

    from coderunner.edge.stdio_wire import wire_streams

    stdin, client_writes = pipe  # the server's stdin (read end), and the client's end of it
    client_reads, stdout = os.pipe()
    try:
        for fd in (stdin, stdout):
            os.set_blocking(fd, False)
        os.write(client_writes, b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x"}}\n')
        os.close(client_writes)
        with anyio.fail_after(10):
            async with wire_streams(WireReader(stdin), WireWriter(stdout), drain_s=30) as (incoming, outgoing):
                call = await incoming.receive()
                assert isinstance(call, SessionMessage) and isinstance(call.message, JSONRPCRequest)
                asked = JSONRPCRequest(jsonrpc="2.0", id=0, method="elicitation/create", params={})
                await outgoing.send(SessionMessage(asked))
                answer = await incoming.receive()
                assert isinstance(answer, SessionMessage) and isinstance(answer.message, JSONRPCError)
                assert answer.message.id == 0 and answer.message.error.code == -32000
                await outgoing.send(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=1, result={})))
                with pytest.raises(anyio.EndOfStream):
                    await incoming.receive()
                await outgoing.aclose()
        written = os.read(client_reads, 1 << 16).decode().splitlines()
        assert [json.loads(line)["id"] for line in written] == [0, 1]
    finally:
        for fd in (client_reads, stdout):
            with contextlib.suppress(OSError):
                os.close(fd)
