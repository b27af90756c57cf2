"""Running the server on a transport, with the SessionManager living exactly as long as the process."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

from coderunner.config import ConfigError, Settings
from coderunner.edge.auth import RequireToken, policy_for
from coderunner.edge.http_limits import ConnectionLimits, bounded_protocol
from coderunner.edge.listener import bind_listener
from coderunner.edge.stdio_wire import claim_stdio, wire_streams
from coderunner.sandbox import make_backend
from coderunner.server import build_server
from coderunner.sessions import SHUTDOWN_TIMEOUT_S, SessionManager

log = logging.getLogger(__name__)

HTTP_SHUTDOWN_GRACE_S = 5
#: stdio: after stdin closes, the calls already read may take their longest timeout plus this to answer.
STDIO_DRAIN_MARGIN_S = 60


async def serve(settings: Settings) -> None:
    # Refuse an unsafe bind, and a port that cannot be had, before any sandbox exists.
    policy = policy_for(settings) if settings.transport != "stdio" else None
    async with contextlib.AsyncExitStack() as stack:
        listener = (
            None
            if settings.transport == "stdio"
            else stack.enter_context(contextlib.closing(bind_listener(settings.host, settings.port)))
        )
        with _stdout_held(settings.transport == "stdio"):
            manager = await stack.enter_async_context(_session_host(settings))
            server = build_server(manager)
        if settings.transport == "stdio":
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stop_on_signals, manager)
                tg.start_soon(_print_to_log)  # runs once the channel is claimed (no claim has an await)
                await _serve_stdio(server, drain_s=settings.max_timeout_s + STDIO_DRAIN_MARGIN_S)
                _divert_stdout()  # the channel is done; what is printed while sessions close goes to the log
                tg.cancel_scope.cancel()
            # The client closed stdin; the sessions close next, on leaving this block. A client then
            # escalates (SIGTERM after ~2 s, SIGKILL ~2 s later): a SIGTERM now only notes itself, so
            # that the close runs on until the kill instead of ending at once (the default action).
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, _note_signal)
            return
        assert policy is not None and listener is not None
        # Host and Origin are checked once, for every path, by RequireToken below.
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
        if settings.transport == "sse":
            app = server.sse_app(host=settings.host, transport_security=security)
            path = "/sse"
        else:
            app = server.streamable_http_app(host=settings.host, transport_security=security)
            path = "/mcp"
        log.info(
            "serving MCP over %s at http://%s:%d%s; clients need the bearer token (%s)",
            settings.transport,
            settings.host,
            listener.getsockname()[1],  # the port bound (port 0: the one the system chose)
            path,
            "as configured" if settings.token else f"in {settings.token_file}; `coderunner token` prints it",
        )
        config = uvicorn.Config(
            RequireToken(app, policy),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            lifespan="on",
            # Anyone who can reach the port can open connections before any token check: bound them.
            http=bounded_protocol(ConnectionLimits(settings.http_max_connections, settings.http_head_timeout_s)),
            timeout_keep_alive=settings.http_idle_timeout_s,  # type: ignore[arg-type]  # uvicorn takes a float too
            # Open SSE streams would otherwise hold a SIGTERM'd server forever.
            timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE_S,
        )
        # uvicorn handles SIGINT/SIGTERM itself and, once stopped, re-raises the signal to the
        # handler it found. Make that handler ours, so the process lives on long enough for the
        # SessionManager to close every session on its way out.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _note_signal)
        await uvicorn.Server(config).serve(sockets=[listener])


async def _serve_stdio(server: MCPServer, drain_s: float) -> None:
    """MCP over stdin/stdout: read and written on the loop when they are pipes (edge/stdio_wire.py), else
    by the SDK's transport (a worker thread per line). mcp 2.3 has no public way to give its stdio run
    other streams, hence the guarded private access. `drain_s`: how long the requests read before stdin
    closed may take to be answered."""
    lowlevel = getattr(server, "_lowlevel_server", None)
    if lowlevel is None:
        await server.run_stdio_async()
        return
    async with claim_stdio() as wire:
        if wire is None:
            await server.run_stdio_async()
            return
        reader, writer = wire
        async with wire_streams(reader, writer, drain_s) as (read_stream, write_stream):
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


@contextlib.contextmanager
def _stdout_held(held: bool) -> Iterator[None]:
    """stdio: until the SDK serves the MCP channel (and points fd 1 at stderr itself), fd 1 is stderr.

    Anything printed while the sessions' host starts (Ray prints its cluster's notices to stdout)
    then lands in the log instead of reaching the client as a broken message. The channel is given
    back just before run_stdio_async claims it, with no await in between.
    """
    if not held:
        yield
        return
    wire = os.dup(1)
    _divert_stdout()
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(wire, 1)
        os.close(wire)


async def _print_to_log() -> None:
    """stdio: Python's own prints (Ray's notices among them) go to stderr, whatever fd 1 is."""
    sys.stdout = sys.stderr


def _divert_stdout() -> None:
    """Point fd 1 at stderr (what was printed before goes first)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os.dup2(2, 1)


def _session_host(settings: Settings) -> contextlib.AbstractAsyncContextManager[Any]:
    """Where sessions live: this machine, or (cluster mode, `--ray`) a Ray cluster's nodes."""
    if settings.ray_address:
        try:
            from coderunner.cluster.host import ClusterHost
        except ImportError as exc:
            raise ConfigError(
                f"cluster mode needs Ray, which is not installed here ({exc}): pip install 'coderunner[ray]'"
            ) from None
        return ClusterHost(settings)
    return SessionManager(settings, make_backend(settings))


async def _stop_on_signals(manager: Any) -> None:
    """stdio: on SIGTERM/SIGINT/SIGHUP close every session (bounded), then leave at once.

    The SDK reads stdin in a worker thread that no cancellation reaches, so a graceful unwind
    would wait for the client to close stdin; the sessions are what must not be left behind.
    """
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: closing sessions", signal.Signals(signum).name)
            with anyio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
                await manager.close_all()
            logging.shutdown()
            os._exit(0)


def _note_signal(signum: int, _frame: object) -> None:
    log.info("received %s: closing sessions", signal.Signals(signum).name)
