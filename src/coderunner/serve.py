"""Running the server on a transport, with the SessionManager living exactly as long as the process.

The MCP side (the SDK, uvicorn, the tools: about 0.3 s of a start's imports) is imported where it is first used,
not here: over stdio a worker thread imports it once the session host has started (`_import_mcp_side`), so that
the kernel template's warm-up, a process of its own, runs beside those imports rather than after them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shlex
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus

from coderunner.config import ConfigError, Settings
from coderunner.edge.client_configs import APP_CLIENTS, LaunchCommand, snippet
from coderunner.edge.listener import open_listener
from coderunner.errors import CodeRunnerError
from coderunner.oneshot.host import OneShotHost
from coderunner.oneshot.local import LocalOneShots
from coderunner.sandbox import make_backend
from coderunner.sessions import SHUTDOWN_TIMEOUT_S, SessionManager

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

    from coderunner.edge.auth import AccessPolicy

log = logging.getLogger(__name__)

#: What `_import_mcp_side` imports: the modules the MCP server is built and served from.
MCP_SIDE = ("coderunner.server", "coderunner.edge.stdio_wire", "mcp.server.mcpserver")
#: Bound on waiting for those imports (seconds on a cold disk; a hung one says so instead of waiting for ever).
IMPORT_WAIT_S = 120.0

HTTP_SHUTDOWN_GRACE_S = 5
#: stdio: after stdin closes, the calls already read may take their longest timeout plus this to answer.
STDIO_DRAIN_MARGIN_S = 60


async def serve(settings: Settings, listener: socket.socket | None = None) -> None:
    """Serve `settings.transport` until the client or a signal ends it; `listener` is the HTTP socket
    already opened (cli.py opens it before loading this module, so a refusal comes at once)."""
    async with contextlib.AsyncExitStack() as stack:
        # Whatever stops the start, before the MCP channel opens, is one line on stderr (cli.main
        # prints a CodeRunnerError's message): a client shows its user only "Failed to connect".
        with _start_failures():
            policy: AccessPolicy | None = None
            if settings.transport == "stdio":
                # A client launched this process and may call a tool at once: the session host starts first, then the
                # MCP side is imported in a worker thread while the loop goes on starting the kernel template (a task of
                # the host's). A tool name that is no tool is refused once it is in (the session host closes on the way
                # out), still before the MCP channel opens.
                with _stdout_held(True):
                    manager = await stack.enter_async_context(_session_host(settings))
                    await _import_mcp_side()
                    from coderunner.server import build_server, offered_tools

                    offered_tools(settings)
                    server = build_server(manager, _oneshot_host(manager))
            else:
                from coderunner.edge.auth import policy_for
                from coderunner.server import build_server, offered_tools

                offered_tools(settings)  # a tool name that is no tool is refused before anything starts
                # Refuse an unsafe bind, and a port that cannot be had, before any sandbox exists.
                policy = policy_for(settings)
                listener = stack.enter_context(contextlib.closing(listener or open_listener(settings)))
                manager = await stack.enter_async_context(_session_host(settings))
                server = build_server(manager, _oneshot_host(manager))
        if settings.transport == "stdio":
            async with anyio.create_task_group() as tg:
                await tg.start(_stop_on_signals, manager)
                if _stdin_is_terminal():  # only now: the hint says Ctrl-C stops it, and now it does
                    print(terminal_hint(), file=sys.stderr, flush=True)
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
        await _serve_http(server, settings, policy, listener)


async def _import_mcp_side() -> None:
    """Import MCP_SIDE in a worker thread while the loop goes on (see the module docstring); bounded."""
    try:
        with anyio.fail_after(IMPORT_WAIT_S):
            await anyio.to_thread.run_sync(_import_all, MCP_SIDE, abandon_on_cancel=True)
    except TimeoutError:
        raise StartError(f"the server's own modules did not load in {IMPORT_WAIT_S:.0f} s") from None


def _import_all(names: tuple[str, ...]) -> None:
    for name in names:
        importlib.import_module(name)


async def _serve_http(server: MCPServer, settings: Settings, policy: AccessPolicy, listener: socket.socket) -> None:
    """MCP over Streamable HTTP or SSE on `listener`, every request through the token check, until a signal."""
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings

    from coderunner.edge.auth import RequireToken
    from coderunner.edge.http_limits import ConnectionLimits, bounded_protocol
    from coderunner.edge.refusals import TokenCut

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
        # uvicorn's own logging config prints its access log on stdout; left unset, its lines go
        # where every other log line goes (stderr), in the same format. A line per request only at
        # DEBUG (refused ones have their own line, refusals.py), and never with the server's token.
        log_config=None,
        access_log=settings.log_level == "DEBUG",
        lifespan="on",
        # Anyone who can reach the port can open connections before any token check: bound them.
        http=bounded_protocol(ConnectionLimits(settings.http_max_connections, settings.http_head_timeout_s)),
        timeout_keep_alive=settings.http_idle_timeout_s,  # type: ignore[arg-type]  # uvicorn takes a float too
        # Open SSE streams would otherwise hold a SIGTERM'd server forever.
        timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE_S,
    )
    logging.getLogger("uvicorn.access").addFilter(TokenCut(policy.token))
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
    from coderunner.edge.stdio_wire import claim_stdio, wire_streams

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


class StartError(CodeRunnerError):
    """The server could not start, for a reason none of its own checks names (a folder it cannot make, ...)."""


#: A start failure's message is cut to this many characters (it is one line on a terminal).
START_ERROR_CHARS = 400


@contextlib.contextmanager
def _start_failures() -> Iterator[None]:
    """Any exception of the start as one line: a CodeRunnerError's own message (unwrapped from a task
    group's ExceptionGroup), anything else as a StartError naming it. The traceback is logged at DEBUG."""
    try:
        yield
    except CodeRunnerError as exc:
        if "\n" in str(exc):
            raise StartError(_one_line(str(exc))) from None
        raise
    except Exception as exc:
        leaves = _leaves(exc)
        known = [leaf for leaf in leaves if isinstance(leaf, CodeRunnerError)]
        log.debug("the server could not start", exc_info=True)
        if known:
            raise StartError(_one_line(str(known[0]))) from None
        first = leaves[0]
        detail = f"{first.strerror}: {first.filename}" if isinstance(first, OSError) and first.filename else first
        raise StartError(
            _one_line(f"the server cannot start: {detail} ({type(first).__name__}; --log-level DEBUG shows where)")
        ) from None


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an ExceptionGroup holds, however nested (or the exception itself)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= START_ERROR_CHARS else flat[: START_ERROR_CHARS - 3] + "..."


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def terminal_hint() -> str:
    """What `serve` over stdio says when a person, not an MCP client, started it in a terminal."""
    launch = LaunchCommand.for_install()
    coderunner = shlex.join([launch.command, *launch.args[:-1]])  # this install's, without "serve"
    others = ", ".join(client for client in APP_CLIENTS if client != "claude-code")
    return (
        "coderunner: waiting for an MCP client on stdin/stdout. This is the command an MCP client "
        "launches; there is nothing to type here (Ctrl-C stops it). To connect a client:\n"
        f"  Claude Code:     {snippet('claude-code', launch)}\n"
        f"  another client:  {coderunner} config CLIENT   (CLIENT: {others}; it prints what to paste, and where)\n"
        f"  several clients over HTTP:  {coderunner} serve --transport http"
    )


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


def _oneshot_host(host: Any) -> OneShotHost:
    """Where one-shot runs go: this machine's, on its SessionManager; a cluster's front door sends them to nodes."""
    return LocalOneShots.for_manager(host) if isinstance(host, SessionManager) else host


async def _stop_on_signals(manager: Any, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """stdio: on SIGTERM/SIGINT/SIGHUP close every session (bounded), then leave at once.

    The SDK reads stdin in a worker thread that no cancellation reaches, so a graceful unwind
    would wait for the client to close stdin; the sessions are what must not be left behind.
    Started with `tg.start`: the caller goes on once the signals are caught (a Ctrl-C before that
    was a KeyboardInterrupt whose unwind waited on that stdin read for ever).
    """
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s: closing sessions", signal.Signals(signum).name)
            with anyio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
                await manager.close_all()
            logging.shutdown()
            os._exit(0)


def _note_signal(signum: int, _frame: object) -> None:
    log.info("received %s: closing sessions", signal.Signals(signum).name)
