"""get_capabilities: what this server offers, for a model to learn before it calls anything else."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from mcp.types import CallToolResult, ToolAnnotations

from coderunner.policy.tool_groups import ALWAYS
from coderunner.tools.context import ToolContext, json_result


def register(tools: ToolContext) -> None:
    @tools.tool(group=ALWAYS, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def get_capabilities() -> CallToolResult:
        """This server's languages, sandbox, limits, network, packages, tools."""
        names = sorted(tool.name for tool in await tools.server.list_tools())
        return json_result(await tools.capabilities.describe(tools.host, names))
