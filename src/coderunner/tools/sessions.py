"""create_session and manage_sessions (status, close, list): a caller's sessions.

create_session stands alone (its many options are its own); the other three share one argument, so they
are one tool with an action. It is in the `python` group as well: a kernel's status belongs with
run_python. A kernel's reset is the seed's own tool, kernel_reset (tools/python.py).
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.config import MIN_MEMORY_MB, Settings
from coderunner.egress.texts import STATUS_RECENT, egress_status
from coderunner.errors import SessionError
from coderunner.policy.mounts import parse_mount
from coderunner.tools.arguments import MemoryMb, SessionId, Text, network_arg
from coderunner.tools.context import ToolContext, json_result, tool
from coderunner.tools.snapshots import loaded_report
from coderunner.vocabulary.sandbox_request import SandboxRequest

#: create_session's default run limit (its default is the user's timeout_s).
RunLimit = Annotated[float, Field(ge=1, description="Default run limit.")]


def create_session_settings(settings: Settings) -> dict[str, tuple[Any, Any]]:
    """create_session's network offers only the modes within the user's ceiling; its defaults are the user's."""
    return {
        "network": (network_arg(settings.network_ceiling), settings.network),
        "memory_mb": (MemoryMb, settings.memory_mb),
        "timeout_s": (RunLimit, settings.timeout_s),
    }


@tool(group="sessions", per_settings=create_session_settings)
async def create_session(
    tools: ToolContext,
    ctx: Context,
    network: str = "none",  # the modes within the user's ceiling, and their default (create_session_settings)
    allow: Annotated[
        list[str],
        Field(description="allowlist: hosts of allowed_domains."),
    ] = [],  # noqa: B006 - read only, and the schema shows it
    memory_mb: MemoryMb = MIN_MEMORY_MB,
    cpus: Annotated[float | None, Field(ge=0.1)] = None,
    timeout_s: RunLimit = 60.0,
    name: Text = "",
    persistent: Annotated[
        bool,
        Field(description="Keep files; the name reopens them."),
    ] = False,
    keep_state: Annotated[
        bool,
        Field(description="persistent: keep variables too."),
    ] = False,
    mounts: Annotated[
        list[str],
        Field(description="HOST:SANDBOX[:ro|rw]"),
    ] = [],  # noqa: B006 - read only, and the schema shows it
) -> CallToolResult:
    """A new session (own kernel, workspace); tools without session_id use your default one."""
    host = tools.host
    specs = tuple(parse_mount(text) for text in mounts or [])
    options = host.options(SandboxRequest(
        network=network, memory_mb=memory_mb, cpus=cpus, timeout_s=timeout_s, mounts=specs, name=name or None,
        persistent=persistent, client=tools.client(ctx), allow=tuple(allow or ()), keep_state=keep_state,
    ))  # fmt: skip
    session = await host.create(options, owner=tools.caller(ctx))
    summary = await tools.summary(session)
    if session.startup is not None:
        summary["startup_files"] = session.startup
    if session.seeded is not None:
        summary["state"] = loaded_report(session.seeded)
    return json_result(summary)


async def close(tools: ToolContext, ctx: Context, session_id: str) -> CallToolResult:
    """manage_sessions close: the session's kernel stopped and its workspace deleted."""
    if not session_id:
        raise SessionError("manage_sessions action 'close' needs the session_id to close")
    session = await tools.host.close(session_id, tools.caller(ctx))
    reply = {"closed": session_id}
    if session.close_note is not None:
        reply["state"] = session.close_note
    return json_result(reply)


async def status(tools: ToolContext, ctx: Context, session_id: str) -> CallToolResult:
    """manage_sessions status: the full view of one session, its snapshots and its egress."""
    session = await tools.session(ctx, session_id)
    summary = await tools.summary(session, detail=True)
    if snapshots := await tools.host.snapshots_of(session):
        summary["snapshots"] = snapshots
    if session.egress is not None:
        log, proxy = session.egress.log, session.egress.proxy
        summary["egress"] = egress_status(
            proxy.policy, log.recent(STATUS_RECENT), log.totals(), proxy.open_connections()
        )
    return json_result(summary)


async def listing(tools: ToolContext, ctx: Context) -> CallToolResult:
    """manage_sessions list: the caller's open sessions, briefly."""
    sessions = tools.host.list(tools.caller(ctx))
    summaries = [await tools.summary(session) for session in sessions]
    return json_result({"sessions": summaries})


@tool(group=("python", "sessions"))
async def manage_sessions(
    tools: ToolContext, action: Literal["status", "close", "list"], ctx: Context, session_id: SessionId = ""
) -> CallToolResult:
    """status, close (deletes its workspace), list."""
    if action == "list":
        return await listing(tools, ctx)
    return await (close(tools, ctx, session_id) if action == "close" else status(tools, ctx, session_id))
