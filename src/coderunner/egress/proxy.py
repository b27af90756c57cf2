"""EgressProxy: one session's HTTP proxy on a unix socket, deciding by name and checking addresses.

Handles `CONNECT host:port` (then relays bytes both ways; TLS is never intercepted) and absolute-form
requests such as `GET http://host/path` (forwarded in origin form with hop-by-hop headers stripped and
`Connection: close`: one request per client connection, which every HTTP client handles). The request
head is parsed here, bounded in bytes and time; everything malformed gets a 400.

For an allowed name the proxy resolves it itself (bounded), drops every address `address_check`
refuses (loopback, private, link-local, the host's own: addresses.py) and connects to a checked
address only, never to a name. A name outside the session's policy but inside the user's ceiling is
put to `asker` (the user, via MCP elicitation, wired elsewhere); a yes widens the session's policy.

Every decision is recorded in the session's DecisionLog. Caps: concurrent connections (503 over),
head timeout (slowloris), idle timeout on every relay, connect and resolve timeouts.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .addresses import IPAddress
from .audit import DecisionLog
from .policy import EgressPolicy

KiB = 1024

#: Resolves (host, port) to addresses. The default uses getaddrinfo in a worker thread.
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
#: Asked about a host:port outside the session's policy but inside the ceiling; True allows that
#: host for the rest of the session. The proxy bounds the wait (ASK_TIMEOUT_S).
Asker = Callable[[str, int], Awaitable[bool]]
#: Why an address must not be connected to, or None. The default is addresses.forbidden_reason with
#: the host's own addresses; tests inject a looser one to reach their 127.0.0.1 upstream.
AddressCheck = Callable[[IPAddress], "str | None"]

#: Bound on the wait for the user's answer to an Asker.
ASK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProxyLimits:
    """Per-proxy (per-session) bounds on what a client inside the sandbox can make the host hold."""

    max_connections: int = 64
    idle_s: float = 60.0
    head_timeout_s: float = 10.0
    max_head_bytes: int = 16 * KiB
    connect_timeout_s: float = 10.0
    resolve_timeout_s: float = 5.0


class EgressProxy:
    """One session's egress proxy. Serve it on a listening unix socket; close it with the session."""

    def __init__(
        self,
        policy: EgressPolicy,
        ceiling: EgressPolicy,
        *,
        session_id: str,
        log: DecisionLog,
        limits: ProxyLimits = ProxyLimits(),
        asker: Asker | None = None,
        resolver: Resolver | None = None,
        address_check: AddressCheck | None = None,
    ) -> None:
        raise NotImplementedError

    @property
    def policy(self) -> EgressPolicy:
        """The session's current policy (it grows when the user allows a host)."""
        raise NotImplementedError

    @property
    def active_connections(self) -> int:
        """Client connections being served now."""
        raise NotImplementedError

    def allow(self, host: str) -> None:
        """Widen the session's policy to one more host; EgressPolicyError if the ceiling does not cover it."""
        raise NotImplementedError

    async def serve(self, listener: socket.socket) -> None:
        """Serve connections on a bound, listening unix stream socket until cancelled.

        The caller made (and owns) the socket; cancelling serve stops accepting, and the connections
        in flight are closed too.
        """
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close every connection this proxy is serving (the listener stays the caller's)."""
        raise NotImplementedError
