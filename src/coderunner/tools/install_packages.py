"""install_packages: pip inside the sandbox, into one session only."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.policy.requirements import check_requirements
from coderunner.tools.arguments import SessionId
from coderunner.tools.context import ToolContext, json_result, tool

#: Default bound on pip in install_packages.
PIP_TIMEOUT_S = 300.0


@tool(group="python")  # open-world: the default the spec gives a tool without annotations
async def install_packages(
    tools: ToolContext,
    ctx: Context,
    packages: list[str],
    session_id: SessionId = "",
    timeout_s: Annotated[float, Field(ge=1, le=1800)] = PIP_TIMEOUT_S,
) -> CallToolResult:
    """pip install into this session (kept across kernel resets); needs network."""
    wanted = check_requirements(packages)
    session = await tools.session(ctx, session_id)
    async with tools.egress_call(ctx, session) as network:
        result = await session.install_packages(wanted, timeout_s)
    if note := network.note():
        result["network"] = note
    return json_result(result)
