"""The MCP surface: tool registrations that parse arguments and shape results, nothing more."""

# No `from __future__ import annotations`: tool signatures are read at runtime and use closures.

import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

from . import __version__
from .kernel import KernelStartError
from .output import OutputCollector
from .results import error_result
from .sessions import Session, SessionError, SessionManager

INSTRUCTIONS = """\
CodeRunner runs Python in a persistent Jupyter kernel inside a sandbox on the user's machine.
Variables, imports and files in the workspace persist across run_python calls until kernel_reset.
The sandbox has no network and sees none of the user's files: only its own workspace
(the current directory, /workspace). Charts (matplotlib) come back as images.
Without session_id every call uses one default session; create_session gives an independent one."""

SessionId = Annotated[
    str | None,
    Field(description="Session handle from create_session; omit to use the default session."),
]


def _json_result(payload: dict[str, Any]) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(payload, indent=2))], structured_content=payload
    )


def _session_summary(session: Session, manager: SessionManager) -> dict[str, Any]:
    status = asdict(session.status())
    status["default"] = manager.is_default(session)
    return status


async def _guarded(call: Callable[[], Awaitable[CallToolResult]]) -> CallToolResult:
    """Errors a caller can act on become isError results with a plain message."""
    try:
        return await call()
    except (SessionError, KernelStartError) as exc:
        return error_result(str(exc))


def build_server(manager: SessionManager) -> MCPServer:
    server = MCPServer("coderunner", version=__version__, instructions=INSTRUCTIONS)
    settings = manager.settings

    @server.tool(structured_output=False, annotations=ToolAnnotations(open_world_hint=False))
    async def run_python(
        code: Annotated[str, Field(description="Python source; the value of the last expression is shown.")],
        ctx: Context,
        session_id: SessionId = None,
        timeout_s: Annotated[
            float | None,
            Field(gt=0, description=f"Wall-time limit in seconds (default {settings.timeout_s:g})."),
        ] = None,
    ) -> CallToolResult:
        """Run Python code in the session's persistent, sandboxed Jupyter kernel.

        Returns stdout, stderr, the last expression's value and tracebacks as text, and each
        chart or image as an image. State (variables, imports) persists between calls. On
        timeout the cell is interrupted (state kept) or, if it will not stop, the kernel is
        restarted (state lost); the reply says which, with the output produced so far.
        """

        async def progress(elapsed_s: float, output: OutputCollector) -> None:
            limit = timeout_s or settings.timeout_s
            await ctx.report_progress(elapsed_s, limit, f"running {elapsed_s:.0f}s: {output.tail_text(200)}")

        async def call() -> CallToolResult:
            session = await manager.resolve(session_id)
            result = await session.run(code, timeout_s, progress)
            return result.to_call_result()

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def kernel_reset(session_id: SessionId = None) -> CallToolResult:
        """Restart the session's kernel with fresh interpreter state; workspace files are kept."""

        async def call() -> CallToolResult:
            session = await manager.resolve(session_id)
            await session.reset()
            return _json_result({"reset": True, **_session_summary(session, manager)})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def create_session(
        network: Annotated[
            str | None,
            Field(
                description="'none' (default): no network at all. 'internet': outbound access through a "
                "user-mode network stack (the host's own services stay unreachable); code can then send "
                "data anywhere."
            ),
        ] = None,
        memory_mb: Annotated[int | None, Field(description="Address-space limit in MiB (at least 512).")] = None,
        cpus: Annotated[float | None, Field(description="CPU limit (reported; enforced where cgroups allow).")] = None,
        timeout_s: Annotated[float | None, Field(description="Default run_python timeout in seconds.")] = None,
    ) -> CallToolResult:
        """Start an independent session (own kernel, own workspace) and return its session_id."""

        async def call() -> CallToolResult:
            options = manager.options(network=network, memory_mb=memory_mb, cpus=cpus, timeout_s=timeout_s)
            session = await manager.create(options)
            return _json_result(_session_summary(session, manager))

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def close_session(
        session_id: Annotated[str, Field(description="Session to close.")],
    ) -> CallToolResult:
        """Stop a session's kernel and delete its workspace."""

        async def call() -> CallToolResult:
            await manager.close(session_id)
            return _json_result({"closed": session_id})

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def session_status(session_id: SessionId = None) -> CallToolResult:
        """Liveness, busy flag, uptime, memory used, limits and network of a session."""

        async def call() -> CallToolResult:
            return _json_result(_session_summary(await manager.resolve(session_id), manager))

        return await _guarded(call)

    @server.tool(structured_output=False)
    async def list_sessions() -> CallToolResult:
        """Open sessions of this server."""

        async def call() -> CallToolResult:
            return _json_result({"sessions": [_session_summary(s, manager) for s in manager.list()]})

        return await _guarded(call)

    return server
