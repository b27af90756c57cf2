"""A real EgressProxy on a unix socket in a temp dir, a counting upstream on 127.0.0.1, and a client.

Test names resolve through an injected resolver; the upstream listens on loopback, which the real
address check refuses, so tests that reach it inject `loopback_only` as the check. Tests of the real
check leave it out and assert the upstream was never reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import shutil
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from coderunner.egress import DecisionLog, EgressPolicy, EgressProxy, IPAddress, ProxyLimits

T = TypeVar("T")
LOOPBACK = ipaddress.ip_address("127.0.0.1")
CLIENT_TIMEOUT_S = 20.0
METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ")


def loopback_only(ip: IPAddress) -> str | None:
    """The address check tests use to reach their upstream: loopback only, nothing else at all."""
    return None if ip.is_loopback else "not the test upstream"


def resolver_for(
    table: dict[str, list[str]], default: list[str] | None = None
) -> Callable[[str, int], Awaitable[list[IPAddress]]]:
    async def resolve(host: str, port: int) -> list[IPAddress]:
        found = table.get(host, default)
        if found is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in found]

    return resolve


@dataclass
class Upstream:
    """A plain TCP server: answers an HTTP request with the head it got as the body; echoes anything else."""

    port: int = 0
    connects: int = 0
    heads: list[bytes] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None

    async def start(self, host: str = "127.0.0.1") -> Upstream:
        self.server = await asyncio.start_server(self._serve, host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connects += 1
        try:
            data = await reader.read(65536)
            if data.startswith(METHODS):
                while b"\r\n\r\n" not in data and len(data) < 65536:
                    more = await reader.read(65536)
                    if not more:
                        break
                    data += more
                head = data.split(b"\r\n\r\n", 1)[0]
                self.heads.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(head) + head)
                await writer.drain()
                return
            while data:
                writer.write(data)
                await writer.drain()
                data = await reader.read(65536)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


@dataclass
class Running:
    path: str
    proxy: EgressProxy
    log: DecisionLog


@contextlib.asynccontextmanager
async def running_proxy(
    policy: EgressPolicy,
    ceiling: EgressPolicy | None = None,
    **kw: Any,
) -> AsyncIterator[Running]:
    """An EgressProxy serving on a fresh unix socket; kw go to EgressProxy (limits, resolver, ...)."""
    tmp = tempfile.mkdtemp(prefix="egress-", dir="/tmp")
    path = str(Path(tmp) / "proxy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(512)
    log = kw.pop("log", None) or DecisionLog("test-session")
    kw.setdefault("limits", ProxyLimits())
    proxy = EgressProxy(policy, ceiling or policy, session_id="test-session", log=log, **kw)
    task = asyncio.ensure_future(proxy.serve(listener))
    try:
        yield Running(path=path, proxy=proxy, log=log)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        listener.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def exchange(path: str, data: bytes, *, timeout: float = CLIENT_TIMEOUT_S, limit: int = 1 << 20) -> bytes:
    """Send data, half-close, read the answer until the proxy closes (bounded in time and bytes)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        try:
            writer.write(data)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            pass  # the proxy answered and closed before reading everything (503, 400): read the answer
        return await asyncio.wait_for(_read_all(reader, limit), timeout)
    finally:
        writer.close()


async def _read_all(reader: asyncio.StreamReader, limit: int) -> bytes:
    out = bytearray()
    while len(out) < limit:
        try:
            chunk = await reader.read(65536)
        except OSError:
            break  # a close with our bytes unread resets a unix socket: keep what arrived before
        if not chunk:
            break
        out += chunk
    return bytes(out)


def status_of(answer: bytes) -> int:
    """The status code of an answer, 0 if there is none."""
    line = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/1.") and line[1].isdigit() else 0


def body_of(answer: bytes) -> str:
    return answer.split(b"\r\n\r\n", 1)[1].decode() if b"\r\n\r\n" in answer else ""


class BackgroundLoop:
    """An event loop in a thread, for tests driven by a synchronous generator (hypothesis)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextlib.asynccontextmanager
async def peak_connections(proxy: EgressProxy) -> AsyncIterator[list[int]]:
    """The most connections `proxy` held at once while the block ran (sampled every 5 ms), as [peak]."""
    peak = [0]

    async def watch() -> None:
        while True:
            peak[0] = max(peak[0], proxy.active_connections)
            await asyncio.sleep(0.005)

    watcher = asyncio.ensure_future(watch())
    try:
        yield peak
    finally:
        watcher.cancel()
        peak[0] = max(peak[0], proxy.active_connections)


def piping_to(unix_path: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A stream server's handler that carries each connection's bytes (never fds) to `unix_path`."""

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:
            dst.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(unix_path)
        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()

    return serve


@contextlib.asynccontextmanager
async def tcp_front(unix_path: str) -> AsyncIterator[int]:
    """A TCP port on 127.0.0.1 that pipes each connection to the proxy's unix socket: what the
    in-sandbox forwarder does, so ordinary clients (curl, urllib) can be pointed at the proxy."""
    serve = piping_to(unix_path)
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
