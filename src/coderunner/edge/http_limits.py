"""Bounds on HTTP connections and request heads, which anyone who can reach the port may send before any token check.

uvicorn closes an idle keep-alive connection (timeout_keep_alive), but a connection that has not
yet sent a complete request head waits forever, and it accepts connections without limit: a flood
of half-open connections fills the server's file descriptors. This protocol adds both bounds:

- a request-head timeout: a connection must deliver a complete request head within
  `head_timeout_s` of opening (and of each response on a kept-alive connection), or it is closed;
- a connection cap: over `max_connections`, the oldest connection that is still waiting for its
  request head is closed to make room (it is the cheapest to lose, and a flood is made of them);
  if every connection is busy with a request, the new one is closed at once. Nothing is queued.

And one of each: a request that repeats a header or query parameter which decides who it is or
where it goes (SINGLE_HEADERS, SINGLE_PARAMS) is refused with 400 before anything reads it
(auth.RequireToken asks `repeated_field` first). Readers disagree on which copy counts: Starlette's
`headers.get` takes the first, its `query_params.get` the last, a regex the first literal match.
A check reading one copy while the SDK routes on another is how a token reached another token's
MCP session; with one copy there is nothing to disagree about.

The protocol also turns Nagle off on each connection (`no_delay`): a response goes out as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

#: Request headers (lower case) that name the caller or pick where a request goes: the bearer
#: token (auth.py), Host and Origin (the DNS-rebinding check), the MCP session (session_binding.py,
#: callers.py, the SDK), the client name (callers.CLIENT_HEADER, owners.py), the protocol
#: version (the SDK's choice of transport era) and Last-Event-ID (the SDK's stream replay).
SINGLE_HEADERS = frozenset(
    {
        b"authorization",
        b"host",
        b"origin",
        b"mcp-session-id",
        b"x-coderunner-client",
        b"mcp-protocol-version",
        b"last-event-id",
    }
)
#: Query parameters, by name as the SDK decodes it (`session%5Fid` is `session_id`): legacy SSE's session.
SINGLE_PARAMS = frozenset({"session_id"})


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    head_timeout_s: float


@dataclass
class ConnectionGate:
    """What all connections of one server share: which of them are waiting for a request head, oldest first."""

    limits: ConnectionLimits
    waiting: OrderedDict[BoundedH11Protocol, None] = field(default_factory=OrderedDict)
    #: Connections closed by the cap or the head timeout (for logs and tests).
    refused: int = 0
    timed_out: int = 0


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout and a connection cap (see the module doc).

    A connection is "waiting" from its opening, and again after each response, until a request
    head has arrived. The head timer runs from the opening, and on a kept-alive connection from
    the first byte of the next request (before that, uvicorn's keep-alive timeout applies).
    """

    gate: ConnectionGate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_since_cycle: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's protocol takes the concrete Transport
        no_delay(transport)
        super().connection_made(transport)
        self._start_waiting(timed=True)
        if len(self.connections) > self.gate.limits.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        waiting = self in self.gate.waiting
        if waiting and self._head_timer is None and data:
            self._arm_head_timer()  # a kept-alive connection starts its next request
        super().data_received(data)
        if waiting and self.cycle is not self._waiting_since_cycle:
            self._stop_waiting()  # h11 parsed a complete request head: a new cycle began

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._start_waiting(timed=False)  # no pipelined request started

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._stop_waiting()  # the connection now belongs to the websocket protocol
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _start_waiting(self, *, timed: bool) -> None:
        self._stop_waiting()
        self._waiting_since_cycle = self.cycle
        self.gate.waiting[self] = None
        if timed:
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.gate.limits.head_timeout_s, self._head_timed_out)

    def _stop_waiting(self) -> None:
        self.gate.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self in self.gate.waiting:
            self.gate.timed_out += 1
            self._drop()

    def _make_room(self) -> None:
        oldest = next((protocol for protocol in self.gate.waiting if protocol is not self), self)
        self.gate.refused += 1
        oldest._drop()

    def _drop(self) -> None:
        """Close without a reply: nothing was asked yet, and the peer may never read one."""
        self._stop_waiting()
        self.connections.discard(self)
        if not self.transport.is_closing():
            self.transport.abort()


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Send each response write at once (TCP_NODELAY).

    asyncio sets it only on sockets whose protocol number says TCP, and a listener made as
    socket(AF_INET, SOCK_STREAM) (edge/listener.py) says 0: Nagle then held a response's later writes
    until the client's delayed ACK, about 40 ms on Linux, on every request of a kept-alive connection.
    """
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a connection already reset: nothing to send on
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """A protocol class for uvicorn.Config(http=...), with its own gate (one per server)."""
    return type("BoundedH11", (BoundedH11Protocol,), {"gate": ConnectionGate(limits)})


def repeated_field(scope: Scope) -> str | None:
    """The first header or query parameter of SINGLE_HEADERS / SINGLE_PARAMS this request repeats."""
    # Only the deciding names are counted (every request passes here: no tally of all its headers).
    headers = Counter(lower for name, _ in scope.get("headers", []) if (lower := name.lower()) in SINGLE_HEADERS)
    if len(headers) < sum(headers.values()):
        for name in sorted(SINGLE_HEADERS):
            if headers[name] > 1:
                return f"header {name.decode()}"
    query = scope.get("query_string", b"")
    if not query:
        return None
    # Decoded exactly as Starlette's QueryParams does, which is what the SDK reads.
    params = Counter(name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True))
    for param in sorted(SINGLE_PARAMS):
        if params[param] > 1:
            return f"query parameter {param}"
    return None


async def refuse_repeated(field_name: str, send: Send) -> None:
    """400, plain text: the request is ambiguous, and nothing has acted on it."""
    body = f"bad request: {field_name} appears more than once; send it once\n".encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
