"""Reaching the server a proxied request names: resolve the name (bounded), drop every address the
check refuses, connect to a checked address only (never to a name), and say why not otherwise.

`UpstreamOpener` is one proxy's: its lookups share a few slots (a flood of slow names from one
sandbox cannot take the server's threads), each with the proxy's resolve and connect bounds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from coderunner.egress.addresses import IPAddress, cached_host_addresses, forbidden_reason, host_addresses
from coderunner.egress.wire import BLOCKED, os_reason

log = logging.getLogger(__name__)

#: Resolves (host, port) to addresses. The default uses getaddrinfo in a worker thread.
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
#: Why an address must not be connected to, or None. The default is addresses.forbidden_reason with
#: the host's own addresses; tests inject a looser one to reach their 127.0.0.1 upstream.
AddressCheck = Callable[[IPAddress], "str | None"]
_MAX_ADDRESSES_TRIED = 4
_RESOLVES_PER_PROXY = 4

#: Name lookups run here, not in the loop's default executor: a session that floods slow lookups
#: then cannot starve the server's other to_thread work.
_lookups = ThreadPoolExecutor(max_workers=8, thread_name_prefix="egress-lookup")


@dataclass(frozen=True)
class Failure:
    """Why the server was not reached: the decision to record and the answer to give."""

    allowed: bool
    reason: str
    code: int
    phrase: str
    body: str
    status: str


class UpstreamOpener:
    """One proxy's way to its servers, under its resolve and connect bounds."""

    def __init__(
        self,
        *,
        resolve_timeout_s: float,
        connect_timeout_s: float,
        resolver: Resolver | None = None,
        address_check: AddressCheck | None = None,
    ) -> None:
        self.resolve_timeout_s = resolve_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._resolver = resolver
        self._address_check = address_check
        self._resolving = asyncio.Semaphore(_RESOLVES_PER_PROXY)

    async def open(self, host: str, port: int) -> tuple[socket.socket | None, Failure | None]:
        """Resolve, check every address, connect to a checked one. Never connects by name."""
        try:
            addresses = await self.resolve(host, port)
        except TimeoutError:
            return None, Failure(
                True, "name lookup timed out", 504, "Gateway Timeout", f"looking up {host} timed out", "dns_timeout"
            )
        except OSError as exc:
            return None, Failure(
                True,
                "name lookup failed",
                502,
                "Bad Gateway",
                f"{host} could not be resolved ({os_reason(exc)})",
                "dns_error",
            )
        check = self._address_check
        if check is None:
            try:
                cached = cached_host_addresses()
                own = cached if cached else await asyncio.to_thread(host_addresses)
            except OSError as exc:
                log.warning("egress proxy: the host's own addresses cannot be read: %s", exc)
                why = "the proxy cannot read this host's own addresses, so it refuses"
                failure = Failure(False, "cannot check addresses", 502, "Bad Gateway", why, "proxy_internal_error")
                return None, failure

            def check(ip: IPAddress) -> str | None:
                return forbidden_reason(ip, own)

        usable: list[IPAddress] = []
        refused: list[str] = []
        for ip in addresses:
            reason = check(ip)
            if reason is None:
                usable.append(ip)
            else:
                refused.append(reason)
        if not usable:
            why = refused[0] if refused else "no address"
            return None, Failure(
                False,
                f"resolves to a private/loopback address ({why})",
                403,
                "Forbidden",
                f"{BLOCKED}: {host} resolves to a private/loopback address ({why}); "
                "those are never reachable from a sandbox, whatever the allowlist says",
                "destination_ip_prohibited",
            )
        deadline = time.monotonic() + self.connect_timeout_s
        last = "no address could be tried"
        for ip in usable[:_MAX_ADDRESSES_TRIED]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                return await asyncio.wait_for(_connect_ip(ip, port), remaining), None
            except TimeoutError:
                last = "timed out"
            except OSError as exc:
                last = os_reason(exc)
        return None, Failure(
            True,
            f"connect failed: {last}",
            502,
            "Bad Gateway",
            f"could not connect to {host} port {port}: {last}",
            "destination_unavailable",
        )

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        if self._resolver is not None:
            found = await asyncio.wait_for(self._resolver(host, port), self.resolve_timeout_s)
        else:
            found = await asyncio.wait_for(_getaddrinfo(host, port, self._resolving), self.resolve_timeout_s)
        unique: list[IPAddress] = []
        for ip in found:
            if ip not in unique:
                unique.append(ip)
        return unique


async def _getaddrinfo(host: str, port: int, slots: asyncio.Semaphore) -> list[IPAddress]:
    """getaddrinfo in the lookup pool. The slot is held until the lookup really ends, not until the
    caller stops waiting: a timed-out lookup still occupies a thread, and counts against its proxy."""
    await slots.acquire()
    future = asyncio.get_running_loop().run_in_executor(
        _lookups, lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    )

    def done(f: asyncio.Future[Any]) -> None:
        slots.release()
        if not f.cancelled():
            f.exception()  # retrieved, so a lookup nobody waits for any more is not logged as lost

    future.add_done_callback(done)
    infos = await asyncio.shield(future)
    out: list[IPAddress] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            out.append(ipaddress.ip_address(sockaddr[0]))
    return out


async def _connect_ip(ip: IPAddress, port: int) -> socket.socket:
    """A TCP connection to exactly this address (a socket we made, so no name is ever looked up),
    non-blocking and close-on-exec like every socket Python makes."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (str(ip), port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except BaseException:
        sock.close()
        raise
