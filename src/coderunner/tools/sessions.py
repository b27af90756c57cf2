"""create_session, close_session, session_status, list_sessions: a caller's sessions."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.egress.texts import STATUS_RECENT, egress_status
from coderunner.hostfs.mounts import MountSpec
from coderunner.tools.arguments import MemoryMb, SessionId, Text, network_arg
from coderunner.tools.context import ToolContext, json_result
from coderunner.tools.snapshots import loaded_report


def register(tools: ToolContext) -> None:
    settings = tools.settings
    host = tools.host

    @tools.tool(group="sessions")
    async def create_session(
        ctx: Context,
        network: network_arg(settings.network_ceiling) = (settings.network),  # type: ignore[valid-type]  # per ceiling
        allow: Annotated[
            list[str],
            Field(description="allowlist: subset of allowed_domains."),
        ] = [],  # noqa: B006 - read only, and the schema shows it
        memory_mb: MemoryMb = settings.memory_mb,
        cpus: Annotated[float | None, Field(ge=0.1)] = None,
        timeout_s: Annotated[float, Field(ge=1, description="run_python's default, seconds.")] = settings.timeout_s,
        name: Text = "",
        persistent: Annotated[
            bool,
            Field(description="Keep the named workspace's files; the same name reopens them."),
        ] = False,
        keep_state: Annotated[
            bool,
            Field(description="persistent: also save variables at close, load them at reopen."),
        ] = False,
        mounts: Annotated[
            list[str],
            Field(description="'HOST:SANDBOX[:ro|rw]' under allowed roots."),
        ] = [],  # noqa: B006 - read only, and the schema shows it
    ) -> CallToolResult:
        """New session (own kernel and workspace). Other tools take its session_id; without one they use your
        default session."""
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

    @tools.tool(group="sessions")
    async def close_session(
        session_id: str,
        ctx: Context,
    ) -> CallToolResult:
        """Stop a session's kernel and delete its workspace."""
        session = await host.close(session_id, tools.caller(ctx))
        reply = {"closed": session_id}
        if session.close_note is not None:
            reply["state"] = session.close_note
        return json_result(reply)

    @tools.tool(group="sessions")
    async def session_status(ctx: Context, session_id: SessionId = "") -> CallToolResult:
        """A session's state, uptime, memory, limits and network."""
        session = await tools.session(ctx, session_id)
        summary = await tools.off_loop(tools.summary, session)
        summary["snapshots"] = await host.snapshots_of(session)
        if session.egress is not None:
            log, proxy = session.egress.log, session.egress.proxy
            summary["egress"] = egress_status(
                proxy.policy, log.recent(STATUS_RECENT), log.totals(), proxy.open_connections()
            )
        return json_result(summary)

    @tools.tool(group="sessions")
    async def list_sessions(ctx: Context) -> CallToolResult:
        """Your open sessions."""
        sessions = host.list(tools.caller(ctx))
        summaries = await tools.off_loop(lambda: [tools.summary(session) for session in sessions])
        return json_result({"sessions": summaries})
