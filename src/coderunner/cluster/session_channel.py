"""The session channel: a front door's own connection to a node agent, for the calls of a session's hot path.

Why: a Ray actor call costs 0.9-1.2 ms on this machine where a plain TCP round trip between the same two
processes costs 0.15-0.43 ms, and a warm `run_python` made one such call each way (docs/cluster.md has the
hop table). Ray still places agents, names them, ends them and answers for them when they die; it also
hands out each agent's channel address and key, over its own token-authenticated calls (`NodeAgent.channel`).
A call the channel cannot carry (no address yet, the agent not listening) goes by Ray as before.

What guards the port. The agent listens on its node's address, so:
- Nothing is read as a call before the peer proves it holds the agent's key: the agent sends a random
  challenge, the front door answers it with HMAC-SHA256 under the key (32 random bytes, never written to
  disk, given only to front doors by Ray) and sends its own, which the agent answers only then. A peer
  without the key learns a random challenge, and is cut if it does not prove itself within HANDSHAKE_S.
- Only then are frames unpickled, as Ray does between its own processes: both ends are this package's code.
- Frames are bounded (MAX_FRAME_BYTES), and so are connections (MAX_CONNECTIONS) and calls under way on
  one connection (MAX_IN_FLIGHT: the next frame is not read until one ends).
- Sandboxes reach no port of their node: network 'none' has a namespace of its own, 'allowlist' goes
  through a proxy that refuses node, loopback and private addresses, and a cluster front door refuses
  'internet' (tests/cluster/test_cluster_auth.py probes every listener of the namespace, this one too).

One idea: a bounded, authenticated request and answer connection of plain frames, served by a callable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coderunner.errors import CodeRunnerError, SessionError

log = logging.getLogger(__name__)

#: Bound on a peer's proof of the key, and on a front door's connect.
HANDSHAKE_S = 5.0
#: Bytes one frame may hold (a run's answer carries its output and images; file pieces go by Ray's object store).
MAX_FRAME_BYTES = 64 << 20
#: Connections one agent holds at once (a front door keeps one per agent).
MAX_CONNECTIONS = 256
#: Calls under way on one connection; the agent reads no further frame of it until one ends.
MAX_IN_FLIGHT = 1024
#: Bytes of each side's challenge.
CHALLENGE_BYTES = 32
_LENGTH = struct.Struct("!I")


@dataclass(frozen=True)
class ChannelAddress:
    """Where an agent's channel listens, and the key a front door proves itself with."""

    host: str
    port: int
    key: bytes


class ChannelUnused(Exception):
    """Nothing of the call was sent (no connection could be made): another way may carry it."""


class ChannelBroken(Exception):
    """The call was sent and the connection ended before its answer: whether it ran is not known here."""


def _proof(key: bytes, side: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, side + challenge, hashlib.sha256).digest()


def _frame(value: Any) -> bytes:
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME_BYTES:
        raise SessionError(f"an answer of {len(body)} bytes is over the session channel's {MAX_FRAME_BYTES} bytes")
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {length} bytes is over the session channel's {MAX_FRAME_BYTES}")
    return pickle.loads(await reader.readexactly(length))


def _sendable(exc: BaseException) -> BaseException:
    """What a call's failure crosses as: our own errors as they are (if they survive a round trip), the rest
    as a SessionError that names them (the agent's log has the whole)."""
    if isinstance(exc, CodeRunnerError):
        with contextlib.suppress(Exception):
            pickle.loads(pickle.dumps(exc))
            return exc
        return SessionError(str(exc))
    return SessionError(f"the session's node failed with {type(exc).__name__} (its log says more)")


async def or_else(
    channel: AgentChannel | None, name: str, args: tuple[Any, ...], otherwise: Callable[[], Awaitable[Any]]
) -> Any:
    """A call that changes nothing on the agent (a visit, a long poll): by `channel` if there is one, else, or
    if nothing was sent or it was cut off (asking again is harmless), by `otherwise` (Ray's call)."""
    if channel is not None:
        with contextlib.suppress(ChannelUnused, ChannelBroken):
            return await channel.call(name, args)
    return await otherwise()


