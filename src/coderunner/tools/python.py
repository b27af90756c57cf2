"""run_python and kernel_reset: the session's persistent kernel."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from ..output import OutputCollector
from ..variables import check_variables, parse_variables
from .arguments import SessionId, VariablesArg
from .context import ToolContext, json_result


def register(tools: ToolContext) -> None:
    settings = tools.settings

    @tools.tool()  # not closed-world: a session may have network internet
    async def run_python(
        code: Annotated[str, Field(description="The last expression's value is shown.")],
        ctx: Context,
        session_id: SessionId = "",
        timeout_s: Annotated[
            float | None,
            Field(ge=1, description=f"Seconds (default: the session's, {settings.timeout_s:g} unless set)."),
        ] = None,
        variables: VariablesArg = "",
    ) -> CallToolResult:
        """Run Python in the session's persistent sandboxed Jupyter kernel. Returns text output, charts as
        images. On timeout the cell is interrupted, state kept (or the kernel restarted: the reply says)."""

        async def progress(elapsed_s: float, output: OutputCollector) -> None:
            limit = timeout_s or settings.timeout_s
            await ctx.report_progress(elapsed_s, limit, f"running {elapsed_s:.0f}s: {output.tail_text(200)}")

        values = check_variables(parse_variables(variables), "python")
        session = await tools.session(ctx, session_id)
        async with tools.egress_call(ctx, session) as network:
            result = await session.run(code, timeout_s, progress, values)
        reply = result.to_call_result(session.session_id, links=settings.file_links == "resource_link")
        return network.noted(tools.with_export_note(reply, session))

    @tools.tool()
    async def kernel_reset(ctx: Context, session_id: SessionId = "") -> CallToolResult:
        """Restart the session's kernel: fresh state, files kept."""
        session = await tools.session(ctx, session_id)
        await session.reset()
        return json_result({"reset": True, **await tools.off_loop(tools.summary, session)})
