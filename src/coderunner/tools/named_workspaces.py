"""list_workspaces and delete_workspace: a client's persistent named workspaces."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from dataclasses import asdict
from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from coderunner.tools.context import ToolContext, json_result


def register(tools: ToolContext) -> None:
    @tools.tool(group="workspaces", annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_workspaces(ctx: Context) -> CallToolResult:
        """Your persistent workspaces: name, size, in use."""
        found = await tools.host.list_workspaces(tools.client(ctx))
        return json_result({"workspaces": [asdict(entry) for entry in found]})

    @tools.tool(group="workspaces", annotations=ToolAnnotations(destructive_hint=True, open_world_hint=False))
    async def delete_workspace(
        ctx: Context,
        name: Annotated[str, Field(description="From list_workspaces.")],
    ) -> CallToolResult:
        """Delete a persistent workspace and its files (not while in use)."""
        await tools.host.delete_workspace(tools.client(ctx), name)
        return json_result({"deleted": name})
