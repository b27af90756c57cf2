"""manage_workspaces (list, delete): a client's persistent named workspaces."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from dataclasses import asdict
from typing import Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult

from coderunner.hostfs.workspaces import WorkspaceError
from coderunner.tools.arguments import Text
from coderunner.tools.context import ToolContext, json_result, tool


@tool(group="workspaces")
async def manage_workspaces(
    tools: ToolContext, action: Literal["list", "delete"], ctx: Context, name: Text = ""
) -> CallToolResult:
    """Your persistent workspaces: list, or delete one (not while in use)."""
    if action == "list":
        found = await tools.host.list_workspaces(tools.client(ctx))
        return json_result({"workspaces": [asdict(entry) for entry in found]})
    if not name:
        raise WorkspaceError("manage_workspaces action 'delete' needs the name of a workspace (action 'list')")
    await tools.host.delete_workspace(tools.client(ctx), name)
    return json_result({"deleted": name})
