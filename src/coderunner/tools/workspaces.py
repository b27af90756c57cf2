"""list_workspaces and delete_workspace: a client's persistent named workspaces."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import contextlib
from dataclasses import asdict
from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from coderunner.hostfs.workspaces import delete_named, list_named
from coderunner.sessions.session_snapshots import keep_id
from coderunner.snapshots.store import SnapshotNotFound
from coderunner.tools.context import ToolContext, json_result


def register(tools: ToolContext) -> None:
    settings = tools.settings

    @tools.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_workspaces(ctx: Context) -> CallToolResult:
        """Your persistent workspaces: name, size, in use."""
        found = await tools.off_loop(list_named, settings.workspaces_dir, tools.client(ctx))
        return json_result({"workspaces": [asdict(entry) for entry in found]})

    @tools.tool(annotations=ToolAnnotations(destructive_hint=True, open_world_hint=False))
    async def delete_workspace(
        ctx: Context,
        name: Annotated[str, Field(description="From list_workspaces.")],
    ) -> CallToolResult:
        """Delete a persistent workspace and its files (not while in use)."""
        client = tools.client(ctx)
        await tools.off_loop(delete_named, settings.workspaces_dir, client, name, bulk=True)
        # Its saved kernel state (keep_state) goes with it.
        with contextlib.suppress(SnapshotNotFound):
            await tools.off_loop(tools.manager.snapshots.store.delete, client, keep_id(name))
        return json_result({"deleted": name})