class ChannelServer:
    """An agent's end: `serve(name, args)` answers each proven call; started on `host`, port chosen by the system."""

    def __init__(self, serve: Callable[[str, tuple[Any, ...]], Awaitable[Any]]) -> None:
        self._serve = serve
        self._key = secrets.token_bytes(32)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self.address: ChannelAddress | None = None
        self._starting = asyncio.Lock()
        #: Calls it took (the cluster tests see that a session's calls take it).
        self.answered = 0

    async def start(self, host: str) -> ChannelAddress:
        """Listen (once: front doors asking at once get the same address)."""
        async with self._starting:
            if self.address is None:
                self._server = await asyncio.start_server(self._connection, host, 0)
                port = self._server.sockets[0].getsockname()[1]
                self.address = ChannelAddress(host, port, self._key)
        return self.address

    def close(self) -> None:
        """Listen no more and end every connection (their calls under way are cut off)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        try:
            if not await self._proven(reader, writer):
                return
            room = asyncio.Semaphore(MAX_IN_FLIGHT)
            sending = asyncio.Lock()
            while True:
                try:
                    request_id, name, args = await _read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                await room.acquire()
                call = asyncio.get_running_loop().create_task(self._answer(writer, sending, request_id, name, args))
                self._calls.add(call)

                def ended(done: asyncio.Task[None]) -> None:
                    self._calls.discard(done)
                    room.release()

                call.add_done_callback(ended)
        finally:
            # Calls under way end on their own, as Ray's do when their caller goes away (a run's first wait,
            # a long poll): cancelled halfway, a call could leave its session half changed.
            self._writers.discard(writer)
            writer.close()

    async def _proven(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The front door answered our challenge (then we answer its own), within HANDSHAKE_S. It proves first:
        a peer without the key learns nothing but a random challenge."""
        mine = secrets.token_bytes(CHALLENGE_BYTES)
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                writer.write(mine)
                theirs = await reader.readexactly(CHALLENGE_BYTES)
                answer = await reader.readexactly(hashlib.sha256().digest_size)
                if not hmac.compare_digest(answer, _proof(self._key, b"door", mine)):
                    return False
                writer.write(_proof(self._key, b"agent", theirs))
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False
        return True

    async def _answer(
        self, writer: asyncio.StreamWriter, sending: asyncio.Lock, request_id: int, name: str, args: tuple[Any, ...]
    ) -> None:
        self.answered += 1
        try:
            reply: tuple[int, bool, Any] = (request_id, True, await self._serve(name, args))
        except Exception as exc:
            reply = (request_id, False, _sendable(exc))
        try:
            frame = _frame(reply)
        except SessionError as exc:
            frame = _frame((request_id, False, exc))
        except Exception as exc:  # an answer pickle cannot hold
            frame = _frame((request_id, False, _sendable(exc)))
        async with sending:
            with contextlib.suppress(ConnectionError):
                writer.write(frame)
                await writer.drain()


class AgentChannel:
    """A front door's end: one connection to one agent's channel, made at the first call (again after a break),
    its calls answered by request id. Calls may come from many tasks of one event loop at once."""

    def __init__(self, address: ChannelAddress) -> None:
        self.address = address
        self._connecting = asyncio.Lock()
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        self._next_id = 0
        self._reader_task: asyncio.Task[None] | None = None

    async def call(self, name: str, args: tuple[Any, ...]) -> Any:
        """`name(*args)` on the agent. ChannelUnused: nothing was sent; ChannelBroken: sent, no answer came."""
        writer = await self._connected()
        self._next_id += 1
        request_id = self._next_id
        answer: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        try:
            try:
                writer.write(_frame((request_id, name, args)))
            except (ConnectionError, RuntimeError) as exc:
                raise ChannelUnused(str(exc)) from None
            try:
                await writer.drain()  # the agent reads too slowly: wait (the write buffer stays bounded)
            except ConnectionError as exc:
                raise ChannelBroken(str(exc)) from None
            ok, value = await answer
        finally:
            self._waiting.pop(request_id, None)
        if not ok:
            raise value
        return value

    async def _connected(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return self._writer
            try:
                async with asyncio.timeout(HANDSHAKE_S):
                    reader, writer = await asyncio.open_connection(self.address.host, self.address.port)
                    try:
                        theirs = await reader.readexactly(CHALLENGE_BYTES)
                        mine = secrets.token_bytes(CHALLENGE_BYTES)
                        writer.write(mine + _proof(self.address.key, b"door", theirs))
                        proof = await reader.readexactly(hashlib.sha256().digest_size)
                        if not hmac.compare_digest(proof, _proof(self.address.key, b"agent", mine)):
                            raise ConnectionError("the agent's channel did not prove it holds the agent's key")
                    except BaseException:
                        writer.close()
                        raise
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                raise ChannelUnused(f"no connection to {self.address.host}:{self.address.port}: {exc!r}") from None
            self._writer = writer
            self._reader_task = asyncio.get_running_loop().create_task(self._read_answers(reader, writer))
            return writer

    async def _read_answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_id, ok, value = await _read_frame(reader)
                answer = self._waiting.get(request_id)
                if answer is not None and not answer.done():  # else its caller stopped waiting
                    answer.set_result((ok, value))
        except Exception as exc:
            if not isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                log.warning("the session channel to %s:%d: %r", self.address.host, self.address.port, exc)
        finally:
            writer.close()
            if self._writer is writer:
                self._writer = None
            broken = ChannelBroken(f"the connection to the agent at {self.address.host}:{self.address.port} ended")
            for answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(broken)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
