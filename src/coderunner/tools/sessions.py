"""create_session and manage_sessions (status, close, list): a caller's sessions.

create_session stands alone (its many options are its own); the other three share one argument, so they
are one tool with an action. It is in the `python` group as well: a kernel's status belongs with
run_python. A kernel's reset is the seed's own tool, kernel_reset (tools/python.py).
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.egress.texts import STATUS_RECENT, egress_status
from coderunner.errors import SessionError
from coderunner.hostfs.mounts import MountSpec
from coderunner.tools.arguments import MemoryMb, SessionId, Text, network_arg
from coderunner.tools.context import ToolContext, json_result
from coderunner.tools.snapshots import loaded_report


def register(tools: ToolContext) -> None:
    # Over 80 lines on purpose: one short nested function per tool, registered by its decorator here.
    settings = tools.settings
    host = tools.host

    @tools.tool(group="sessions")
    async def create_session(
        ctx: Context,
        network: network_arg(settings.network_ceiling) = (settings.network),  # type: ignore[valid-type]  # per ceiling
        allow: Annotated[
            list[str],
            Field(description="allowlist: hosts of allowed_domains."),
        ] = [],  # noqa: B006 - read only, and the schema shows it
        memory_mb: MemoryMb = settings.memory_mb,
        cpus: Annotated[float | None, Field(ge=0.1)] = None,
        timeout_s: Annotated[float, Field(ge=1, description="Default run limit.")] = settings.timeout_s,
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
        specs = [MountSpec.parse(text) for text in mounts or []]
        options = host.options(
            network=network, memory_mb=memory_mb, cpus=cpus, timeout_s=timeout_s, mounts=specs, name=name or None,
            persistent=persistent, client=tools.client(ctx), allow=allow or None, keep_state=keep_state,
        )  # fmt: skip
        session = await host.create(options, owner=tools.caller(ctx))
        summary = await tools.off_loop(tools.summary, session)  # reads /proc and the workspace
        if session.startup is not None:
            summary["startup_files"] = session.startup
        if session.seeded is not None:
            summary["state"] = loaded_report(session.seeded)
        return json_result(summary)

    async def close(ctx: Context, session_id: str) -> CallToolResult:
        if not session_id:
            raise SessionError("manage_sessions action 'close' needs the session_id to close")
        session = await host.close(session_id, tools.caller(ctx))
        reply = {"closed": session_id}
        if session.close_note is not None:
            reply["state"] = session.close_note
        return json_result(reply)

    async def status(ctx: Context, session_id: str) -> CallToolResult:
        session = await tools.session(ctx, session_id)
        summary = await tools.off_loop(tools.summary, session, detail=True)
        if snapshots := await host.snapshots_of(session):
            summary["snapshots"] = snapshots
        if session.egress is not None:
            log, proxy = session.egress.log, session.egress.proxy
            summary["egress"] = egress_status(
                proxy.policy, log.recent(STATUS_RECENT), log.totals(), proxy.open_connections()
            )
        return json_result(summary)

    async def listing(ctx: Context) -> CallToolResult:
        sessions = host.list(tools.caller(ctx))
        summaries = await tools.off_loop(lambda: [tools.summary(session) for session in sessions])
        return json_result({"sessions": summaries})

    @tools.tool(group=("python", "sessions"))
    async def manage_sessions(
        action: Literal["status", "close", "list"], ctx: Context, session_id: SessionId = ""
    ) -> CallToolResult:
        """status, close (deletes its workspace), list."""
        if action == "list":
            return await listing(ctx)
        return await (close(ctx, session_id) if action == "close" else status(ctx, session_id))
