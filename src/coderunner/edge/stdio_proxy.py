"""`coderunner proxy`: a stdio MCP server that forwards to a CodeRunner server over HTTP.

For clients that can only launch a command (Claude Desktop and others) but should share one
long-running server. The proxy is an MCP server on stdio (the SDK's) whose handlers call the
upstream server through the SDK's client, so progress notifications and cancellation travel
as the protocol defines them, whichever protocol version each side speaks.

A lost connection is re-opened on the next request; a request that certainly never ran
(connection refused, or the server no longer knows the MCP session after a restart) is sent
again once on the new connection. Errors say what is wrong (server down, token refused)
instead of a bare stack trace, as tool results the user sees in the client.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import anyio
import httpx2
from anyio.abc import TaskGroup
from mcp import Client, MCPError, stdio_server
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.types import (
    INTERNAL_ERROR,
    CallToolRequestParams,
    CallToolResult,
    ListResourcesResult,
    ListResourceTemplatesResult,
    ListToolsResult,
    PaginatedRequestParams,
    ReadResourceRequestParams,
    ReadResourceResult,
    TextContent,
)

from coderunner import __version__
from coderunner.edge.auth import HEALTH_PATH
from coderunner.edge.callers import CLIENT_HEADER
from coderunner.edge.instructions import INSTRUCTIONS
from coderunner.errors import CodeRunnerError

log = logging.getLogger(__name__)

UpstreamTransport = Literal["streamable-http", "sse"]
#: Bound on reaching the server and finishing the MCP handshake.
CONNECT_TIMEOUT_S = 15.0
#: Bound on one forwarded call: the server's own largest run timeout (3600 s) plus margin.
CALL_TIMEOUT_S = 3900.0
#: Bound on list and read requests.
REQUEST_TIMEOUT_S = 120.0

T = TypeVar("T")


class ProxyError(CodeRunnerError):
    """The upstream server cannot be used; the message says why and what to do."""


class RequestNeverRan(ProxyError):
    """The request was certainly not executed upstream, so sending it again is safe."""


def guess_transport(url: str) -> UpstreamTransport:
    return "sse" if urlsplit(url).path.rstrip("/").endswith("/sse") else "streamable-http"


@dataclass
class Upstream:
    """One connection at a time to the server, opened on demand and re-opened after a failure."""

    url: str
    token: str | None
    transport: UpstreamTransport
    task_group: TaskGroup
    #: Names this proxy to the server, so its calls share one default session across reconnects.
    client_id: str = field(default_factory=lambda: "proxy-" + secrets.token_urlsafe(12))
    _client: Client | None = None
    _closed: anyio.Event | None = None
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def headers(self) -> dict[str, str]:
        headers = {CLIENT_HEADER: self.client_id}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def client(self) -> Client:
        async with self._lock:
            if self._client is None:
                await self._connect()
            assert self._client is not None
            return self._client

    def drop(self, client: Client) -> None:
        """Forget a connection that failed; the next request opens a new one."""
        if self._client is client:
            self._client = None
            if self._closed is not None:
                self._closed.set()

    async def close(self) -> None:
        if self._client is not None:
            self.drop(self._client)

    async def _connect(self) -> None:
        try:
            with anyio.fail_after(CONNECT_TIMEOUT_S):
                await self.preflight()
        except TimeoutError:
            raise RequestNeverRan(f"the server at {self.url} did not answer within {CONNECT_TIMEOUT_S:g}s") from None
        ready = anyio.Event()
        closed = anyio.Event()
        failure: list[BaseException] = []

        async def keep_open() -> None:
            """Own the client's context in one task for as long as the connection is used."""
            try:
                async with self._open() as client:
                    self._client, self._closed = client, closed
                    ready.set()
                    await closed.wait()
            except Exception as exc:
                failure.append(exc)
                log.info("connection to %s ended: %s", self.url, _describe(exc))
            finally:
                if self._closed is closed:  # this connection is over; the next request opens another
                    self._client = None
                ready.set()

        self.task_group.start_soon(keep_open)
        with anyio.move_on_after(CONNECT_TIMEOUT_S) as scope:
            await ready.wait()
        if scope.cancelled_caught or self._client is None:
            closed.set()
            detail = f": {_describe(failure[0])}" if failure else f" within {CONNECT_TIMEOUT_S:g}s"
            raise RequestNeverRan(f"could not open an MCP session with {self.url}{detail}")

    def _open(self) -> Client:
        if self.transport == "sse":
            transport = sse_client(self.url, headers=self.headers, timeout=CONNECT_TIMEOUT_S)
        else:
            http = httpx2.AsyncClient(headers=self.headers, timeout=httpx2.Timeout(CONNECT_TIMEOUT_S, read=None))
            transport = _owning(http, streamable_http_client(self.url, http_client=http))
        return Client(transport, read_timeout_seconds=CALL_TIMEOUT_S)

    async def preflight(self) -> None:
        """Tell 'not running' from 'wrong token' before the SDK turns either into a vague error."""
        parts = urlsplit(self.url)
        health = f"{parts.scheme}://{parts.netloc}{HEALTH_PATH}"
        async with httpx2.AsyncClient(timeout=CONNECT_TIMEOUT_S) as http:
            try:
                await http.get(health)
            except httpx2.TransportError as exc:
                raise RequestNeverRan(
                    f"cannot reach the CodeRunner server at {self.url} ({_describe(exc)}): is "
                    "`coderunner serve --transport streamable-http` running there?"
                ) from None
            async with http.stream("GET", self.url, headers=self.headers) as response:
                status = response.status_code
        if status == 401:
            hint = "wrong token" if self.token else "no token given"
            raise RequestNeverRan(
                f"the server at {self.url} refused the request ({hint}): pass its token with --token or "
                "CODERUNNER_TOKEN (`coderunner token` on the server's machine prints it)"
            )
        if status in (403, 421):
            raise RequestNeverRan(
                f"the server at {self.url} refused this address or origin ({status}): add the host name to "
                "its allowed_hosts setting"
            )
        if status == 404:
            raise RequestNeverRan(f"no MCP endpoint at {self.url}: streamable HTTP is at /mcp, legacy SSE at /sse")


