"""EgressProxy: one session's HTTP proxy on a unix socket, deciding by name and checking addresses.

Its clients come over the unix socket: each connection is either the client itself (a byte stream),
or carries the client's own TCP socket from inside the sandbox (handoff.py: the forwarder hands it
over, so nothing relays bytes inside the sandbox). Both are served by the same code from there on.

Handles `CONNECT host:port` (then relays bytes both ways; TLS is never intercepted) and absolute-form
requests such as `GET http://host/path` (forwarded in origin form with hop-by-hop headers stripped and
`Connection: close`: one request per client connection, which every HTTP client handles). The request
head is parsed here, bounded in bytes and time; everything malformed gets a 400.

For an allowed name the proxy resolves it itself (bounded), drops every address `address_check`
refuses (loopback, private, link-local, the host's own: addresses.py) and connects to a checked
address only, never to a name. A name outside the session's policy but inside the user's ceiling is
put to `asker` (the user, via MCP elicitation, wired elsewhere); a yes widens the session's policy.

Every decision is recorded in the session's DecisionLog. Caps: concurrent connections (503 over),
head timeout (slowloris), idle timeout on every relay, connect and resolve timeouts. Here: deciding
and asking; reaching the server is upstream.py, a connection's bytes wire.py and relay.py.

One idea: one proxied connection from request to relay: parse, decide by name, connect to a checked address,
relay within bounds, record the decision.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coderunner.egress.audit import Decision, DecisionLog
from coderunner.egress.handoff import Client, HandoffRefused, receive_client
from coderunner.egress.relay import ByteCounts, relay
from coderunner.egress.request import BadRequest, parse_request
from coderunner.egress.upstream import AddressCheck, Resolver, UpstreamOpener
from coderunner.egress.wire import BLOCKED, HeadTooLarge, KiB, answer, end, read_head, send_all
from coderunner.policy.egress import CEILING_SETTING, EgressPolicy, EgressPolicyError

log = logging.getLogger(__name__)

#: Asked about a host:port outside the session's policy but inside the ceiling; True allows that
#: host for the rest of the session, False or None (nobody answered) does not. The proxy bounds the
#: wait (ASK_TIMEOUT_S).
Asker = Callable[[str, int], Awaitable[bool | None]]

#: Bound on the wait for the user's answer to an Asker; questions one session may put to the user (past
#: it, hosts outside the policy are denied unasked).
ASK_TIMEOUT_S, MAX_ASKS = 60.0, 10


@dataclass(frozen=True)
class ProxyLimits:
    """Per-proxy (per-session) bounds on what a client inside the sandbox can make the host hold."""

    max_connections: int = 64
    idle_s: float = 60.0
    head_timeout_s: float = 10.0
    max_head_bytes: int = 16 * KiB
    connect_timeout_s: float = 10.0
    resolve_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"ProxyLimits.{name} must be positive, not {value!r}")


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
        outside = [h for h in policy.hosts if not ceiling.covers(h)]
        if outside or not policy.ports <= ceiling.ports:
            raise EgressPolicyError(
                f"a session's network allowlist must lie inside the user's (allowed: {ceiling.describe()}); "
                f"outside it: {', '.join(outside) or 'ports ' + str(sorted(policy.ports - ceiling.ports))}. "
                f"The user can widen it with {CEILING_SETTING}."
            )
        self._policy = policy
        self._ceiling = ceiling
        self.session_id = session_id
        self.log = log
        self.limits = limits
        self._asker = asker
        self._upstream = UpstreamOpener(resolve_timeout_s=limits.resolve_timeout_s,
                                        connect_timeout_s=limits.connect_timeout_s, resolver=resolver,
                                        address_check=address_check)  # fmt: skip
        self._conns: dict[asyncio.Task[None], _Conn] = {}
        self._asks: dict[tuple[str, int], asyncio.Future[bool]] = {}
        self._declined: set[str] = set()
        self._ask_lock = asyncio.Lock()
        self._asks_made = 0
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusing = 0
        #: Connections answered 503 because the proxy was full (for status and tests).
        self.refused_busy = 0
        #: Client sockets the sandbox handed over, and handoffs refused (a bad fd, none, or several).
        self.handoffs = 0
        self.refused_handoffs = 0

    @property
    def policy(self) -> EgressPolicy:
        """The session's current policy (it grows when the user allows a host)."""
        return self._policy

    @property
    def declined(self) -> frozenset[str]:
        """Hosts the user declined for this session (not asked about again)."""
        return frozenset(self._declined)

    def restore(self, allowed: tuple[str, ...], declined: tuple[str, ...]) -> list[str]:
        """A session's decisions carried over from the proxy it had before (its server died: sessions/adoption.py):
        each allowed host added as `allow` adds it (never past the ceiling), each declined one not asked again.
        The allowed hosts the ceiling no longer covers, which are left out."""
        refused = []
        for host in allowed:
            if host in self._policy.hosts:  # the session's own list (its wildcards too): there already
                continue
            try:
                self.allow(host)
            except EgressPolicyError:
                refused.append(host)
        self._declined.update(declined)
        return refused

    @property
    def ceiling(self) -> EgressPolicy:
        """The user's allowlist: the policy can grow up to it, never beyond."""
        return self._ceiling

    @property
    def asker(self) -> Asker | None:
        """Who is asked about hosts inside the ceiling but outside the policy; None: nobody.

        Settable at any time (the client that can answer changes from call to call). A host the
        user declined stays declined for the session, whoever asks next.
        """
        return self._asker

    @asker.setter
    def asker(self, asker: Asker | None) -> None:
        self._asker = asker

    @property
    def active_connections(self) -> int:
        """Client connections being served now."""
        return len(self._conns)

    def open_connections(self) -> list[Decision]:
        """Relays in progress, as decisions with the bytes moved so far (reason "open"): a long
        download shows in manage_sessions status before it ends and is recorded."""
        return [
            Decision(c.decided_at, c.host, c.port, True, "open", c.counts.sent, c.counts.received)
            for c in self._conns.values()
            if c.counts is not None
        ]

    def allow(self, host: str) -> None:
        """Widen the session's policy to one more host; EgressPolicyError if the ceiling does not cover it."""
        widened = self._policy.with_host(host)
        added = [h for h in widened.hosts if h not in self._policy.hosts]
        if added and not self._ceiling.covers(added[0]):
            raise EgressPolicyError(
                f"`{added[0]}` is outside the network allowlist the user set (allowed: "
                f"{self._ceiling.describe()}); the user can widen it with {CEILING_SETTING}."
            )
        self._policy = widened
        self._declined.difference_update(added)

    async def serve(self, listener: socket.socket) -> None:
        """Serve connections on a bound, listening unix stream socket until cancelled.

        The caller made (and owns) the socket; cancelling serve stops accepting, and the connections
        in flight are closed too.
        """
        own = listener.dup()
        # Listen again with a deep queue: a flood past the backlog would make clients' connects fail
        # oddly instead of being answered 503.
        own.listen(_BACKLOG)
        own.setblocking(False)
        loop = asyncio.get_running_loop()
        retry: list[asyncio.TimerHandle] = []

        def accept_ready() -> None:
            # Accepted in the loop's callback, not by an awaiting task: one loop turn less per connection.
            for _ in range(_ACCEPT_BATCH):
                try:
                    conn, _ = own.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:  # out of fds, for one: pause a little, never spin or stop serving
                    log.warning("egress proxy for session %s: accept failed: %s", self.session_id, exc)
                    loop.remove_reader(own.fileno())
                    retry[:] = [loop.call_later(_ACCEPT_RETRY_S, loop.add_reader, own.fileno(), accept_ready)]
                    return
                conn.setblocking(False)
                task = loop.create_task(self._accepted(conn))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        loop.add_reader(own.fileno(), accept_ready)
        try:
            await loop.create_future()  # until cancelled
        finally:
            for handle in retry:
                handle.cancel()
            loop.remove_reader(own.fileno())
            own.close()
            await self.aclose()

    async def aclose(self) -> None:
        """Close every connection this proxy is serving (the listener stays the caller's)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)
        for future in self._asks.values():
            future.cancel()

    # One client connection.

    async def _accepted(self, conn: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closed:
            conn.close()
            return
        if len(self._conns) >= self.limits.max_connections and not self._evict_stalled_head():
            await self._refuse_busy(conn)
            return
        state = _Conn(started=time.monotonic(), conn=conn)
        self._conns[task] = state
        try:
            await self._serve_one(state)
        except (OSError, TimeoutError) as exc:
            # The client went away or stopped reading, or broke the socket it handed over (the
            # sandbox keeps a copy and may do anything with it): nothing to answer, nothing to log loudly.
            log.debug("egress proxy for session %s: a connection ended: %r", self.session_id, exc)
        except HandoffRefused as exc:
            self.refused_handoffs += 1
            log.debug("egress proxy for session %s: refused a handoff: %s", self.session_id, exc)
        except asyncio.CancelledError:
            # aclose or an eviction. This task is a leaf made for the connection; ending it quietly
            # keeps asyncio from logging every closed tunnel as an error.
            pass
        except Exception:
            log.exception("egress proxy for session %s: a connection failed", self.session_id)
        finally:
            self._conns.pop(task, None)
            if state.client is not None:
                end(state.client.sock)
            conn.close()

    async def _refuse_busy(self, conn: socket.socket) -> None:
        """503 to a client over the cap, on its own socket if it hands one over; bounded in count and time."""
        self.refused_busy += 1
        if self._refusing >= self.limits.max_connections:
            conn.close()  # refusing politely is bounded too
            return
        self._refusing += 1
        client: Client | None = None
        try:
            client = await asyncio.wait_for(receive_client(conn), _BUSY_FIRST_BYTE_S)
            body = f"too many connections through this session's proxy (at most {self.limits.max_connections})"
            await answer(client.sock, 503, "Service Unavailable", body, status="proxy_internal_error")
        except (OSError, TimeoutError, HandoffRefused):
            pass
        finally:
            self._refusing -= 1
            if client is not None:
                end(client.sock)
            conn.close()

    def _evict_stalled_head(self) -> bool:
        """Free a slot held by a client that has not finished its request head for a while (slowloris)."""
        now = time.monotonic()
        stalled = [
            (conn.started, task)
            for task, conn in self._conns.items()
            if conn.in_head and now - conn.started >= min(_STALLED_HEAD_S, self.limits.head_timeout_s)
        ]
        if not stalled:
            return False
        _, task = min(stalled, key=lambda item: item[0])
        self._conns.pop(task)
        task.cancel()  # its own cleanup closes its sockets
        return True

    async def _read_request(self, conn: _Conn) -> tuple[bytes | None, bytes]:
        conn.client = await receive_client(conn.conn)
        self.handoffs += conn.client.handed_over
        return await read_head(conn.client.sock, self.limits.max_head_bytes, conn.client.prefix)

    async def _serve_one(self, conn: _Conn) -> None:
        try:
            async with asyncio.timeout(self.limits.head_timeout_s):  # no task of its own, unlike wait_for
                head, rest = await self._read_request(conn)
        except TimeoutError:
            client = conn.client.sock if conn.client is not None else conn.conn
            await answer(client, 408, "Request Timeout", "the request head did not arrive in time")
            return
        except HeadTooLarge:
            assert conn.client is not None
            body = f"bad proxy request: the request head is larger than {self.limits.max_head_bytes} bytes"
            await answer(conn.client.sock, 400, "Bad Request", body, status="http_request_error")
            return
        assert conn.client is not None
        client = conn.client.sock
        if head is None:
            return  # closed before a full head: nothing to answer
        conn.in_head = False
        try:
            request = parse_request(head)
        except BadRequest as exc:
            await answer(client, 400, "Bad Request", f"bad proxy request: {exc}", status="http_request_error")
            return
        started = time.time()
        denial = await self._decide(request.host, request.port)
        if denial is not None:
            self.log.record(Decision(started, request.host, request.port, False, denial.reason))
            await answer(client, 403, "Forbidden", denial.body, status=denial.status)
            return
        upstream, failure = await self._upstream.open(request.host, request.port)
        if upstream is None:
            assert failure is not None
            self.log.record(Decision(started, request.host, request.port, failure.allowed, failure.reason))
            await answer(client, failure.code, failure.phrase, failure.body, status=failure.status)
            return
        counts = ByteCounts()
        conn.host, conn.port, conn.decided_at, conn.counts = request.host, request.port, started, counts
        try:
            async with asyncio.timeout(self.limits.idle_s):
                if request.kind == "connect":
                    await send_all(client, _ESTABLISHED)
                first = (b"" if request.kind == "connect" else request.forward_head()) + rest
                if first:
                    await send_all(upstream, first)
                    counts.sent += len(first)
            await relay(client, upstream, counts, self.limits.idle_s)
        finally:
            end(upstream)
            self.log.record(
                Decision(started, request.host, request.port, True, "allowed", counts.sent, counts.received)
            )

    # Decisions.

    async def _decide(self, host: str, port: int) -> _Denial | None:
        if self._policy.allows(host, port):
            return None
        shown = f"[{host}]" if ":" in host else host
        allowed = self._policy.describe()
        if port not in self._policy.ports:
            return _Denial(
                f"port {port} is not allowed",
                f"{BLOCKED}: port {port} of {shown} is not in this session's allowlist (allowed: {allowed})",
            )
        ask_for = f'create a session with allow=["{self._ceiling.entry_for(host)}"]'
        if self._asker is not None and self._ceiling.allows(host, port):
            if host not in self._declined and self._asks_made < MAX_ASKS and await self._ask(host, port):
                return None
            why = (
                "The user declined it for this session."
                if host in self._declined
                else f"The user was not asked; {ask_for} to reach it."
            )
            return _Denial(
                "declined by the user" if host in self._declined else "not asked",
                f"{BLOCKED}: {shown} is not in this session's allowlist (allowed: {allowed})\n{why}",
            )
        hint = ask_for if self._ceiling.allows(host, port) else f"the user can allow it with {CEILING_SETTING}"
        return _Denial(
            "not in the allowlist",
            f"{BLOCKED}: {shown} is not in this session's allowlist (allowed: {allowed})\nTo reach it, {hint}.",
        )

    async def _ask(self, host: str, port: int) -> bool:
        """Put one host to the user; concurrent connections to it share the question. Bounded."""
        key = (host, port)
        future = self._asks.get(key)
        if future is None:
            future = asyncio.ensure_future(self._ask_user(host, port))
            self._asks[key] = future
            future.add_done_callback(lambda _f: self._asks.pop(key, None))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():
                return False
            raise

    async def _ask_user(self, host: str, port: int) -> bool:
        """One question at a time, and at most MAX_ASKS per session: code in the sandbox picks the
        names, and must not be able to bury the user in prompts."""
        assert self._asker is not None
        try:
            await asyncio.wait_for(self._ask_lock.acquire(), ASK_TIMEOUT_S)
        except TimeoutError:
            return False
        try:
            if self._policy.allows(host, port):
                return True  # allowed while this question waited its turn
            if host in self._declined or self._asks_made >= MAX_ASKS:
                return False
            self._asks_made += 1
            try:
                yes = bool(await asyncio.wait_for(self._asker(host, port), ASK_TIMEOUT_S))
            except TimeoutError:
                yes = False
            except Exception as exc:  # the asker is the wiring's code: its failure is a "no", never a crash
                log.warning("egress proxy for session %s: asking about %s failed: %r", self.session_id, host, exc)
                yes = False
        finally:
            self._ask_lock.release()
        if not yes:
            self._declined.add(host)
            return False
        if not self._policy.allows(host, port):
            try:
                self.allow(host)
            except EgressPolicyError:
                return False
        return True


_CLOSE_WAIT_S = 5.0
_BACKLOG = 1024
_STALLED_HEAD_S = 1.0
_ACCEPT_RETRY_S = 0.1
_ACCEPT_BATCH = 64
#: How long a client over the cap may take to show its first byte (or hand its socket over) for a 503.
_BUSY_FIRST_BYTE_S = 1.0
_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


@dataclass
class _Conn:
    started: float
    #: The accepted unix connection; `client` once its first byte said who the client is.
    conn: socket.socket
    client: Client | None = None
    in_head: bool = True
    host: str = ""
    port: int = 0
    decided_at: float = 0.0
    counts: ByteCounts | None = None


@dataclass(frozen=True)
class _Denial:
    reason: str
    body: str
    status: str = "http_request_denied"