@contextlib.asynccontextmanager
async def _owning(http: httpx2.AsyncClient, transport: Any) -> AsyncIterator[Any]:
    """The transport, with the HTTP client it was given closed afterwards."""
    async with http, transport as streams:
        yield streams


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _never_ran(exc: BaseException) -> bool:
    """Errors after which the upstream certainly did not run the request."""
    if isinstance(exc, RequestNeverRan | httpx2.ConnectError):
        return True
    return isinstance(exc, MCPError) and "session terminated" in str(exc).lower()


def _connection_broken(exc: BaseException) -> bool:
    return isinstance(exc, httpx2.TransportError | anyio.BrokenResourceError | anyio.ClosedResourceError) or (
        _never_ran(exc)
    )


def build_proxy(upstream: Upstream) -> Server[Any]:
    """A stdio-facing server whose every handler is a call on the upstream client."""

    async def forward(call: Callable[[Client], Awaitable[T]]) -> T:
        for attempt in (1, 2):
            client = await upstream.client()
            try:
                return await call(client)
            except Exception as exc:
                if not _connection_broken(exc):
                    raise
                upstream.drop(client)
                if attempt == 2 or not _never_ran(exc):
                    raise ProxyError(
                        f"the connection to {upstream.url} was lost during this request ({_describe(exc)}); "
                        "it may or may not have run. The next request reconnects."
                    ) from None
                log.info("reconnecting to %s after: %s", upstream.url, _describe(exc))
        raise AssertionError("unreachable")

    async def list_tools(ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None) -> ListToolsResult:
        cursor = params.cursor if params else None
        return await _or_mcp_error(forward(lambda c: _bounded(c.list_tools(cursor=cursor))))

    async def call_tool(ctx: ServerRequestContext[Any], params: CallToolRequestParams) -> CallToolResult:
        async def relay_progress(progress: float, total: float | None, message: str | None) -> None:
            await ctx.session.report_progress(progress, total, message)

        try:
            return await forward(lambda c: c.call_tool(params.name, params.arguments, progress_callback=relay_progress))
        except (ProxyError, MCPError) as exc:
            return CallToolResult(content=[TextContent(type="text", text=f"CodeRunner proxy: {exc}")], is_error=True)

    async def list_resources(
        ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None
    ) -> ListResourcesResult:
        cursor = params.cursor if params else None
        return await _or_mcp_error(forward(lambda c: _bounded(c.list_resources(cursor=cursor))))

    async def list_templates(
        ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None
    ) -> ListResourceTemplatesResult:
        cursor = params.cursor if params else None
        return await _or_mcp_error(forward(lambda c: _bounded(c.list_resource_templates(cursor=cursor))))

    async def read_resource(ctx: ServerRequestContext[Any], params: ReadResourceRequestParams) -> ReadResourceResult:
        return await _or_mcp_error(forward(lambda c: _bounded(c.read_resource(params.uri))))

    return Server(
        "coderunner-proxy",
        version=__version__,
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=read_resource,
    )


async def _bounded(request: Awaitable[T]) -> T:
    with anyio.fail_after(REQUEST_TIMEOUT_S):
        return await request


async def _or_mcp_error(request: Awaitable[T]) -> T:
    try:
        return await request
    except ProxyError as exc:
        raise MCPError(INTERNAL_ERROR, f"CodeRunner proxy: {exc}") from None
    except TimeoutError:
        raise MCPError(INTERNAL_ERROR, f"CodeRunner proxy: no answer within {REQUEST_TIMEOUT_S:g}s") from None


async def run_proxy(
    url: str, token: str | None, transport: UpstreamTransport | None = None, client_name: str | None = None
) -> None:
    """Serve stdio until the client closes it; never touches stdout except for MCP messages."""
    async with anyio.create_task_group() as tg:
        upstream = Upstream(url=url, token=token, transport=transport or guess_transport(url), task_group=tg)
        if client_name:
            upstream.client_id = client_name
        server = build_proxy(upstream)
        try:
            await upstream.client()  # connect early, so that a problem shows in the client's log at once
        except ProxyError as exc:  # the handlers say it again, to the user, until it is fixed
            log.warning("%s", exc)
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
        await upstream.close()
        tg.cancel_scope.cancel()
